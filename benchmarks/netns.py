"""An emulated cluster for the benchmark ranks: one Linux network namespace per node, the nodes
joined by veth pairs on a bridge, each node's link shaped with ``tc tbf`` (``netem`` is not
available here).

Node ``n`` is namespace ``gcb<n>`` with address ``10.77.0.<n+1>/24`` on interface ``gcb<n>n``; the
other end of its veth pair, ``gcb<n>h``, is a port of the bridge ``gcbbr`` in the root namespace
(which has no address on it, so no traffic leaves the namespaces). ``tbf`` shapes both directions of
every node's link to ``rate``. The ranks of one node share its namespace and address: what they send
each other stays inside the namespace (the kernel routes a namespace's own addresses over its
loopback), unshaped, as over a node's fast local links; only what goes to another node crosses the
shaped link, and the interface's ``tx_bytes`` counter counts it (:func:`sent_bytes`). With one rank
per node every link between ranks is shaped. Everything is removed when the context ends, also on an
error or Ctrl-C, and leftovers of an interrupted earlier run are removed first. One emulated network
at a time: a second run while one is under way is refused (the names are shared; its clean-up would
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
class NodeNetwork:
    """How to start a rank on one node: the command prefix, the node's address and the interface gloo
    uses."""

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


def sent_bytes(interface: str) -> int:
    """Bytes sent so far through ``interface`` of the calling process's network namespace (the
    kernel's counter, headers included)."""
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


def _setup(nodes: int, rate: str, burst: str, latency: str) -> list[NodeNetwork]:
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("link", "set", BRIDGE, "up")
    networks = []
    shape = ["tbf", "rate", rate, "burst", burst, "latency", latency]
    for n in range(nodes):
        namespace, host, inside, address = f"{PREFIX}{n}", f"{PREFIX}{n}h", f"{PREFIX}{n}n", f"10.77.0.{n + 1}"
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
        networks.append(NodeNetwork(run_inside, address, inside))
    return networks


@contextmanager
def emulated_network(nodes: int, rate: str, burst: str = "512kb", latency: str = "50ms") -> Iterator[list[NodeNetwork]]:
    """One namespace per node on a bridge, every node's link shaped to ``rate`` both ways."""
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
                networks = _setup(nodes, rate, burst, latency)
            except subprocess.CalledProcessError as error:
                raise RuntimeError(
                    f"setting up the emulated network failed: {' '.join(error.cmd)}: {(error.stderr or '').strip()}"
                ) from None
            yield networks
        finally:
            remove_all()


@contextmanager
def loopback(nodes: int) -> Iterator[list[NodeNetwork]]:
    """Every node on this machine's loopback: nothing is shaped, and nothing tells the nodes apart."""
    yield [NodeNetwork([], "127.0.0.1", "lo") for _ in range(nodes)]
