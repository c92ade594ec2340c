"""Dense casts and the residual memory against plain math (docs/algorithms.md §2, §6)."""

import pytest
import torch

from gc_strategy import COMPRESSORS, MEMORIES
from gc_strategy.bucket import Bucket

UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def _bucket(n: int, index: int = 0) -> Bucket:
    return Bucket(index, ["w"], [torch.Size([n])], torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_average_is_within_its_rounding_bound(name):
    world = 3
    compressor = COMPRESSORS.build(name)
    compressor.bind(world, 0)
    bucket = _bucket(1001)
    grads = [torch.randn(1001) * 10.0**r for r in range(world)]
    payloads = [compressor.encode(g, bucket) for g in grads]
    assert payloads[0][0].dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
    # the wire sum happens in the 16-bit type, as an allreduce would do it
    summed = [payloads[0][0].clone()]
    for p in payloads[1:]:
        summed[0] += p[0]
    average = compressor.average(summed, bucket, world)
    exact = sum(grads) / world
    u = UNIT_ROUNDOFF[name]
    # each cast of g_r/W rounds by <= u relative; each of the W-1 additions by <= u of the partial sum
    bound = u * (sum(g.abs() for g in grads) / world) * world + 1e-30
    assert torch.all((average - exact).abs() <= bound)
    # the local decode estimates the local gradient
    torch.testing.assert_close(compressor.decode(payloads[1], bucket), grads[1], rtol=2 * u, atol=0)


def test_fp16_divides_before_casting_so_the_sum_cannot_overflow():
    compressor = COMPRESSORS.build("fp16")
    compressor.bind(2, 0)
    bucket = _bucket(4)
    g = torch.full((4,), 60000.0)  # g + g overflows fp16 (max 65504); g/2 + g/2 does not
    summed = compressor.encode(g, bucket)[0] + compressor.encode(g, bucket)[0]
    assert torch.isfinite(summed).all()
    assert torch.allclose(compressor.average([summed], bucket, 2).float(), g, rtol=1e-3)  # average: wire dtype


def test_none_is_exact():
    compressor = COMPRESSORS.build("none")
    bucket = _bucket(5)
    g = torch.randn(5)
    assert torch.equal(compressor.decode(compressor.encode(g, bucket), bucket), g)


@pytest.mark.parametrize("flag", [None, True], ids=["new-tensor", "in-place"])
def test_residual_memory_math(flag):
    """``g' = βe + γg``, ``e ← g' − decode``: given the finite flag (as the synchroniser does), ``g'`` is
    formed in ``e`` itself on the CPU; without it, in a new tensor. Same values either way."""
    memory = MEMORIES.build("residual", beta=0.5, gamma=2.0)
    bucket = _bucket(3)
    finite = None if flag is None else torch.tensor(flag)
    g = torch.tensor([1.0, -2.0, 3.0])
    first = memory.compensate(g, bucket, finite)
    assert (first is memory.buffer("residual", bucket)) == (flag is not None)
    assert torch.equal(first, 2.0 * g)  # e = 0 at first
    transmitted = torch.tensor([2.0, 0.0, 6.0])
    e = 2.0 * g - transmitted
    memory.update(first, transmitted, bucket, torch.tensor(True))
    assert torch.equal(memory.buffer("residual", bucket), e)
    assert torch.equal(memory.compensate(g, bucket, finite), 0.5 * e + 2.0 * g)


def test_residual_memory_keeps_state_when_the_gradient_is_not_finite():
    memory = MEMORIES.build("residual")
    bucket = _bucket(3)
    memory.update(torch.ones(3), torch.zeros(3), bucket, torch.tensor(True))
    before = memory.buffer("residual", bucket).clone()
    poisoned = memory.compensate(torch.tensor([1.0, float("inf"), float("nan")]), bucket)
    memory.update(poisoned, poisoned * 0.5, bucket, torch.tensor(False))
    assert torch.equal(memory.buffer("residual", bucket), before)


def test_error_feedback_makes_the_time_average_of_the_error_vanish():
    """A constant gradient sent in bf16 is biased by its rounding every step; with residual memory
    the transmitted running sum differs from the true one only by the (bounded) residual."""
    compressor = COMPRESSORS.build("bf16")
    bucket = _bucket(257)
    g = torch.rand(257) + 0.01
    steps = 1000
    plain_sum = torch.zeros(257)
    fed_sum = torch.zeros(257)
    memory = MEMORIES.build("residual")
    for _ in range(steps):
        plain_sum += compressor.decode(compressor.encode(g, bucket), bucket)
        compensated = memory.compensate(g, bucket)
        sent = compressor.decode(compressor.encode(compensated, bucket), bucket)
        memory.update(compensated, sent, bucket, torch.tensor(True))
        fed_sum += sent
    plain_error = (plain_sum / steps - g).abs().max()
    fed_error = (fed_sum / steps - g).abs().max()
    assert plain_error > 1e-4  # bf16 rounding really is a bias here
    assert fed_error <= 2.0**-8 * g.abs().max() * 4 / steps + 1e-6  # |e_T| / T
    assert fed_error < plain_error / 100


@pytest.mark.parametrize("as_mask", [False, True], ids=["indices", "mask"])
@pytest.mark.parametrize("flag", [None, True], ids=["new-tensors", "in-place"])
def test_dgc_memory_momentum_correction_accumulation_and_masking(flag, as_mask):
    """``u = m u + g``, ``v = v + u``; ``u`` and ``v`` zeroed at the sent positions (``local_form``:
    indices, or a bool mask as on accelerators), also where the value sent there is 0 (position 2
    at the second step). Given the finite flag (as the synchroniser does) they are formed in place on
    the CPU."""
    memory = MEMORIES.build("dgc", momentum=0.5)
    assert memory.local_form == "positions"
    finite = None if flag is None else torch.tensor(flag)
    bucket = _bucket(4)
    u = torch.zeros(4)
    v = torch.zeros(4)
    grads = [
        torch.tensor([1.0, 2.0, -1.0, 0.5]),
        torch.tensor([0.5, -1.0, 1.5, 1.0]),
        torch.tensor([1.0, 1.0, 1.0, 1.0]),
    ]
    sent_masks = [
        torch.tensor([False, True, False, False]),
        torch.tensor([True, False, True, True]),
        torch.tensor([False] * 4),
    ]
    for g, sent in zip(grads, sent_masks):
        u = 0.5 * u + g
        v = v + u
        compensated = memory.compensate(g, bucket, finite)
        assert (compensated is memory.buffer("v", bucket)) == (flag is not None)
        assert torch.allclose(compensated, v)
        memory.update(compensated, sent if as_mask else sent.nonzero().flatten(), bucket, torch.tensor(True))
        u, v = u * ~sent, v * ~sent
        assert torch.allclose(memory.buffer("u", bucket), u) and torch.allclose(memory.buffer("v", bucket), v)


def test_dgc_memory_masks_the_positions_topk_selected_through_the_exchange():
    """The exchange hands DGC's memory the positions from top-k's payload (no dense decode); ``u``
    and ``v`` are zero there and follow the plain recursion elsewhere, over steps."""
    from compressor_helpers import finish

    from gc_strategy.communicators import COMMUNICATORS

    n, k = 1000, 10
    bucket = _bucket(n)
    compressor, memory = COMPRESSORS.build("topk", density=k / n), MEMORIES.build("dgc", momentum=0.5)
    communicator = COMMUNICATORS.build("allgather")
    communicator.bind(None)
    handed = []
    update = memory.update
    memory.update = lambda compensated, local, b, finite: (handed.append(local), update(compensated, local, b, finite))
    u, v = torch.zeros(n), torch.zeros(n)
    for step in range(3):
        g = torch.randn(n, generator=torch.Generator().manual_seed(step))
        u = 0.5 * u + g
        v = v + u
        selected = torch.topk(v.abs(), k).indices
        average, finite = finish(memory.exchange(g.clone(), bucket, compressor, communicator))
        assert bool(finite) and torch.equal(torch.sort(handed.pop()).values, torch.sort(selected).values)
        torch.testing.assert_close(average[selected], v[selected])
        u[selected] = 0
        v[selected] = 0
        torch.testing.assert_close(memory.buffer("u", bucket), u)
        torch.testing.assert_close(memory.buffer("v", bucket), v)


def test_dgc_memory_clipping_and_non_finite_guard():
    memory = MEMORIES.build("dgc", momentum=0.9, clip_norm=1.0)
    bucket = _bucket(2)
    compensated = memory.compensate(torch.tensor([3.0, 4.0]), bucket)  # norm 5 -> clipped to 1
    assert torch.allclose(compensated, torch.tensor([0.6, 0.8]))
    nothing_sent = torch.zeros(0, dtype=torch.int64)
    memory.update(compensated, nothing_sent, bucket, torch.tensor(True))
    state = memory.state_by_parameter([bucket])
    poisoned = memory.compensate(torch.tensor([float("inf"), 1.0]), bucket)
    memory.update(poisoned, torch.tensor([0]), bucket, torch.tensor(False))
    assert torch.equal(memory.buffer("u", bucket), state["u"]["w"]) and torch.equal(
        memory.buffer("v", bucket), state["v"]["w"]
    )
    restored = MEMORIES.build("dgc")
    restored.load_state_by_parameter(state, [bucket])
    assert torch.equal(restored.buffer("v", bucket), memory.buffer("v", bucket))


@pytest.mark.parametrize(
    "name, memory",
    [
        ("none", "none"),
        ("fp16", "none"),
        ("efsignsgd", "residual"),
        ("qsgd", "residual"),
        ("signsgd", "none"),
        ("powersgd", "none"),
        ("acpsgd", "none"),
    ],
)
def test_the_average_is_written_into_the_gradient_buffer_and_equals_a_new_tensor(name, memory):
    """The memory's exchange is handed the bucket's gradient buffer: the average comes back in it,
    equal to what the same exchange returns into a tensor of its own (a twin, one process; under
    TRITON_INTERPRET=1 efsignsgd takes its fused path and the twin the plain one)."""
    from compressor_helpers import finish

    from gc_strategy.algos import COMPRESSORS, MEMORIES
    from gc_strategy.bucket import Bucket
    from gc_strategy.communicators import COMMUNICATORS

    shapes = [torch.Size([12, 10]), torch.Size([7]), torch.Size([5, 4])]
    b = Bucket(0, ["a", "b", "c"], shapes, torch.float32, torch.device("cpu"))
    options = {"powersgd": dict(rank=2, start_iter=0), "acpsgd": dict(rank=2, start_iter=0)}.get(name, {})
    compressor, twin = COMPRESSORS.build(name, **options), COMPRESSORS.build(name, **options)
    communicator = COMMUNICATORS.build("allreduce" if compressor.summable else "allgather")
    communicator.bind(None)
    memories = MEMORIES.build(memory), MEMORIES.build(memory)
    for step in range(3):
        g = torch.randn(b.numel, generator=torch.Generator().manual_seed(step))
        compressor.begin_step(step)
        twin.begin_step(step)
        buffer = g.clone()
        average, _ = finish(memories[0].exchange(buffer, b, compressor, communicator))
        twin_compensated = memories[1].compensate(g.clone(), b)
        expected, twin_local = finish(twin.exchange(twin_compensated, b, communicator, memories[1].local_form))
        memories[1].update(twin_compensated, twin_local, b, torch.tensor(True))
        assert average is buffer
        # equal; to fp32 rounding where Triton's fused sign path (atomic sums) meets the twin's torch path
        torch.testing.assert_close(average, expected.float(), rtol=1e-6, atol=0)


def test_the_local_estimate_is_copied_only_where_it_shares_memory_with_the_payload():
    """The collective may sum the payload in place: a local estimate that is (a view of) the payload
    must be a copy; any other decode is kept as it is (no bucket-sized copy per step)."""
    from gc_strategy.algos.base import copy_if_shared

    payload = [torch.randn(6), torch.randn(2)]
    for aliased in (payload[0], payload[0][2:], payload[1].view(1, 2)):
        copy = copy_if_shared(aliased, payload)
        assert copy.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in payload}
        assert torch.equal(copy, aliased)
    separate = payload[0].float() * 2
    assert copy_if_shared(separate, payload) is separate
