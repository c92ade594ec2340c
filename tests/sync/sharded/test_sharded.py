"""Compressed HSDP on FSDP2, on 4 gloo ranks as 2 nodes x 2: ``compressor="none"`` against torch's
native HSDP (a 2-D mesh, torch's own all-reduce across nodes), the replicas of every shard
identical across nodes for the flat compressors, error feedback on 1/S of the model, an exact
resume with each rank's compression state, and what is refused."""

import copy

import pytest
import torch
from torch import nn

from gc_strategy import DiLoCo, build_components, sparseloco
from gc_strategy.integrations.checkpoint import load_rank_states, save_rank_states
from gc_strategy.sync.sharded.diloco import ShardedDiLoCo
from gc_strategy.sync.sharded.synchronizer import ShardedSynchronizer, has_fsdp2_hook
from gc_strategy.tools.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_fsdp2_hook(), reason="sharded training needs torch >= 2.7")]

NODES, PER_NODE = 2, 2
#: flat compressors, each with the memory it is used with
FLAT = [("topk", "residual", dict(density=0.1)), ("qsgd", "none", {}), ("efsignsgd", "residual", {})]
FLAT += [("randk", "residual", dict(density=0.1)), ("fp16", "none", {}), ("dgc", "dgc", dict(density=0.1))]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _sharded(mesh, **options):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))


def _step(model, optimizer, sync, rank, step, micro_batches=1, batch=8):
    optimizer.zero_grad(set_to_none=True)
    for micro in range(micro_batches):
        g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
        x, y = torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)
        last = micro == micro_batches - 1
        context = sync.no_sync() if sync is not None and not last else _no_sync(model, last)
        with context:
            nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    if sync is not None:
        sync.after_optimizer_step()


class _no_sync:
    """Native HSDP's own accumulation switch (FSDP2's set_requires_gradient_sync)."""

    def __init__(self, model, sync):
        self.model, self.sync = model, sync

    def __enter__(self):
        self.model.set_requires_gradient_sync(self.sync)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


def _full(model):
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def _against_native(rank, world_size, micro_batches):
    mesh = _mesh()
    native = _sharded(mesh)  # 2-D mesh: HSDP
    ours = _sharded(mesh["shard"])
    sync = ShardedSynchronizer(ours, build_components("none"), mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (native, ours)]
    for step in range(4):
        _step(native, optimizers[0], None, rank, step, micro_batches)
        _step(ours, optimizers[1], sync, rank, step, micro_batches)
    return _full(native), _full(ours), len(sync.buckets)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_none_equals_native_hsdp_on_every_rank(micro_batches):
    """With 2 micro-batches per step the first accumulates with no reduction on either side."""
    for native, ours, buckets in run_ranks(_against_native, NODES * PER_NODE, micro_batches, timeout=300):
        assert buckets == 3  # the three blocks (the root holds no parameter of its own)
        torch.testing.assert_close(ours, native, rtol=1e-6, atol=1e-6)  # fp32 rounding of the two reductions


