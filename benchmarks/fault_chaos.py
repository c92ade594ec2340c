"""Single faults at random moments, and what each costs the survivors: ``R`` replica groups (one
process each, one emulated node each, the lighthouse on node 0) train with fault tolerance, and the
last group is struck ``--count`` times by each ``--faults`` kind, one fault at a time, each at a
moment drawn at random within a step (after the group took ``--settle`` steps with every group since
it last came back):

- ``kill``: SIGKILL, and started again at once under its id (it heals from a live peer);
- ``hang``: SIGSTOP for ``--silence-s`` + 3 s, then SIGCONT (it finds itself out and heals);
- ``partition``: its node's link cut (its port on the bridge down: every packet dropped, no
  connection closed) for ``--silence-s`` + 3 s, then restored;
- ``heal``: a second kill while it heals: SIGKILL, started again, and SIGKILL again at a moment drawn
  within its first quorum (after it says it joins, before its first step: the quorum and the
  transfer of a peer's state), then started again; its cost counted from the second kill.

Per fault, per survivor: the stall (the gap between its last committed step before the fault and
its first after, less its median step) and the steps it did not commit. Reported per kind: the
stall's median and worst over the faults (each fault's worst survivor), the steps lost, and whether
every group ended with the same parameters (their SHA-256). Needs root (network namespaces).

With ``--compressor diloco:COMPRESSOR[+MEMORY]`` the groups train with DiLoCo (``--inner-steps``
between outer rounds), each fault at a moment drawn within an inner phase; a survivor's steps are
its inner steps, and a step lost is one it took again or skipped (its inner-step counter not one
past the one before). The digest is of the outer parameters.

    python benchmarks/fault_chaos.py --count 20
    python benchmarks/fault_chaos.py --count 20 --compressor diloco:topk+residual --join-timeout-ms 5000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import netns  # noqa: E402
from cli import integer_at_least  # noqa: E402
from fault_tolerance import configuration, roles_of  # noqa: E402
from ft_loop import records, together, train_inner_steps_until_stopped, train_until_stopped  # noqa: E402

LIGHTHOUSE_PORT = 29510
FAULTS = ("kill", "hang", "partition", "heal")


def worker(args: argparse.Namespace) -> None:
    """One replica group: ResNet-18 through ``FaultTolerantSynchronizer`` until the step named in
    ``--stop`` (once written) with every group; each step's end, outcome and participants printed
    as it ends, the parameters' SHA-256 at the end."""
    import torch
    import torchvision

    from gc_strategy import DiLoCo, FaultTolerance, FaultTolerantDiLoCo
    from gc_strategy.sync.fault_tolerance.every_step import FaultTolerantSynchronizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    roles = roles_of(args.compressor)
    options = FaultTolerance(args.lighthouse, args.group, groups=args.groups, silence_s=args.silence_s, host=args.host)
    diloco = args.compressor.startswith("diloco:")
    if diloco:
        sync = FaultTolerantDiLoCo(model, roles, DiLoCo(inner_steps=args.inner_steps), options)
    else:
        sync = FaultTolerantSynchronizer(model, roles, options)
    sync.use_optimizers([optimizer])

    def loss_of(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * args.group + step)
        x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
        return torch.nn.functional.cross_entropy(model(x), y)

    print(json.dumps({"joining": time.time()}), flush=True)  # its first quorum (a heal) follows
    train = train_inner_steps_until_stopped if diloco else train_until_stopped
    train(sync, optimizer, loss_of, args.groups, Path(args.stop))
    parameters = sync.replicated_parameters().values()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in parameters)).hexdigest()
    print(json.dumps({"digest": digest}), flush=True)
    sync.close()


