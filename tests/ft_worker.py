"""One replica group of the fault-tolerance tests (tests/sync/fault_tolerance/test_fault_tolerance.py): a small MLP
trained through FaultTolerantSynchronizer (in a plain loop, or through Accelerate's ``prepare``
with ``--via accelerate``) on data of its own, until a step at least ``--steps``
that every one of ``--groups`` groups took part in. With ``--die-at S`` it kills itself (SIGKILL)
after the forward of the first step from committed step ``S`` on that every group takes part in,
after a step they all took part in and committed, before its exchange. Writes its final parameters, the
roles' state and a record of every step (its parameters after it included) to ``--out``.

Started by torchrun, it is a group of several ranks, rank ``r`` of group ``g`` reading shard
``g · ranks + r`` and writing ``OUT`` with ``.rank{r}.pt`` for ``.pt``; with ``--sharded`` the group
shards the model with FSDP2 over its ranks (each Linear a unit, then the whole;
FaultTolerantShardedSynchronizer) and every state is recorded as this rank's shards; with ``--die-at`` every rank
of the group kills itself at the same point (a lost node); with ``--lose-first-healing R`` its
rank ``R`` alone fails to fetch the first peer state it heals from (the transport raises, as where
the peer died while sending it).

With ``--inner-steps H`` it trains with FaultTolerantDiLoCo instead (a plain loop; a group of one
or of several ranks, sharded with ``--sharded``), until an outer
step at least ``--steps`` that every group took part in, recording every round; ``--die-when inner``
kills it in the inner step ``S`` (after its forward), ``outer`` in the first outer round from ``S``
on that every group takes part in, after the exchange of the matrices' Δ started. ``--fragments`` and
``--overlap``: Streaming DiLoCo, each fragment's exchange a round; a round's record says whether the
replicated state (outer values, outer optimizer, roles) was kept where it failed, and without overlap
the parameters and optimizer too (with it, the inner steps of the overlap change them)."""

import argparse
import copy
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gc_strategy import DiLoCo, FaultTolerance, build_components
from gc_strategy.sync.fault_tolerance import quorum
from gc_strategy.sync.fault_tolerance.diloco import FaultTolerantDiLoCo
from gc_strategy.sync.fault_tolerance.every_step import FaultTolerantSynchronizer
from gc_strategy.sync.fault_tolerance.sharded import FaultTolerantShardedSynchronizer
from gc_strategy.sync.fault_tolerance.shards import local


def batch(shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard ``shard``'s own batch for committed step ``step`` (a group's, or a rank's of a group)."""
    g = torch.Generator().manual_seed(1000 * shard + step)
    return torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)


def same(a: object, b: object) -> bool:
    """Whether two states are equal to the bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))


def group_arguments() -> argparse.ArgumentParser:
    """The options every replica-group worker of the tests takes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--barrier", help="a folder: wait there for every rank of every group before the first step")
    return parser


