"""An emulated network for the benchmark ranks: Linux network namespaces joined by veth pairs on a
bridge, each rank's link shaped with ``tc tbf`` (``netem`` is not available here).

Rank ``r`` lives in namespace ``gcb<r>`` with address ``10.77.0.<r+1>/24`` on interface ``gcb<r>n``;
the other end of its veth pair, ``gcb<r>h``, is a port of the bridge ``gcbbr`` in the root namespace
(which has no address on it, so no traffic leaves the namespaces). ``tbf`` shapes both directions of
every rank's link to ``rate``. Everything is removed when the context ends, also on an error or
Ctrl-C, and leftovers of an interrupted earlier run are removed first. One emulated network at a
time: a second run while one is under way is refused (the names are shared; its clean-up would
tear down the first run's links). Needs root.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PREFIX = "gcb"
BRIDGE = f"{PREFIX}br"
LOCK_FILE = Path(tempfile.gettempdir()) / "gc_strategy-netns.lock"  # held while a network exists


@dataclass(frozen=True)
class RankNetwork:
    """How to start rank ``rank``: the command prefix, its address and the interface gloo uses."""

    command: list[str]
    address: str
    interface: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def existing() -> tuple[list[str], list[str]]:
    """Our namespaces and links that exist now (to clean up, or to prove there are none)."""
    namespaces = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.startswith(PREFIX)]
    links = [
        line.split(":")[1].strip().split("@")[0]
        for line in _ip("-o", "link", "show").stdout.splitlines()
        if line.split(":")[1].strip().startswith(PREFIX)
    ]
    return namespaces, links


def remove_all() -> None:
    namespaces, links = existing()
    for namespace in namespaces:
        _ip("netns", "del", namespace, check=False)
    for link in links:
        _ip("link", "del", link, check=False)


#: a rate as tc reads it: a number and a unit of bits or bytes per second, e.g. 1gbit, 100mbit, 125mbps
RATE = re.compile(r"\d+(\.\d+)?([kmgt]i?)?(bit|bps)", re.IGNORECASE)


def check_can_emulate(rate: str) -> None:
    """Refuse clearly, before anything starts, when the emulation cannot run here."""
    if not RATE.fullmatch(str(rate)):
        raise ValueError(
            f"net.rate = {rate!r} is invalid; allowed: a number and a unit as tc reads it "
            "(bit, kbit, mbit, gbit, tbit, or bps, kbps, mbps, gbps, tbps), e.g. 1gbit or 10gbit; "
            "or null for loopback"
        )
    if os.geteuid() != 0:
        raise PermissionError(
            f"net.rate={rate} needs root (network namespaces and tc); run as root, "
            "or leave net.rate unset to run on loopback"
        )
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            raise FileNotFoundError(f"net.rate={rate} needs the '{tool}' command (iproute2)")


def _setup(world_size: int, rate: str, burst: str, latency: str) -> list[RankNetwork]:
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("link", "set", BRIDGE, "up")
    ranks = []
    shape = ["tbf", "rate", rate, "burst", burst, "latency", latency]
    for r in range(world_size):
        namespace, host, inside, address = f"{PREFIX}{r}", f"{PREFIX}{r}h", f"{PREFIX}{r}n", f"10.77.0.{r + 1}"
        _ip("netns", "add", namespace)
        _ip("link", "add", host, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("link", "set", host, "master", BRIDGE)
        _ip("link", "set", host, "up")
        run_inside = ["ip", "netns", "exec", namespace]
        for command in (
            ["ip", "addr", "add", f"{address}/24", "dev", inside],
            ["ip", "link", "set", inside, "up"],
            ["ip", "link", "set", "lo", "up"],
            ["tc", "qdisc", "add", "dev", inside, "root", *shape],
        ):
            subprocess.run(run_inside + command, check=True, capture_output=True, text=True)
        subprocess.run(["tc", "qdisc", "add", "dev", host, "root", *shape], check=True, capture_output=True, text=True)
        ranks.append(RankNetwork(run_inside, address, inside))
    return ranks


@contextmanager
def emulated_network(
    world_size: int, rate: str, burst: str = "512kb", latency: str = "50ms"
) -> Iterator[list[RankNetwork]]:
    """Namespaces for ``world_size`` ranks on a bridge, every link shaped to ``rate`` both ways."""
    check_can_emulate(rate)
    with open(LOCK_FILE, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"net.rate={rate}: another run's emulated network is in use (lock {LOCK_FILE} is "
                "held); wait for it to end, or leave net.rate unset to run on loopback"
            ) from None
        remove_all()  # leftovers of a run that was killed (its lock went with it)
        try:
            try:
                ranks = _setup(world_size, rate, burst, latency)
            except subprocess.CalledProcessError as error:
                raise RuntimeError(
                    f"setting up the emulated network failed: {' '.join(error.cmd)}: {(error.stderr or '').strip()}"
                ) from None
            yield ranks
        finally:
            remove_all()


@contextmanager
def loopback(world_size: int) -> Iterator[list[RankNetwork]]:
    yield [RankNetwork([], "127.0.0.1", "lo") for _ in range(world_size)]
