"""One replica group of the fault-tolerance tests (tests/test_fault_tolerance.py): a small MLP
trained through FaultTolerantSynchronizer on data of its own, until a step at least ``--steps``
that every one of ``--groups`` groups took part in. With ``--die-at S`` it kills itself (SIGKILL)
after the forward of the first step from committed step ``S`` on that every group takes part in,
before its exchange. Writes its final parameters, the
roles' state and a record of every step to ``--out``."""

import argparse
import os
import signal
import time

import torch
from torch import nn

from gc_strategy import build_components
from gc_strategy.sync.fault_tolerant import FaultTolerance, FaultTolerantSynchronizer


def batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``group``'s own batch for committed step ``step``."""
    g = torch.Generator().manual_seed(1000 * group + step)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--compressor", default="none")
    parser.add_argument("--memory", default="none")
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    options = FaultTolerance(
        args.lighthouse, args.group, args.min_replicas, timeout_s=10, quorum_timeout_s=60, host="127.0.0.1"
    )
    roles = build_components(args.compressor, args.memory, fusion="groups:2")
    sync = FaultTolerantSynchronizer(net, roles, options)
    sync.use_optimizers([optimizer])
    record = []
    while True:
        with sync.forward_pass():
            step = sync.committed_steps
            x, y = batch(args.group, step)
            loss = (net(x) - y).square().mean()
        if 0 <= args.die_at <= step and sync.participants == args.groups:
            os.kill(os.getpid(), signal.SIGKILL)
        kept = sync.inner.state_dict()
        loss.backward()
        committed = sync.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad()
        after = sync.inner.state_dict()
        record.append(
            {"step": step, "participants": sync.participants, "committed": committed, "state_kept": same(kept, after)}
        )
        if committed and step + 1 >= args.steps and sync.participants == args.groups:
            break
        time.sleep(0.02)
    params = {n: p.detach() for n, p in net.named_parameters()}
    torch.save({"params": params, "record": record, "state": sync.inner.state_dict()}, args.out)
    sync.close()


if __name__ == "__main__":
    main()