def main() -> None:
    parser = group_arguments()
    parser.add_argument("--compressor", default="none")
    parser.add_argument("--memory", default="none")
    parser.add_argument(
        "--die-when", choices=["exchange", "between", "inner", "outer", "usage", "check_group"], default="exchange"
    )
    parser.add_argument("--find-unused", action="store_true", help="find_unused_parameters=True: usage flags summed")
    parser.add_argument("--check-group-collective", action="store_true", help="the compressor's check_group sums")
    parser.add_argument("--inner-steps", type=int, default=0)
    parser.add_argument("--fragments", type=int, default=1, help="DiLoCo's fragments (Streaming DiLoCo)")
    parser.add_argument("--overlap", type=int, default=0, help="DiLoCo's overlap_steps (Streaming DiLoCo)")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--quorum-timeout", type=float, default=60)
    parser.add_argument("--via", choices=["loop", "accelerate"], default="loop")
    parser.add_argument("--lose-first-healing", type=int, default=-1, help="a rank of the group")
    parser.add_argument("--pause-at", type=int, default=-1, help="DiLoCo: an inner step to stall in, once")
    parser.add_argument("--pause-s", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=10.0, help="timeout_s")
    parser.add_argument("--silence", type=float, default=5.0, help="silence_s")
    parser.add_argument(
        "--fail-at", type=int, default=-1, help="a step (every group in it) this group fails before its exchange, alive"
    )
    parser.add_argument("--step-pause", type=float, default=0.02, help="seconds between two steps")
    parser.add_argument(
        "--freeze-at", type=int, default=-1, help="DiLoCo: freeze (SIGSTOP) once in the first outer exchange from it"
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address the peers reach this group at")
    parser.add_argument("--steps-file", help="a file that, once written, holds the step to end at instead of --steps")
    parser.add_argument("--sharded", action="store_true", help="FSDP2 over the group's ranks")
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ and args.via == "loop":  # a group of several ranks, started by torchrun
        dist.init_process_group("gloo")
        if dist.get_rank() == args.lose_first_healing:
            lose_first_healing()
    net = model()
    mesh = shard(net, (1, dist.get_world_size())) if args.sharded and args.via == "loop" else None
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    options = FaultTolerance(
        args.lighthouse,
        args.group,
        groups=args.groups,
        min_replicas=args.min_replicas,
        timeout_s=args.timeout,
        quorum_timeout_s=args.quorum_timeout,
        silence_s=args.silence,
        host=args.host,
    )
    if args.inner_steps:
        return diloco(args, net, optimizer, options, mesh)
    if args.via == "accelerate":
        from accelerate import Accelerator

        from gc_strategy.accelerate import prepare

        placed = {"sharding": "fsdp"} if args.sharded else {"fusion": "groups:2"}
        roles = {"compressor": args.compressor, "memory": args.memory, **placed}
        net, optimizer = prepare(Accelerator(cpu=True), net, optimizer, **roles, fault_tolerance=options)
        sync = net.gc_synchronizer
    elif args.sharded:
        sync = FaultTolerantShardedSynchronizer(net, build_components(args.compressor, args.memory), options, mesh)
        sync.use_optimizers([optimizer])
    else:
        roles = build_components(args.compressor, args.memory, fusion="groups:2")
        if args.check_group_collective:
            collective_check_group(roles, args)
        sync = FaultTolerantSynchronizer(net, roles, options, find_unused_parameters=args.find_unused)
        sync.use_optimizers([optimizer])
    wait_for_groups(args)
    record = []
    if args.die_when == "usage":
        die_in_the_usage_sum(args, lambda: args.die_at <= sync.committed_steps and all_took_part(record, args.groups))
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    while True:
        began = time.monotonic()
        with sync.forward_pass():
            step = sync.committed_steps
            x, y = batch(args.group * ranks + rank, step)
            loss = (net(x) - y).square().mean()
        dies = 0 <= args.die_at <= step and sync.participants == args.groups and all_took_part(record, args.groups)
        if dies and args.die_when == "exchange":
            os.kill(os.getpid(), signal.SIGKILL)
        kept = snapshot(net, optimizer, sync)
        if 0 <= args.fail_at <= step and sync.participants == args.groups and all_took_part(record, args.groups):
            # as a participant that saw a peer fail: it issues none of the round's collectives
            sync.round.quorum.failure.report(RuntimeError(f"group {args.group} fails step {step}"))
            args.fail_at = -1
        loss.backward()
        if args.via == "accelerate":  # its optimizer steps where the step commits
            optimizer.step()
            committed = sync.last_round.committed
        else:
            committed = sync.should_commit()
            if committed:
                optimizer.step()
        optimizer.zero_grad()
        record.append(
            {
                "step": step,
                "participants": sync.participants,
                "committed": committed,
                "state_kept": same(kept, snapshot(net, optimizer, sync)),
                "seconds": time.monotonic() - began,
                "ended": time.time(),
                "params": local({n: p.detach().clone() for n, p in net.named_parameters()}),
            }
        )
        if committed:
            print(f"group {args.group} rank {rank}: committed step {step} with {sync.participants} groups", flush=True)
        if dies:  # between steps: after this step's optimizer step, before the next quorum
            os.kill(os.getpid(), signal.SIGKILL)
        if args.steps_file and os.path.exists(args.steps_file) and os.path.getsize(args.steps_file):
            args.steps = int(Path(args.steps_file).read_text())
        if committed and step + 1 >= args.steps and sync.participants == args.groups:
            break
        time.sleep(args.step_pause)
    final = snapshot(net, optimizer, sync)
    out = args.out if ranks == 1 else args.out.replace(".pt", f".rank{rank}.pt")
    torch.save({**final, "record": record, "committed_steps": sync.committed_steps}, out)
    sync.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def die_in_the_usage_sum(args: argparse.Namespace, due: Callable[[], bool]) -> None:
    """SIGKILL this process as it is about to sum the step's usage flags across the groups, where
    ``due()`` says so (its buckets' exchanges are launched; the peers' sums wait for it)."""
    sum_counts = quorum.QuorumRoute.sum_counts

    def dying(route: quorum.QuorumRoute, counts: torch.Tensor) -> object:
        if due() and route.quorum.participants == args.groups:
            os.kill(os.getpid(), signal.SIGKILL)
        return sum_counts(route, counts)

    quorum.QuorumRoute.sum_counts = dying


def collective_check_group(roles: object, args: argparse.Namespace) -> None:
    """The compressor's ``check_group`` sums a number over the group, as ``randk``'s gathers on an
    accelerator; with ``--die-when check_group`` this group kills itself in it at the first rebind
    after a quorum of every group (its peers' sums then wait for it)."""
    seen_everyone = []

    def check_group(group: object, buckets: list) -> None:
        size = group.size() if group is not None else 1
        if args.die_when == "check_group" and seen_everyone and size < args.groups:
            os.kill(os.getpid(), signal.SIGKILL)
        if size == args.groups:
            seen_everyone.append(True)
        if size > 1:
            dist.all_reduce(torch.ones(1), group=group)

    roles.compressor.check_group = check_group


def lose_first_healing() -> None:
    """Make this process's first fetch of a peer's state fail, as where the peer died sending it."""
    make = quorum.checkpoint_transport

    def losing_transport(*args: object) -> object:
        transport = make(*args)
        receive, lost = transport.recv_checkpoint, []

        def recv_checkpoint(**kwargs: object) -> object:
            if not lost:
                lost.append(True)
                raise EOFError("the peer was lost while sending its state (the test's failure)")
            return receive(**kwargs)

        transport.recv_checkpoint = recv_checkpoint
        return transport

    quorum.checkpoint_transport = losing_transport


def all_took_part(record: list[dict], groups: int) -> bool:
    """Whether every group took part in the last step and it committed (a group that has just
    joined took part in it: it is not healing from this one any more)."""
    return bool(record) and record[-1]["committed"] and record[-1]["participants"] == groups


def diloco(
    args: argparse.Namespace, net: nn.Module, optimizer: torch.optim.Optimizer, options: FaultTolerance, mesh: object
) -> None:
    roles = build_components(args.compressor, args.memory, **({} if args.sharded else {"fusion": "groups:2"}))
    config = DiLoCo(inner_steps=args.inner_steps, outer_lr=0.5, fragments=args.fragments, overlap_steps=args.overlap)
    sync = FaultTolerantDiLoCo(net, roles, config, options, mesh=mesh)
    sync.use_optimizers([optimizer])
    record, kept = [], {}
    begin_round, end_round = sync.begin_round, sync.end_round
    replicated = ("outer", "outer_optimizer", "states") if args.overlap else ()

    def recorded_begin(plan: object) -> None:
        kept.update(diloco_snapshot(net, optimizer, sync, args.sharded), began=time.monotonic())
        begin_round(plan)

    def recorded_end() -> bool:
        fragment = sync.plan.fragment
        committed = end_round()
        now = diloco_snapshot(net, optimizer, sync, args.sharded)
        keys = replicated or list(now)
        record.append(
            {
                "step": sync.committed_steps,
                "fragment": fragment,
                "participants": sync.participants,
                "contributors": sync.last_round.contributors if committed else None,
                "committed": committed,
                "state_kept": committed or same({k: kept[k] for k in keys}, {k: now[k] for k in keys}),
                "seconds": time.monotonic() - kept["began"],
            }
        )
        return committed

    sync.begin_round, sync.end_round = recorded_begin, recorded_end
    if not args.sharded:
        vectors = [f.synchronizers[-1] for f in sync.inner.fragments]

        def dying(start_vectors: Callable[[], None]) -> Callable[[], None]:
            def dying_vectors() -> None:  # the matrices' exchange is in flight
                due = sync.participants == args.groups
                if args.die_when == "outer" and 0 <= args.die_at <= sync.committed_steps and due:
                    os.kill(os.getpid(), signal.SIGKILL)
                if 0 <= args.freeze_at <= sync.committed_steps and due:
                    args.freeze_at = -1
                    os.kill(os.getpid(), signal.SIGSTOP)  # until the test wakes it
                start_vectors()

            return dying_vectors

        for synchronizer in vectors:
            synchronizer.start_synchronize = dying(synchronizer.start_synchronize)
    wait_for_groups(args)

    def done() -> bool:
        return sync.committed_at >= args.steps and sync.participants == args.groups and sync.together

    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    while True:
        with sync.forward_pass():
            step = sync.committed_steps
            x, y = batch(args.group * ranks + rank, step)
            loss = (net(x) - y).square().mean()
        if done():  # joined in the run's last outer step
            break
        if args.die_when == "inner" and 0 <= args.die_at <= step and sync.participants == args.groups:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.pause_at:  # alive, but late for the next outer step
            time.sleep(args.pause_s)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sync.after_optimizer_step()
        if done():
            break
        time.sleep(0.05)
    final = diloco_snapshot(net, optimizer, sync, args.sharded)
    out = args.out if ranks == 1 else args.out.replace(".pt", f".rank{rank}.pt")
    torch.save({**final, "record": record, "inner_step": sync.committed_steps}, out)
    sync.close()


def wait_for_groups(args: argparse.Namespace, timeout: float = 120) -> None:
    """With ``--barrier FOLDER``, wait until every rank of every group has reached this point (each
    leaves a file there): the groups start together, as a scheduler starts them."""
    if not args.barrier:
        return
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    folder = Path(args.barrier)
    (folder / f"ready-{args.group}-{rank}").touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("ready-*"))) < args.groups * ranks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank of {args.groups} groups started within {timeout} s")
        time.sleep(0.05)


