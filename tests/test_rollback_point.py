"""Rollback points on the roles' per-element state (gc_strategy/bucket.py, ``BucketState.hold``):
what fault tolerance puts back when a round does not commit, written copy-on-write."""

from collections import Counter

import pytest
import torch
from compressor_helpers import finish
from torch.utils._python_dispatch import TorchDispatchMode

from gc_strategy.algos import COMPRESSORS, MEMORIES
from gc_strategy.bucket import Bucket, BucketState
from gc_strategy.communicators import COMMUNICATORS


def _bucket(n: int, index: int) -> Bucket:
    return Bucket(index, ["w"], [torch.Size([n])], torch.float32, torch.device("cpu"))


class _Ops(TorchDispatchMode):
    """The aten operators run inside it, counted."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_a_rollback_point_puts_back_what_was_written_since_and_drops_what_was_created():
    state, first, second = BucketState(), _bucket(4, 0), _bucket(3, 1)
    state.buffer("e", first).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    before = state.buffer("e", first)
    state.hold()
    state.buffer("e", first).mul_(10)  # updated in place: on a copy, the old vector kept
    values, target = state.rewritten("e", second)  # none before: zeros to read, a vector to fill
    assert torch.equal(values, torch.zeros(3)) and target is not values
    target.fill_(7.0)
    assert torch.equal(before, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    state.release(keep_changes=False)
    assert state.buffer("e", first) is before and 1 not in state.buffers["e"]

    state.hold()
    written = state.buffer("e", first).add_(1)
    state.release(keep_changes=True)
    assert torch.equal(state.buffer("e", first), torch.tensor([2.0, 3.0, 4.0, 5.0]))
    state.hold()
    values, target = state.rewritten("e", first)
    assert values is written and target is before  # the last point's kept vector: no new memory
    assert state.rewritten("e", first) == (target, target)  # written once per point, then in place


@pytest.mark.parametrize(
    ("compressor", "memory", "options"),
    [
        ("topk", "residual", {"density": 0.1}),  # the fused update: into the second vector
        ("qsgd", "residual", {}),  # compensate, exchange, update in place: on a copy
        ("topk", "dgc", {"density": 0.1}),  # u and v
        ("powersgd", "none", {"rank": 1, "start_iter": 0}),  # its own error feedback, and the factors
        ("efsignsgd", "residual", {}),  # its fused kernel on Triton only: here, the separate passes
    ],
)
def test_under_a_rollback_point_the_exchange_is_unchanged_and_release_restores_to_the_bit(compressor, memory, options):
    """Two twins (one process); the second holds a rollback point at every step: its averages and
    per-element state equal the first's to the bit, also at a step whose gradient is not finite
    (step 2: the state is kept as it was); releasing without keeping (every other step) leaves its
    state as before that step, and the first is set back to it too."""
    shapes = [torch.Size([12, 10]), torch.Size([7])]
    b = Bucket(0, ["a", "b"], shapes, torch.float32, torch.device("cpu"))
    twins = [(COMPRESSORS.build(compressor, **options), MEMORIES.build(memory)) for _ in range(2)]
    communicator = COMMUNICATORS.build("allreduce" if twins[0][0].summable else "allgather")
    communicator.bind(None)

    def state(roles: tuple) -> list[dict]:
        return [
            {n: {p: t.clone() for p, t in ts.items()} for n, ts in r.state_by_parameter([b]).items()} for r in roles
        ]

    for step in range(5):
        g = torch.randn(b.numel, generator=torch.Generator().manual_seed(step))
        if step == 2:
            g[5] = float("nan")
        before = state(twins[1])
        for role in twins[1]:
            role.hold()
        averages = []
        for c, m in twins:
            c.begin_step(step)
            averages.append(finish(m.exchange(g.clone(), b, c, communicator))[0])
        torch.testing.assert_close(averages[0], averages[1], rtol=0, atol=0, equal_nan=True)
        assert same(state(twins[0]), state(twins[1]))
        if step == 2:  # a gradient that is not finite leaves the per-element state as it was
            assert same(state(twins[1]), before)
        committed = step % 2 == 1
        for role in twins[1]:
            role.release(keep_changes=committed)
        if not committed:
            assert same(state(twins[1]), before)
            for plain, held in zip(*twins):
                plain.load_state_by_parameter(held.state_by_parameter([b]), [b])


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("compressor", "memory", "options"),
    [
        ("topk", "residual", {"density": 0.05}),  # the fused update of e: into the second vector
        ("qsgd", "residual", {}),  # e + g formed into the second vector, e - decode there in place
        ("topk", "dgc", {"density": 0.05}),  # g + m·u and v + u formed into the second vectors
        ("powersgd", "none", {"rank": 1, "start_iter": 0}),  # its error: as the residual's
    ],
)
def test_the_error_feedback_under_a_rollback_point_is_written_with_no_copy(compressor, memory, options):
    """Held, the exchange runs as many copies as without a rollback point: the memories' and
    PowerSGD's error feedback is formed from the kept vector straight into the second one (for the
    fused residual update out of place instead of in place: one ``add`` for one ``add_``)."""
    b = Bucket(0, ["a", "b"], [torch.Size([40, 25]), torch.Size([7])], torch.float32, torch.device("cpu"))
    counts = []
    for held in (False, True):
        roles = COMPRESSORS.build(compressor, **options), MEMORIES.build(memory)
        communicator = COMMUNICATORS.build("allreduce" if roles[0].summable else "allgather")
        communicator.bind(None)
        for step in range(2):  # the state exists and the second step is held
            if held and step == 1:
                for role in roles:
                    role.hold()
            roles[0].begin_step(step)
            with _Ops() as ops:
                finish(roles[1].exchange(torch.randn(b.numel), b, roles[0], communicator))
        counts.append(ops.counts)
    assert counts[1]["aten.copy_"] == counts[0]["aten.copy_"]
    moved = counts[1]["aten.add"] - counts[0]["aten.add"]
    assert (
        moved
        == counts[0]["aten.add_"] - counts[1]["aten.add_"]
        == (1 if (compressor, memory) == ("topk", "residual") else 0)
    )


class _Extra:
    """A compressor's state beyond the per-element one (PowerSGD's factors, say), as a number."""

    def __init__(self) -> None:
        self.value = 1

    def extra_state(self) -> dict:
        return {"value": self.value}

    def load_extra_state(self, state: dict) -> None:
        self.value = state["value"]


def test_while_a_rollback_point_is_held_the_state_reads_as_it_was_for_a_checkpoint_and_is_kept():
    """``RollbackPoint.as_held``: inside it the roles' per-element state, the step and the
    compressor's other state read as at the point (a vector written since: its old values; a bucket
    or a state created since: absent); after it, as written since, and a release still puts the
    point's state back."""
    from types import SimpleNamespace

    from gc_strategy import build_components
    from gc_strategy.sync.every_step.rollback import RollbackPoint

    roles = build_components("topk", "residual")
    memory = roles.memory
    first = Bucket(0, ["a"], [torch.Size([4])], torch.float32, torch.device("cpu"))
    second = Bucket(1, ["b"], [torch.Size([3])], torch.float32, torch.device("cpu"))
    memory.buffer("e", first).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    synchronizer = SimpleNamespace(roles=roles, step=3, compressor=_Extra())
    point = RollbackPoint(synchronizer)
    memory.buffer("e", first).mul_(10)
    memory.buffer("e", second).fill_(5.0)
    memory.buffer("f", first).fill_(7.0)
    synchronizer.step, synchronizer.compressor.value = 4, 2
    with point.as_held():
        held = roles.state_by_parameter([first, second])["memory"]
        assert set(held) == {"e"} and set(held["e"]) == {"a"}
        assert torch.equal(held["e"]["a"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
        assert synchronizer.step == 3 and synchronizer.compressor.value == 1
    now = roles.state_by_parameter([first, second])["memory"]
    assert torch.equal(now["e"]["a"], torch.tensor([10.0, 20.0, 30.0, 40.0]))
    assert torch.equal(now["e"]["b"], torch.full((3,), 5.0)) and torch.equal(now["f"]["a"], torch.full((4,), 7.0))
    assert synchronizer.step == 4 and synchronizer.compressor.value == 2
    point.release(keep_changes=False)
    assert torch.equal(memory.buffer("e", first), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert "f" not in memory.buffers and synchronizer.step == 3 and synchronizer.compressor.value == 1