class Cluster:
    """The groups on their nodes, and the faults struck on the last one."""

    def __init__(self, nodes: list, args: argparse.Namespace, folder: Path, draw: random.Random) -> None:
        self.nodes, self.args, self.folder, self.draw = nodes, args, folder, draw
        self.groups = len(nodes)
        self.lighthouse = f"http://{nodes[0].address}:{LIGHTHOUSE_PORT}"
        self.processes = [self.start(g) for g in range(self.groups)]
        self.victim = self.groups - 1

    def start(self, group: int) -> subprocess.Popen:
        node, args = self.nodes[group], self.args
        options = ["--worker", "--group", str(group), "--groups", str(self.groups), "--lighthouse", self.lighthouse]
        options += ["--host", node.address, "--compressor", args.compressor, "--silence-s", str(args.silence_s)]
        options += ["--inner-steps", str(args.inner_steps)]
        options += ["--stop", str(self.folder / "stop")]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": node.interface, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
        command = [*node.command, sys.executable, str(Path(__file__).resolve()), *options]
        log = (self.folder / f"{group}.log").open("ab")
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.DEVNULL)

    def wait_until_settled(self, timeout: float = 600) -> None:
        """Until the victim took ``--settle`` more steps with every group."""
        log = self.folder / f"{self.victim}.log"
        target = together(log, self.groups) + self.args.settle
        deadline = time.monotonic() + timeout
        while together(log, self.groups) < target:
            if time.monotonic() > deadline:
                raise SystemExit(f"group {self.victim} did not come back within {timeout} s")
            time.sleep(0.1)

    def strike(self, kind: str, delay: float) -> tuple[str, float]:
        """One fault of ``kind`` after ``delay`` s; its kind as struck, and the time it struck."""
        time.sleep(delay)
        struck, held = time.time(), self.args.silence_s + 3
        process = self.processes[self.victim]
        if kind in ("kill", "heal"):
            runs = len(records(self.folder / f"{self.victim}.log", "joining"))
            self.restart()
            if kind == "heal":
                struck, kind = self.kill_in_heal(runs)
        elif kind == "hang":
            process.send_signal(signal.SIGSTOP)
            time.sleep(held)
            process.send_signal(signal.SIGCONT)
        else:
            link = f"{netns.PREFIX}{self.victim}h"
            subprocess.run(["ip", "link", "set", link, "down"], check=True)
            time.sleep(held)
            subprocess.run(["ip", "link", "set", link, "up"], check=True)
        return kind, struck

    def restart(self) -> None:
        """SIGKILL the victim and start it again under its id."""
        process = self.processes[self.victim]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        self.processes[self.victim] = self.start(self.victim)

    def kill_in_heal(self, runs: int, timeout: float = 120) -> tuple[float, str]:
        """Once the restarted victim says it joins (its ``runs + 1``-th start), SIGKILL it again at
        a moment drawn within its first quorum (0 to 1.5 s on: the quorum and the transfer of a
        peer's state), then start it again; the time of that kill, and its kind: ``heal``, or
        ``kill`` where the group took its first step before it (the kill missed the heal)."""
        log = self.folder / f"{self.victim}.log"
        deadline = time.monotonic() + timeout
        while len(records(log, "joining")) <= runs:
            if time.monotonic() > deadline:
                raise SystemExit(f"group {self.victim} did not start within {timeout} s")
            time.sleep(0.01)
        steps = len(records(log))
        time.sleep(self.draw.uniform(0, 1.5))
        struck = time.time()
        self.restart()
        return struck, "heal" if len(records(log)) == steps else "kill"

    def finish(self, timeout: float = 600) -> list[str]:
        """Every group ends 20 steps after the furthest; their parameters' digests."""
        last = max(r["step"] for g in range(self.groups) for r in records(self.folder / f"{g}.log"))
        (self.folder / "stop").write_text(str(last + 20))
        for g, process in enumerate(self.processes):
            if process.wait(timeout=timeout) != 0:
                raise SystemExit(f"group {g} failed: {(self.folder / f'{g}.log').read_text()[-2000:]}")
        return [
            json.loads(line)["digest"]
            for g in range(self.groups)
            for line in (self.folder / f"{g}.log").read_text().splitlines()
            if line.startswith('{"digest"')
        ]