def diloco_snapshot(net: nn.Module, optimizer: torch.optim.Optimizer, sync: FaultTolerantDiLoCo, sharded: bool) -> dict:
    """Copies of the parameters, the inner and outer optimizers' and outer values, and the roles'
    state (this rank's shards where FSDP2 shards them: ``sharded``)."""
    return {
        "params": local({n: p.detach().clone() for n, p in net.named_parameters()}),
        "optimizer": local(copy.deepcopy(optimizer.state_dict())),
        "outer": {n: t.clone() for n, t in sync.inner.outer.items()},
        "outer_optimizer": copy.deepcopy(sync.inner.outer_optimizer.state_dict()),
        "states": sync.inner.state_dict()["roles"] if sharded else [s.state_dict() for s in sync.synchronizers],
    }


def snapshot(net: nn.Module, optimizer: torch.optim.Optimizer, sync: FaultTolerantSynchronizer) -> dict:
    """Copies of the parameters, the optimizer's state and the synchroniser's state (this rank's
    shards where FSDP2 shards them)."""
    return {
        "params": local({n: p.detach().clone() for n, p in net.named_parameters()}),
        "optimizer": local(copy.deepcopy(optimizer.state_dict())),
        "state": sync.inner.state_dict(),
    }


def shard(net: nn.Module, shape: tuple[int, int], hsdp: bool = False) -> object:
    """``net`` sharded by FSDP2 (each Linear a unit, then the whole) over the ``shard`` dimension of a
    ``("replicate", "shard")`` mesh of ``shape`` over the default process group (a replica group's
    ``(1, ranks)``), or with ``hsdp`` over the whole mesh: native HSDP. The mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    placed = mesh if hsdp else mesh["shard"]
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=placed)
    fully_shard(net, mesh=placed)
    return mesh


if __name__ == "__main__":
    main()
