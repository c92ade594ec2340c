"""Single faults at random moments, and what each costs the survivors: ``R`` replica groups (one
process each, or ``--ranks`` sharded ranks; one emulated node each, the lighthouse on node 0) train
with fault tolerance, and the last group is struck ``--count`` times by each ``--faults`` kind, one
fault at a time, each at a moment drawn at random within a step (after the group took ``--settle``
steps with every group since it last came back):

- ``kill``: SIGKILL, and started again at once under its id (it heals from a live peer);
- ``hang``: SIGSTOP for ``--silence-s`` + 3 s, then SIGCONT (it finds itself out and heals);
- ``partition``: its node's link cut (its port on the bridge down: every packet dropped, no
  connection closed) for ``--silence-s`` + 3 s, then restored;
- ``heal``: a second kill while it heals: SIGKILL, started again, and SIGKILL again at a moment drawn
  within its first quorum (after it says it joins, before its first step: the quorum and the
  transfer of a peer's state), then started again; its cost counted from the second kill.

Per fault, per survivor: the stall (the gap between its last committed step before the fault and
its first after, less its median step), the steps it did not commit until the next fault began, the
rejoin (the gap before its first step with every group again, the struck group healed, less its
median step; with DiLoCo that step holds the outer round), and the stall from the fault (the gap
from the fault to its first committed step after, less its median step): a survivor that was
already waiting for the healing group when a second kill struck counts that wait in its stall,
which belongs to the group's rejoin, but not in this one. Reported
per kind: the median and worst over the faults (each fault's worst survivor), and whether every
group ended with the same parameters (their SHA-256). Needs root (network namespaces).

The lighthouse stops counting a group it has not heard for ``--heartbeat-timeout-ms`` (1 s): that
bounds how long the survivors' next quorum waits for a killed group that was in the last one (with
two groups always: a lone survivor is less than half of the groups the lighthouse still hears).

With ``--ranks S`` (S > 1) each group is ``S`` ranks on its node (one torchrun of its own) that
shard the model with FSDP2 (each residual block a unit, then the whole); the exchange across groups
runs shard by shard. A kill is then a SIGKILL of one rank drawn at random (torchrun ends the others
and the group is started again), a hang stops every process of the group, and the digests compared
at the end are each rank's shards.

With ``--compressor diloco:COMPRESSOR[+MEMORY]`` the groups train with DiLoCo (``--inner-steps``
between outer rounds), each fault at a moment drawn within an inner phase; a survivor's steps are
its inner steps, and a step lost is one it took again or skipped (its inner-step counter not one
past the one before). The digest is of the outer parameters.

    python benchmarks/fault_chaos.py --count 20
    python benchmarks/fault_chaos.py --count 20 --compressor diloco:topk+residual --join-timeout-ms 5000
    python benchmarks/fault_chaos.py --count 20 --groups 2 --ranks 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
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
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import netns  # noqa: E402
from cli import integer_at_least  # noqa: E402
from fault_tolerance import configuration, roles_of, shard  # noqa: E402
from ft_loop import (  # noqa: E402
    launcher,
    records,
    together,
    torchrun_ranks,
    train_inner_steps_until_stopped,
    train_until_stopped,
    write_stop,
)

from gc_strategy.sync.fault_tolerance.lighthouse import HEARTBEAT_TIMEOUT_S  # noqa: E402

LIGHTHOUSE_PORT = 29510
FAULTS = ("kill", "hang", "partition", "heal")


def worker(args: argparse.Namespace) -> None:
    """One replica group (or one rank of a sharded one): ResNet-18 through the fault-tolerant
    synchroniser until the step named in ``--stop`` (once written) with every group; each step's
    end, outcome and participants printed as it ends (by the group's rank 0), this rank's
    parameters' SHA-256 at the end."""
    import torch
    import torch.distributed as dist
    import torchvision

    from gc_strategy import DiLoCo, FaultTolerance, FaultTolerantDiLoCo
    from gc_strategy.sync.fault_tolerance.every_step import FaultTolerantSynchronizer
    from gc_strategy.sync.fault_tolerance.sharded import FaultTolerantShardedSynchronizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    mesh, rank, ranks = None, 0, 1
    if "LOCAL_RANK" in os.environ:  # a group of several ranks, started by torchrun
        dist.init_process_group("gloo")
        rank, ranks = dist.get_rank(), dist.get_world_size()
        mesh = shard(model, (1, ranks))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    roles = roles_of(args.compressor)
    options = FaultTolerance(args.lighthouse, args.group, groups=args.groups, silence_s=args.silence_s, host=args.host)
    diloco = args.compressor.startswith("diloco:")
    if diloco:
        sync = FaultTolerantDiLoCo(model, roles, DiLoCo(inner_steps=args.inner_steps), options, mesh=mesh)
    elif mesh is not None:
        sync = FaultTolerantShardedSynchronizer(model, roles, options, mesh)
    else:
        sync = FaultTolerantSynchronizer(model, roles, options)
    sync.use_optimizers([optimizer])
    shard_index = args.group * ranks + rank

    def loss_of(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * shard_index + step)
        x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
        return torch.nn.functional.cross_entropy(model(x), y)

    log = sys.stdout
    if rank:  # the group's records are its rank 0's
        sys.stdout = open(os.devnull, "w")
    print(json.dumps({"joining": time.time()}), flush=True)  # its first quorum (a heal) follows
    train = train_inner_steps_until_stopped if diloco else train_until_stopped
    train(sync, optimizer, loss_of, args.groups, Path(args.stop))
    parameters = sync.replicated_parameters().values()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in parameters)).hexdigest()
    print(json.dumps({"digest": digest, "rank": rank}), file=log, flush=True)
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
        command = [*node.command, *launcher(args.ranks), str(Path(__file__).resolve()), *options]
        log, err = (self.folder / f"{group}.log").open("ab"), (self.folder / f"{group}.err").open("ab")
        return subprocess.Popen(command, env=env, stdout=log, stderr=err)

    def wait_until_settled(self, timeout: float = 600) -> None:
        """Until the victim took ``--settle`` more steps with every group, and the first group as
        many in all (at the start a group that healed from the victim records its first steps
        after the victim's: its median step is measured on them)."""
        log, first = self.folder / f"{self.victim}.log", self.folder / "0.log"
        target = together(log, self.groups) + self.args.settle
        deadline = time.monotonic() + timeout
        while together(log, self.groups) < target or together(first, self.groups) < self.args.settle:
            if time.monotonic() > deadline:
                raise SystemExit(f"group {self.victim} did not come back within {timeout} s")
            time.sleep(0.1)

    def strike(self, kind: str, delay: float) -> tuple[str, float, float]:
        """One fault of ``kind`` after ``delay`` s; its kind as struck, the time it began and the
        time its cost is counted from (a heal's second kill)."""
        time.sleep(delay)
        began, held = time.time(), self.args.silence_s + 3
        struck = began
        process = self.processes[self.victim]
        if kind in ("kill", "heal"):
            runs = len(records(self.folder / f"{self.victim}.log", "joining"))
            self.restart()
            if kind == "heal":
                struck, kind = self.kill_in_heal(runs)
        elif kind == "hang":  # every process of the group
            pids = [process.pid, *self.ranks()]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(held)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        else:
            link = f"{netns.PREFIX}{self.victim}h"
            subprocess.run(["ip", "link", "set", link, "down"], check=True)
            time.sleep(held)
            subprocess.run(["ip", "link", "set", link, "up"], check=True)
        return kind, began, struck

    def restart(self) -> None:
        """SIGKILL the victim (one of its ranks, drawn, where it has several: torchrun ends the
        others) and start it again under its id."""
        process = self.processes[self.victim]
        os.kill(self.draw.choice(self.ranks()) if self.args.ranks > 1 else process.pid, signal.SIGKILL)
        process.wait(timeout=60)
        self.processes[self.victim] = self.start(self.victim)

    def ranks(self, group: int | None = None) -> list[int]:
        """The process ids of a group's ranks (the victim's by default) where torchrun started them
        (each the leader of a process group of its own: signalled one by one), else none."""
        if self.args.ranks == 1:
            return []
        return torchrun_ranks(self.processes[self.victim if group is None else group])

    def kill(self) -> None:
        """Every group's processes, its ranks first."""
        for group, process in enumerate(self.processes):
            for pid in [*self.ranks(group), process.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

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

    def finish(self, timeout: float = 600) -> list[dict]:
        """Every group ends ``STOP_MARGIN`` steps after the furthest; their ranks' parameters' digests."""
        write_stop(self.folder / "stop", [self.folder / f"{g}.log" for g in range(self.groups)])
        for g, process in enumerate(self.processes):
            if process.wait(timeout=timeout) != 0:
                raise SystemExit(f"group {g} failed: {(self.folder / f'{g}.log').read_text()[-2000:]}")
        return [digest for g in range(self.groups) for digest in records(self.folder / f"{g}.log", "digest")]


class Cost(NamedTuple):
    """What one fault cost one survivor."""

    stall: float  #: the gap between its last committed step before the fault and its first after, less its median
    lost: int  #: steps not committed, and those its counter skipped or took again, until the next fault
    #: the gap before its first step with every group again (the struck group healed), less its median; NaN where
    #: the struck group was never left out (a fault over before the next round)
    rejoin: float
    #: the gap from the fault to its first committed step after, less its median
    from_fault: float


def cost(steps: list[dict], groups: int, struck: float, until: float) -> Cost:
    """A survivor's cost of a fault at ``struck`` (the next fault begins at ``until``), from its
    ``steps``; a lost step is one not committed, or one its counter skipped or took again (a
    committed step not one past the one committed before it)."""
    committed = [r for r in steps if r["committed"]]
    ends = [r["end"] for r in committed]
    typical = statistics.median(b - a for a, b in zip(ends, ends[1:]))
    before = max(t for t in ends if t <= struck)
    after = min(t for t in ends if t > struck)
    failed = sum(not r["committed"] for r in steps if struck < r["end"] <= until)
    pairs = [(a, b) for a, b in zip(committed, committed[1:]) if struck < b["end"] <= until]
    jumps = sum(b["step"] != a["step"] + 1 for a, b in pairs)
    back = next((b["end"] - a["end"] for a, b in pairs if a["with"] < groups == b["with"]), float("nan"))
    return Cost(after - before - typical, failed + jumps, back - typical, after - struck - typical)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--stop", default="", help=argparse.SUPPRESS)
    parser.add_argument("--groups", type=integer_at_least(2), default=3)
    parser.add_argument("--ranks", type=integer_at_least(1), default=1, help="per group, sharded with FSDP2 where > 1")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--count", type=integer_at_least(1), default=20, help="faults of each kind")
    parser.add_argument("--settle", type=integer_at_least(1), default=3, help="steps with every group between faults")
    parser.add_argument(
        "--compressor", type=configuration, default="topk+residual", help="[diloco:]COMPRESSOR[+MEMORY]"
    )
    parser.add_argument("--inner-steps", type=integer_at_least(1), default=5, help="DiLoCo's, with diloco:")
    parser.add_argument("--silence-s", type=float, default=5.0, help="fault_tolerance's silence_s")
    parser.add_argument("--join-timeout-ms", type=integer_at_least(1), default=1000, help="the lighthouse's")
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=integer_at_least(1),
        default=int(HEARTBEAT_TIMEOUT_S * 1000),
        help="the lighthouse's: at most silence_s",
    )
    parser.add_argument("--rate", default="1gbit", help="every node's link (tc tbf)")
    parser.add_argument("--seed", type=int, default=63)
    parser.add_argument("--logs", default="", help="keep the groups' and the lighthouse's logs in this folder")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    netns.check_can_emulate(args.rate)
    draw = random.Random(args.seed)
    plan = [kind for _ in range(args.count) for kind in args.faults]
    draw.shuffle(plan)
    with ExitStack() as stack:
        nodes = stack.enter_context(netns.emulated_network(args.groups, args.rate))
        kept = Path(args.logs) if args.logs else None
        folder = kept or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gc_chaos")))
        folder.mkdir(parents=True, exist_ok=True)
        binary = Path(sys.executable).with_name("torchft_lighthouse")
        command = [*nodes[0].command, str(binary), "--min_replicas", "1", "--join_timeout_ms"]
        command += [str(args.join_timeout_ms), "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms)]
        command += ["--bind", f"{nodes[0].address}:{LIGHTHOUSE_PORT}"]
        with (folder / "lighthouse.log").open("ab") as log:
            lighthouse = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        stack.callback(lighthouse.kill)
        time.sleep(1.0)
        cluster = Cluster(nodes, args, folder, draw)
        stack.callback(cluster.kill)
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


def worst(figures) -> float:
    """The largest of ``figures`` that are numbers (NaN: a survivor saw no rejoin), else NaN."""
    numbers = [f for f in figures if not math.isnan(f)]
    return max(numbers) if numbers else float("nan")


def report(
    args: argparse.Namespace, struck: list[tuple[str, float, float]], survivors: list, digests: list[dict]
) -> None:
    ends = [began for _, began, _ in struck[1:]] + [float("inf")]
    per_kind: dict[str, list[Cost]] = {kind: [] for kind in args.faults}
    for (kind, _, at), until in zip(struck, ends):
        costs = [cost(steps, args.groups, at, until) for steps in survivors]
        per_kind.setdefault(kind, []).append(Cost(*(worst(c[i] for c in costs) for i in range(len(Cost._fields)))))
    groups = f"{args.groups} groups" + (f" of {args.ranks} ranks (FSDP2)" if args.ranks > 1 else "")
    print(f"\n{groups}, ResNet-18 ({args.compressor}), links {args.rate}, silence_s {args.silence_s}")
    print(
        "| fault | count | stall median (s) | stall worst (s) | steps lost (median, worst) | rejoin (median, worst) "
        "| from the fault (median, worst) |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind, rows in per_kind.items():
        if not rows:  # every planned second kill missed the heal
            continue
        stalls, lost = [r.stall for r in rows], [r.lost for r in rows]
        back = [r.rejoin for r in rows if not math.isnan(r.rejoin)]
        rejoins = f"{statistics.median(back):.2f}, {max(back):.2f}" if back else "none"
        since = [r.from_fault for r in rows]
        print(
            f"| {kind} | {len(rows)} | {statistics.median(stalls):.2f} | {max(stalls):.2f} | "
            f"{statistics.median(lost):g}, {max(lost)} | {rejoins} | {statistics.median(since):.2f}, {max(since):.2f} |"
        )
    each = [{d["digest"] for d in digests if d["rank"] == r} for r in range(args.ranks)]
    alike = len(digests) == args.groups * args.ranks and all(len(ranks) == 1 for ranks in each)
    print(f"every group ended with the same parameters: {alike} ({len(digests)} digests)")
    for name in Cost._fields:
        figures = ", ".join(
            f"{kind} {getattr(c, name):.{2 * (name != 'lost')}f}" for kind, rows in per_kind.items() for c in rows
        )
        print(f"{name} per fault: {figures}")


if __name__ == "__main__":
    main()