def _mixed_precision(rank, world_size, reduce_dtype):
    """bf16 parameters in forward and backward (FSDP2's MixedPrecisionPolicy), gradients reduced in
    ``reduce_dtype``: the hook gets shards in that dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _mesh()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    native = _sharded(mesh, mp_policy=policy)
    ours = _sharded(mesh["shard"], mp_policy=policy)
    sync = ShardedSynchronizer(ours, build_components("none"), mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (native, ours)]
    for step in range(3):
        _step(native, optimizers[0], None, rank, step)
        _step(ours, optimizers[1], sync, rank, step)
    return _full(native), _full(ours), {bucket.dtype for bucket in sync.buckets.values()}


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_mixed_precision_equals_native_hsdp(reduce_dtype):
    """With FSDP2's mixed precision: native HSDP's result within the rounding of the reduce dtype
    (fp32: 1e-6; bf16, whose sums round differently in the two reductions: 1e-2)."""
    tolerance = 1e-6 if reduce_dtype == torch.float32 else 1e-2
    for native, ours, dtype in run_ranks(_mixed_precision, NODES * PER_NODE, reduce_dtype, timeout=300):
        assert dtype == {reduce_dtype}
        torch.testing.assert_close(ours, native, rtol=tolerance, atol=tolerance)


def _replicas(rank, world_size):
    mesh = _mesh()
    out = {}
    for name, memory, options in FLAT:
        model = _sharded(mesh["shard"])
        before = _full(model)
        sync = ShardedSynchronizer(model, build_components(name, memory, **options), mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            _step(model, optimizer, sync, rank, step)
        held = {
            "parameters": sum(p.to_local().numel() for p in model.parameters()),
            "gradients": sum(p.grad.to_local().numel() for p in model.parameters()),
            "optimizer": sum(s["momentum_buffer"].to_local().numel() for s in optimizer.state.values()),
            "error feedback": sum(t.numel() for per in sync.memory.buffers.values() for t in per.values()),
        }
        out[name] = (_full(model), not torch.equal(_full(model), before), held)
        sync.close()
    return out


def test_every_flat_compressor_keeps_the_replicas_of_each_shard_identical():
    """After 3 steps every rank holds the same parameters (bit for bit across nodes), which moved;
    each rank holds about 1/S of the model's parameters, gradients, momentum and error feedback,
    counted element by element (FSDP2 pads each parameter's rows to a multiple of S)."""
    ranks = run_ranks(_replicas, NODES * PER_NODE, timeout=600)
    total = sum(p.numel() for p in _model().parameters())
    for name, memory, _ in FLAT:
        reference = ranks[0][name][0]
        for r in range(1, NODES * PER_NODE):
            assert torch.equal(ranks[r][name][0], reference), (name, r)
        assert all(rank[name][1] for rank in ranks), name
        shard = total / PER_NODE + 3  # + one padded row of each of the 3 biases, at most
        for rank in ranks:
            held = rank[name][2]
            assert total / PER_NODE <= held["parameters"] == held["gradients"] == held["optimizer"] <= shard
            feedback = held["error feedback"]
            if memory == "dgc":
                assert feedback == 2 * held["parameters"], name  # residual and momentum
            elif memory != "none":
                assert feedback == held["parameters"], name


#: the compressors of matrices, each on every parameter's row-shard
MATRICES = [("powersgd", dict(rank=2, start_iter=0)), ("acpsgd", dict(rank=2, start_iter=0))]


def _matrices(rank, world_size):
    mesh = _mesh()
    out = {}
    for name, options in MATRICES:
        model = _sharded(mesh["shard"])
        before = _full(model)
        sync = ShardedSynchronizer(model, build_components(name, **options), mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            _step(model, optimizer, sync, rank, step)
        shapes = [[tuple(s) for s in bucket.shapes] for _, bucket in sorted(sync.buckets.items())]
        out[name] = (_full(model), not torch.equal(_full(model), before), shapes)
    # at full rank (r >= the smaller side of every row-shard; batches large enough for gradients of
    # full rank) PowerSGD's P Q^T is the mean itself
    native, ours = _sharded(mesh), _sharded(mesh["shard"])
    full_rank = build_components("powersgd", rank=32, start_iter=0, min_compression_rate=0.1)
    sync = ShardedSynchronizer(ours, full_rank, mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (native, ours)]
    for step in range(3):
        _step(native, optimizers[0], None, rank, step, batch=64)
        _step(ours, optimizers[1], sync, rank, step, batch=64)
    out["full_rank"] = (_full(native), _full(ours))
    return out


def test_powersgd_and_acpsgd_compress_each_row_shard_and_keep_replicas_identical():
    """FSDP2 reduce-scatters each block's gradients into one flat shard per rank; PowerSGD and ACP-SGD
    see it as the parameters' row-shards ([64, 16] weights give [32, 16] on each of 2 ranks), every
    rank ends bit-identical with the other node's rank holding the same shard, and PowerSGD at full
    rank equals native HSDP."""
    ranks = run_ranks(_matrices, NODES * PER_NODE, timeout=600)
    row_shards = [[(32, 16), (32,)], [(32, 64), (32,)], [(2, 64), (2,)]]  # rows / S of each parameter, in order
    for name, _ in MATRICES:
        for r in range(NODES * PER_NODE):
            assert torch.equal(ranks[r][name][0], ranks[0][name][0]), (name, r)
            assert ranks[r][name][1], name  # the parameters moved
            assert ranks[r][name][2] == row_shards, name
    for rank in ranks:
        native, ours = rank["full_rank"]
        torch.testing.assert_close(ours, native, rtol=1e-5, atol=1e-5)  # orthogonalisation's fp32 rounding


def _resume(rank, world_size, folder):
    mesh = _mesh()
    components = dict(compressor="topk", memory="residual", density=0.1)
    straight = _sharded(mesh["shard"])
    sync = ShardedSynchronizer(straight, build_components(**components), mesh)
    optimizer = torch.optim.SGD(straight.parameters(), lr=0.1)
    for step in range(2):
        _step(straight, optimizer, sync, rank, step)
    saved = copy.deepcopy(straight.state_dict())
    manifest = save_rank_states(sync, folder)  # each rank's file, as a checkpoint writes them
    for step in range(2, 4):
        _step(straight, optimizer, sync, rank, step)
    resumed = _sharded(mesh["shard"])
    resumed.load_state_dict(saved)
    again = ShardedSynchronizer(resumed, build_components(**components), mesh)
    load_rank_states(again, manifest, folder)
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    for step in range(2, 4):
        _step(resumed, optimizer, again, rank, step)
    return torch.equal(_full(resumed), _full(straight))


def test_resume_with_each_ranks_compression_state_is_exact(tmp_path):
    """Each rank writes its own file (its shards' residuals), and reads it back."""
    assert all(run_ranks(_resume, NODES * PER_NODE, str(tmp_path), timeout=300))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.pt" for r in range(NODES * PER_NODE)]


def _save_after_two_steps(rank, world_size, folder, sync_of):
    mesh = _mesh()
    model = _sharded(mesh["shard"])
    sync = sync_of(model, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        _step(model, optimizer, sync, rank, step)
    return save_rank_states(sync, folder)


def _per_step(model, mesh):
    return ShardedSynchronizer(model, build_components("topk", "residual", density=0.1), mesh)


def _outer_every_two(model, mesh):
    return ShardedDiLoCo(model, build_components("topk", "residual", density=0.1), DiLoCo(inner_steps=2), mesh)


def _resume_on_one_node(rank, world_size, folder, manifest, sync_of, nodes):
    """On ``nodes`` nodes of 2 ranks: the resharded state, or the error of loading it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (nodes, world_size // nodes), mesh_dim_names=("replicate", "shard"))
    model = _sharded(mesh["shard"])
    sync = sync_of(model, mesh)
    try:
        load_rank_states(sync, manifest, folder)
    except ValueError as error:
        return str(error)
    if isinstance(sync, ShardedDiLoCo):
        return sync.step, sync.inner_step, sync.outer, sync.state_dict()["roles"]["memory"]
    # the state waits for its FSDP2 module's first reduction: run one, and compare with the same
    # step from the plain mean of the old nodes' files set by hand
    expected = _sharded(mesh["shard"])
    plain = _per_step(expected, mesh)
    old = [torch.load(f"{folder}/rank{r}.pt") for r in range(NODES * PER_NODE)]
    mine = [state for state in old if state["shard"] == [PER_NODE, rank]]
    mean = {
        name: {key: sum(state["memory"][name][key] for state in mine) / len(mine) for key in mine[0]["memory"][name]}
        for name in mine[0]["memory"]
    }
    plain.load_state_dict({**mine[0], "memory": mean})
    untouched = _sharded(mesh["shard"])
    fresh = _per_step(untouched, mesh)
    for model_, sync_ in ((model, sync), (expected, plain), (untouched, fresh)):
        _step(model_, torch.optim.SGD(model_.parameters(), lr=0.1), sync_, rank, 2)
    return _full(model), _full(expected), _full(untouched), len(mine)


@pytest.mark.parametrize("sync_of", [_per_step, _outer_every_two], ids=["every_step", "diloco"])
def test_resume_on_another_number_of_nodes_takes_the_mean_of_the_old_nodes_shard_states(tmp_path, sync_of):
    """Saved on 2 nodes x 2 ranks, resumed on 1 node x 2: each rank starts from the mean of the error
    feedback of the 2 old ranks that held its shard (the replicated synchroniser's rule, per shard);
    DiLoCo's outer shards and schedule are the old ones. On 1 node x 4 (other shards) it is refused."""
    manifest = run_ranks(_save_after_two_steps, NODES * PER_NODE, str(tmp_path), sync_of, timeout=300)[0]
    resumed = run_ranks(_resume_on_one_node, PER_NODE, str(tmp_path), manifest, sync_of, 1, timeout=300)
    old = [torch.load(tmp_path / f"rank{r}.pt") for r in range(NODES * PER_NODE)]
    for rank, result in enumerate(resumed):
        if sync_of is _per_step:
            ours, expected, untouched, sources = result
            assert sources == NODES
            assert torch.equal(ours, expected) and not torch.equal(ours, untouched)
        else:
            step, inner_step, outer, memory = result
            assert (step, inner_step) == (1, 2)
            same = [state for state in old if state["shard"] == [PER_NODE, rank]]
            for name, value in outer.items():
                assert torch.equal(value, same[0]["outer"][name])
            for name, per in memory.items():
                for key, value in per.items():
                    plain = sum(s["roles"]["memory"][name][key] for s in same) / len(same)
                    torch.testing.assert_close(value, plain, rtol=0, atol=0)
    for error in run_ranks(_resume_on_one_node, 4, str(tmp_path), manifest, sync_of, 1, timeout=300):
        assert "cannot be loaded by shard" in error and "with the same ranks per node" in error


def _refused(rank, world_size):
    mesh = _mesh()
    errors = []
    for build in (
        lambda: ShardedSynchronizer(_model(), build_components("none"), mesh),
        lambda: ShardedSynchronizer(_sharded(mesh["shard"]), build_components("none"), mesh["shard"]),
        lambda: ShardedDiLoCo(
            _sharded(mesh["shard"]), build_components("none"), DiLoCo(inner_steps=4, fragments=2), mesh
        ),
        lambda: ShardedDiLoCo(_sharded(mesh["shard"]), build_components("acpsgd"), DiLoCo(inner_steps=4), mesh),
    ):
        try:
            build()
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_what_cannot_work_is_refused_before_any_work():
    for errors in run_ranks(_refused, NODES * PER_NODE, timeout=300):
        assert len(errors) == 4
        assert "the module has no FSDP2 module: call torch.distributed.fsdp.fully_shard" in errors[0]
        assert "mesh dimensions = ('shard',) are invalid; allowed: ('replicate', 'shard')" in errors[1]
        assert "fragments = 2 and overlap_steps = 0 are invalid; allowed: fragments=1, overlap_steps=0" in errors[2]
        assert "sync=DiLoCo with compressor 'acpsgd': it alternates its payloads" in errors[3]


def _diloco_equals_per_step(rank, world_size):
    """DiLoCo with one inner step and outer SGD at lr 1: θ ← mean over nodes of the local steps,
    which is native HSDP's step with plain SGD."""
    mesh = _mesh()
    native = _sharded(mesh)
    ours = _sharded(mesh["shard"])
    config = DiLoCo(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, vectors="fp32")
    sync = ShardedDiLoCo(ours, build_components("none"), config, mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (native, ours)]
    for step in range(3):
        _step(native, optimizers[0], None, rank, step)
        _step(ours, optimizers[1], sync, rank, step)
    return _full(native), _full(ours)


def test_diloco_over_shards_with_one_inner_step_equals_per_step_hsdp():
    for native, ours in run_ranks(_diloco_equals_per_step, NODES * PER_NODE, timeout=300):
        torch.testing.assert_close(ours, native, rtol=1e-6, atol=1e-6)


def _diloco_replicas(rank, world_size, configuration):
    mesh = _mesh()
    model = _sharded(mesh["shard"])
    roles = {key: value for key, value in configuration.items() if key != "sync"}
    sync = ShardedDiLoCo(model, build_components(**roles), configuration["sync"], mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    after_outer, before = [], _full(model)
    for step in range(4):
        _step(model, optimizer, sync, rank, step)
        if step % 2 == 1:
            after_outer.append(_full(model))
    outer = sum(t.numel() for t in sync.outer.values())
    memories = [group.roles.memory.buffers for group in sync.groups]
    feedback = sum(t.count_nonzero().item() for m in memories for v in m.values() for t in v.values())
    return after_outer, not torch.equal(after_outer[-1], before), sync.step, outer, feedback


@pytest.mark.parametrize(
    "configuration",
    [
        dict(sync=DiLoCo(inner_steps=2), compressor="topk", memory="residual", density=0.1),
        dict(sync=DiLoCo(inner_steps=2), compressor="powersgd", memory="none", rank=2, start_iter=0),
        sparseloco(inner_steps=2, chunk=256),
    ],
    ids=["topk", "powersgd", "sparseloco"],
)
def test_diloco_over_shards_keeps_replicas_identical_after_each_outer_step(configuration):
    """Top-k, PowerSGD (on each row-shard as a matrix) and the SparseLoCo preset (chunked top-k with
    2-bit values, decaying error feedback, no outer momentum), H=2: every rank holds the same
    parameters after each of the 2 outer steps; the outer state is this rank's shard, and the
    sparsifiers' error feedback holds what they did not send."""
    ranks = run_ranks(_diloco_replicas, NODES * PER_NODE, configuration, timeout=300)
    total = sum(p.numel() for p in _model().parameters())
    for after_outer, moved, steps, outer, feedback in ranks:
        assert steps == 2 and moved
        assert outer <= total / PER_NODE + 64
        assert (feedback > 0) == (configuration["memory"] == "residual")
        for mine, reference in zip(after_outer, ranks[0][0]):
            assert torch.equal(mine, reference)
