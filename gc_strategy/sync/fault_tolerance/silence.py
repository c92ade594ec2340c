"""A hung or cut-off participant found by its silence (docs/fault_tolerance.md, "How a failure is
detected").

A process that is frozen (SIGSTOP, a stuck file system, a swapping host) or cut off by the network
keeps its connections open: a collective that waits for it fails only at its timeout, and
``timeout_s`` must be long enough for a large bucket over a slow link. Silence is a better sign:
every process of a round sends a datagram to each peer of the round's process group every
``silence_s / 5`` seconds from a thread of its own, which keeps beating while the process computes
or waits in a collective and stops when the process stops or its packets are lost. A peer unheard
for ``silence_s`` while a round runs fails the round (``on_silence``), which aborts its process group
(:mod:`~gc_strategy.sync.fault_tolerance.abort`): the survivors go on to the next quorum, which
torchft's lighthouse forms without the silent group once its own heartbeats to the lighthouse
stopped (``--heartbeat_timeout_ms``, 5 s by default). The silent group, when it wakes, finds its
connections shut down, fails its round and heals.

Datagrams, not a connection: a lost one is no error, a frozen peer's kernel still accepts TCP
connections, and a beat costs one small packet per peer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

#: the beats in one silence bound: a peer is declared silent after missing this many in a row
BEATS_PER_BOUND = 5
BEAT = b"gc_strategy heartbeat"
#: where a process group's store holds each member's heartbeat address (``STORE_KEY/RANK``)
STORE_KEY = "gc_strategy_heartbeat"

Address = tuple[str, int]


class Heartbeats:
    """This process's beats to the peers of its rounds, and the watch on theirs (see the module's
    docstring). ``on_silence(peers)`` is called, from the beating thread, when a peer of a running
    round (between :meth:`arm` and :meth:`disarm`) was unheard for ``silence_s``."""

    def __init__(self, host: str, silence_s: float, on_silence: Callable[[list[Address]], None]) -> None:
        self.silence_s = silence_s
        self.on_silence = on_silence
        self.interval = silence_s / BEATS_PER_BOUND
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((socket.gethostbyname(host), 0))
        self.socket.settimeout(self.interval / 2)
        self.address: Address = self.socket.getsockname()
        self._lock = threading.Lock()
        self._heard: dict[Address, float] = {}
        self._armed = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="gc_strategy heartbeats", daemon=True)
        self._thread.start()

    def exchange(self, store: Any, rank: int, world_size: int) -> None:
        """Learn the peers of a new process group through the store it is formed with (each one's
        address under its rank, read within the store's timeout) and hear from each as of now: the
        watch then covers the round from its first collective."""
        host, port = self.address
        store.set(f"{STORE_KEY}/{rank}", f"{host}:{port}")
        peers = [store.get(f"{STORE_KEY}/{r}").decode().rsplit(":", 1) for r in range(world_size)]
        self.watch([(peer_host, int(peer_port)) for peer_host, peer_port in peers])

    def watch(self, peers: list[Address]) -> None:
        """Beat to ``peers`` (this process's own address among them is left out) and hear from
        each as of now."""
        now = time.monotonic()
        with self._lock:
            self._heard = {peer: now for peer in peers if peer != self.address}

    def arm(self) -> None:
        """A round runs: watch the peers."""
        with self._lock:
            self._armed = True

    def disarm(self) -> None:
        """The round's collectives are over: stop watching."""
        with self._lock:
            self._armed = False

    def _beat(self) -> None:
        next_beat = 0.0
        while not self._stopped.is_set():
            now = time.monotonic()
            with self._lock:
                peers = list(self._heard)
            if now >= next_beat:
                for peer in peers:
                    try:
                        self.socket.sendto(BEAT, peer)
                    except OSError:  # unreachable: it stays unheard
                        pass
                next_beat = now + self.interval
            try:
                data, sender = self.socket.recvfrom(64)
            except (TimeoutError, OSError):
                data, sender = b"", None
            now = time.monotonic()
            with self._lock:
                if data == BEAT and sender in self._heard:
                    self._heard[sender] = now
                silent = [peer for peer, heard in self._heard.items() if now - heard > self.silence_s]
                fire = self._armed and bool(silent)
                if fire:
                    self._armed = False
                    self.on_silence(silent)

    def close(self) -> None:
        """Stop beating (the peers' watch then finds this process silent, as it has left)."""
        self._stopped.set()
        self._thread.join(timeout=2 * self.interval + 1)
        self.socket.close()
