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

Before a round, a member of a new quorum is found lost by its lateness instead. The lighthouse
answers the members of a quorum at once, and each writes its heartbeat address into the store of the
quorum's process group as the first act of forming it (:meth:`Heartbeats.exchange`): a member dead
before it wrote (killed while it waited for the quorum, whose lighthouse still counted it) leaves
nothing else to tell. A member whose address is not written within the arrival bound
(:class:`ArrivalBound`) is taken as lost, and the formation fails: the next quorum, formed once the
lighthouse stopped counting the dead member, goes on without it. The bound follows what the
formations of this run took, so that members far apart are not taken as lost.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: the beats in one silence bound: a peer is declared silent after missing this many in a row
BEATS_PER_BOUND = 5
BEAT = b"gc_strategy heartbeat"
#: where a process group's store holds each member's heartbeat address (``STORE_KEY/RANK``)
STORE_KEY = "gc_strategy_heartbeat"

Address = tuple[str, int]


class ArrivalBound:
    """How long a member of a new quorum waits for the others' heartbeat addresses before it takes
    a missing one as lost: ``MARGIN`` times the longest of the last ``RECENT`` waits that ended with
    every member, at least ``FLOOR_S`` and at most ``silence_s``. ``silence_s`` before any such
    wait, and for the formation right after one whose wait ran out: a member lost is then not in
    the next quorum, and a member merely slow (far apart, on a loaded host) arrives within it,
    and its wait is learned, so that slow members cost one formation, not every one, and a loss
    does not lengthen the next."""

    #: a live member writes within milliseconds of the others, answered with them: its lateness
    #: here is the network's and the host's jitter, which a quorum's members see alike
    FLOOR_S = 1.0
    MARGIN = 4.0
    RECENT = 8

    def __init__(self, silence_s: float) -> None:
        self.silence_s = silence_s
        self.waits: deque[float] = deque(maxlen=self.RECENT)
        self.ran_out = False

    def seconds(self) -> float:
        if self.ran_out or not self.waits:
            return self.silence_s
        return min(self.silence_s, max(self.FLOOR_S, self.MARGIN * max(self.waits)))

    def arrived(self, waited: float) -> None:
        """Every member arrived, ``waited`` s after this one."""
        self.waits.append(waited)
        self.ran_out = False

    def missed(self) -> None:
        """A member did not arrive within the bound."""
        self.ran_out = True


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
        self.arrival = ArrivalBound(silence_s)
        self._lock = threading.Lock()
        self._heard: dict[Address, float] = {}
        self._armed = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="gc_strategy heartbeats", daemon=True)
        self._thread.start()

    def exchange(self, store: Any, rank: int, world_size: int) -> None:
        """Learn the members of a new process group through the store it is formed with (each
        one's address under its rank) and hear from each as of now: the watch then covers the round
        from its first collective. Raises ``TimeoutError`` where a member's address is not written
        within the arrival bound (the module's docstring)."""
        host, port = self.address
        store.set(f"{STORE_KEY}/{rank}", f"{host}:{port}")
        keys = [f"{STORE_KEY}/{r}" for r in range(world_size)]
        bound, begin = self.arrival.seconds(), time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=bound))
        except RuntimeError as error:  # the store's timeout (DistStoreError), or its host's loss
            if time.monotonic() - begin < bound:
                raise
            self.arrival.missed()
            raise TimeoutError(
                f"fault_tolerance: a member of the new quorum's process group (of {world_size}) did not arrive "
                f"within {bound:.2f} s of this one, the arrival bound: taken as lost before the round"
            ) from error
        self.arrival.arrived(time.monotonic() - begin)
        peers = [store.get(key).decode().rsplit(":", 1) for key in keys]
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