def cost(steps: list[dict], struck: float, until: float) -> tuple[float, int]:
    """A survivor's stall for a fault at ``struck`` (its next fault at ``until``), and the steps
    it lost in between: those it did not commit, and those its counter skipped or took again (a
    committed step not one past the one committed before it)."""
    committed = [r for r in steps if r["committed"]]
    ends = [r["end"] for r in committed]
    typical = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    before = max(t for t in ends if t <= struck)
    after = min(t for t in ends if t > struck)
    failed = sum(not r["committed"] for r in steps if struck < r["end"] <= until)
    jumps = sum(b["step"] != a["step"] + 1 for a, b in zip(committed, committed[1:]) if struck < b["end"] <= until)
    return after - before - typical, failed + jumps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--stop", default="", help=argparse.SUPPRESS)
    parser.add_argument("--groups", type=integer_at_least(2), default=3)
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--count", type=integer_at_least(1), default=20, help="faults of each kind")
    parser.add_argument("--settle", type=integer_at_least(1), default=3, help="steps with every group between faults")
    parser.add_argument(
        "--compressor", type=configuration, default="topk+residual", help="[diloco:]COMPRESSOR[+MEMORY]"
    )
    parser.add_argument("--inner-steps", type=integer_at_least(1), default=5, help="DiLoCo's, with diloco:")
    parser.add_argument("--silence-s", type=float, default=5.0, help="fault_tolerance's silence_s")
    parser.add_argument("--join-timeout-ms", type=integer_at_least(1), default=1000, help="the lighthouse's")
    parser.add_argument("--rate", default="1gbit", help="every node's link (tc tbf)")
    parser.add_argument("--seed", type=int, default=63)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    netns.check_can_emulate(args.rate)
    draw = random.Random(args.seed)
    plan = [kind for _ in range(args.count) for kind in args.faults]
    draw.shuffle(plan)
    with ExitStack() as stack:
        nodes = stack.enter_context(netns.emulated_network(args.groups, args.rate))
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gc_chaos")))
        binary = Path(sys.executable).with_name("torchft_lighthouse")
        heartbeat_ms = str(int(args.silence_s * 1000))
        command = [*nodes[0].command, str(binary), "--min_replicas", "1", "--join_timeout_ms"]
        command += [str(args.join_timeout_ms), "--heartbeat_timeout_ms", heartbeat_ms]
        command += ["--bind", f"{nodes[0].address}:{LIGHTHOUSE_PORT}"]
        lighthouse = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(lighthouse.kill)
        time.sleep(1.0)
        cluster = Cluster(nodes, args, folder, draw)
        stack.callback(lambda: [p.kill() for p in cluster.processes])
        struck = []
        for n, kind in enumerate(plan):
            cluster.wait_until_settled()
            steps = [r for r in records(folder / "0.log") if r["committed"]]
            step = statistics.median(b["end"] - a["end"] for a, b in zip(steps[-20:], steps[-19:]))
            period = step * (args.inner_steps if args.compressor.startswith("diloco:") else 1)
            struck.append(cluster.strike(kind, draw.uniform(0, period)))
            print(f"fault {n + 1}/{len(plan)}: {kind}", file=sys.stderr, flush=True)
        cluster.wait_until_settled()
        digests = cluster.finish()
        survivors = [records(folder / f"{g}.log") for g in range(args.groups - 1)]
    report(args, struck, survivors, digests)


def report(args: argparse.Namespace, struck: list[tuple[str, float]], survivors: list, digests: list[str]) -> None:
    ends = [t for _, t in struck[1:]] + [float("inf")]
    per_kind: dict[str, list[tuple[float, int]]] = {kind: [] for kind in args.faults}
    for (kind, at), until in zip(struck, ends):
        costs = [cost(steps, at, until) for steps in survivors]
        per_kind.setdefault(kind, []).append((max(c[0] for c in costs), max(c[1] for c in costs)))
    print(f"\n{args.groups} groups, ResNet-18 ({args.compressor}), links {args.rate}, silence_s {args.silence_s}")
    print("| fault | count | stall median (s) | stall worst (s) | steps lost (median, worst) |")
    print("|---|---|---|---|---|")
    for kind, rows in per_kind.items():
        if not rows:  # every planned second kill missed the heal
            continue
        stalls, lost = [r[0] for r in rows], [r[1] for r in rows]
        print(
            f"| {kind} | {len(rows)} | {statistics.median(stalls):.2f} | {max(stalls):.2f} | "
            f"{statistics.median(lost):g}, {max(lost)} |"
        )
    print(f"every group ended with the same parameters: {len(set(digests)) == 1} ({len(digests)} digests)")
    print("stalls per fault:", ", ".join(f"{kind} {s:.2f}" for kind, rows in per_kind.items() for s, _ in rows))


if __name__ == "__main__":
    main()
