"""sync="diloco" on 2 gloo ranks: the outer step against the paper's formulas written out here, per-step
DDP as the limit H=1, identical replicas for every compressor, streaming fragments, exact resume and
refused options."""

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from compressor_helpers import SMALL_MODEL_OPTIONS
from lightning.pytorch.callbacks import ModelCheckpoint
from models import ParityModule, SmallCNN, fit, flat_params

from gc_strategy import COMPRESSORS, DiLoCo, GCFusedStrategy, NodeHierarchy, build_components
from gc_strategy.sync.diloco.synchronizer import DiLoCoSynchronizer
from gc_strategy.sync.modes import nesterov_sgd
from gc_strategy.tools.ranks import run_ranks

OPTIONS = {**SMALL_MODEL_OPTIONS, "powersgd": dict(start_iter=0)}
REFUSED = {"acpsgd": "alternates its payloads", "signum": "applies momentum"}


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


def _inner_step(model, optimizer, rank, step):
    optimizer.zero_grad(set_to_none=True)
    x, y = _batch(rank, step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _diloco(model, compressor="none", memory="none", hierarchy="flat", **options):
    c = build_components(compressor, memory, "auto", "groups:2", **OPTIONS.get(compressor, {}))
    return DiLoCoSynchronizer(model, c, DiLoCo(**options), hierarchy=hierarchy)


def _gathered(model):
    flat = flat_params(model).detach()
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _train(model, sync, optimizer, rank, steps, log=None):
    """Inner steps ``steps``, each followed by ``sync.after_optimizer_step()``; ``log`` receives
    (inner step, parameter names) of each exchange as it starts."""
    for step in steps:
        _inner_step(model, optimizer, rank, step)
        running = {f.index for f in sync.fragments if f.started is not None}
        sync.after_optimizer_step()
        for f in sync.fragments:
            if log is not None and f.started == sync.inner_step and f.index not in running:
                log.append((sync.inner_step, f.names))


def _resumes_exactly(build, model, rank, saved, steps):
    """A new SmallCNN with the ``saved`` (module, DiLoCo, optimizer) states, trained over ``steps``,
    ends bit for bit where ``model`` did."""
    resumed = SmallCNN()
    resumed.load_state_dict(saved[0])
    sync, optimizer = build(resumed)
    sync.load_state_dict(saved[1])
    optimizer.load_state_dict(saved[2])
    _train(resumed, sync, optimizer, rank, steps)
    return torch.equal(flat_params(model), flat_params(resumed))


def _outer_step_by_hand(rank, world_size):
    """H=3 inner steps of SGD, then θ ← θ − lr (Δ̄ + μ m), m ← μ m + Δ̄, with Δ̄ = θ − mean_r θ_r
    computed from every replica's parameters (all_gather), not through the library."""
    torch.manual_seed(0)
    model = SmallCNN()
    sync = _diloco(model, inner_steps=3, vectors="fp32", outer_optimizer=nesterov_sgd(0.7, 0.9))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    theta = flat_params(model).detach().clone()
    m = torch.zeros_like(theta)
    worst = 0.0
    for outer in range(2):
        for step in range(3 * outer, 3 * outer + 3):
            _inner_step(model, optimizer, rank, step)
            if step % 3 != 2:
                sync.after_optimizer_step()
        delta = theta - torch.stack(_gathered(model)).mean(0)
        sync.after_optimizer_step()  # the outer step
        m = 0.9 * m + delta
        theta = theta - 0.7 * (delta + 0.9 * m)
        worst = max(worst, float((flat_params(model).detach() - theta).abs().max()))
    return worst


def test_the_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient():
    for worst in run_ranks(_outer_step_by_hand, 2):
        assert worst < 1e-6


def _against_ddp(rank, world_size):
    torch.manual_seed(0)
    model = SmallCNN()
    reference = copy.deepcopy(model)
    sync = _diloco(model, inner_steps=1, vectors="fp32", outer_optimizer=nesterov_sgd(1.0, 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        _inner_step(model, optimizer, rank, step)
        sync.after_optimizer_step()
        _inner_step(ddp, ddp_optimizer, rank, step)
    return float((flat_params(model) - flat_params(reference)).abs().max())


def test_one_inner_step_with_outer_sgd_at_lr_1_is_torch_ddp():
    """H=1, outer SGD lr 1, no momentum: θ − (θ − θ_r averaged) is the per-step average (SGD with
    momentum is linear in the gradients, so its momentum averages too); equal to torch's
    DistributedDataParallel within fp32 rounding of θ − θ_r (1e-6)."""
    for gap in run_ranks(_against_ddp, 2):
        assert gap < 1e-6


def _buffers_at_an_outer_step(rank, world_size, broadcast_buffers):
    """BatchNorm's buffers after H=2 inner steps on each replica's own data, rank 1 running one more
    forward (so its counter differs): before and after the outer step, and every replica's before."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    sync = DiLoCoSynchronizer(
        model, build_components("none"), DiLoCo(inner_steps=2), broadcast_buffers=broadcast_buffers
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 6, generator=g) * (rank + 1) + rank).square().mean().backward()
        optimizer.step()
        if rank == 1 and step == 1:
            model(torch.randn(8, 6, generator=g))
        before = {n: b.clone() for n, b in model.named_buffers()}
        sync.after_optimizer_step()
    every = {}
    for name, buffer in before.items():
        every[name] = [torch.empty_like(buffer) for _ in range(world_size)]
        dist.all_gather(every[name], buffer)
    return every, dict(model.named_buffers())


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_an_outer_step_averages_floating_buffers_and_takes_rank_0s_counters(broadcast_buffers):
    """With broadcast_buffers=True the running mean and variance become the replicas' mean and
    num_batches_tracked rank 0's, on every rank; with False every replica keeps its own."""
    results = run_ranks(_buffers_at_an_outer_step, 2, broadcast_buffers)
    every = results[0][0]
    assert not torch.equal(*every["1.running_mean"]) and not torch.equal(*every["1.num_batches_tracked"])
    for rank, (_, after) in enumerate(results):
        for name in ("1.running_mean", "1.running_var"):
            expected = (every[name][0] + every[name][1]) / 2 if broadcast_buffers else every[name][rank]
            assert torch.allclose(after[name], expected, rtol=0, atol=1e-6), name
        counter = every["1.num_batches_tracked"][0 if broadcast_buffers else rank]
        assert torch.equal(after["1.num_batches_tracked"], counter)


def _every_compressor(rank, world_size):
    results = {}
    for name in COMPRESSORS.names():
        keeps_own = COMPRESSORS.get(name).OPTIONS.get("use_error_feedback") is not None
        memory = "none" if keeps_own or name == "none" else "residual"
        torch.manual_seed(0)
        model = SmallCNN()
        try:
            sync = _diloco(model, name, memory, inner_steps=2)
        except ValueError as error:
            results[name] = str(error)
            continue
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        same, moved = [], []
        for step in range(6):
            before = flat_params(model).detach().clone()
            _inner_step(model, optimizer, rank, step)
            sync.after_optimizer_step()
            if step % 2 == 1:
                replicas = _gathered(model)
                same.append(all(torch.equal(r, replicas[0]) for r in replicas))
                moved.append(bool((replicas[0] != before).any()))
        results[name] = (all(same), all(moved), sync.step)
    return results


@pytest.mark.slow
def test_replicas_are_identical_after_each_outer_step_for_every_compressor():
    for results in run_ranks(_every_compressor, 2):
        for name, result in results.items():
            if name in REFUSED:
                assert REFUSED[name] in result, result
            else:
                assert result == (True, True, 3), name


def _streaming_schedule(rank, world_size):
    torch.manual_seed(0)
    model = SmallCNN()
    sync = _diloco(model, inner_steps=6, fragments=3, overlap_steps=1)
    exchanged = []  # (inner step, names) of each exchange when it starts
    _train(model, sync, torch.optim.SGD(model.parameters(), lr=0.05), rank, range(12), exchanged)
    names = [n for n, p in model.named_parameters()]
    return exchanged, names, sync.step


def test_streaming_fragments_cover_every_parameter_once_per_period():
    for exchanged, names, outer_steps in run_ranks(_streaming_schedule, 2):
        assert [step for step, _ in exchanged] == [2, 4, 6, 8, 10, 12]
        for period in (exchanged[:3], exchanged[3:]):
            covered = [n for _, fragment in period for n in fragment]
            assert sorted(covered) == sorted(names)  # each parameter exactly once
        assert outer_steps == 5  # the exchange started after step 12 is applied after step 13


def _resume(rank, world_size):
    """Streaming DiLoCo with top-k + residual: a copy restored from a state saved after inner step 4
    (fragment 1's exchange running, fragment 0 half-way through its inner phase) ends where the
    uninterrupted run does, bit for bit."""

    def build(model):
        sync = _diloco(model, "topk", "residual", inner_steps=4, fragments=2, overlap_steps=1)
        return sync, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    model = SmallCNN()
    sync, optimizer = build(model)
    _train(model, sync, optimizer, rank, range(4))
    running = [f.index for f in sync.fragments if f.started is not None]
    saved = copy.deepcopy((model.state_dict(), sync.state_dict(), optimizer.state_dict()))
    _train(model, sync, optimizer, rank, range(4, 11))
    return running, _resumes_exactly(build, model, rank, saved, range(4, 11))


def test_resume_mid_inner_phase_is_exact():
    for running, same in run_ranks(_resume, 2):
        assert running == [1]  # fragment 1 started after step 4 and is applied after step 5
        assert same


def test_lightning_diloco_keeps_replicas_identical_and_moves_the_weights():
    """Through Trainer: 4 optimizer steps, H=2, top-k + residual; ParityModule checks at the end
    that every rank holds rank 0's parameters."""
    torch.manual_seed(0)
    module = ParityModule()
    before = flat_params(module).detach().clone()
    strategy = GCFusedStrategy(
        compressor="topk", memory="residual", density=0.1, sync=DiLoCo(inner_steps=2), start_method="fork"
    )
    fit(module, strategy)
    assert not torch.equal(flat_params(module), before)


class StopsMidPhase(ParityModule):
    def on_train_end(self):
        pass  # mid-way through an inner phase the replicas differ by design


def test_lightning_resume_mid_inner_phase_is_exact(tmp_path):
    """H=3 over 3 epochs of 4 steps; the checkpoint after epoch 1 falls one step into an inner phase,
    where the replicas' parameters and inner momenta differ. Each rank's own come back from its
    file, so the resumed run ends bit for bit where the uninterrupted one does."""

    def strategy():
        return GCFusedStrategy(
            compressor="topk", memory="residual", density=0.1, sync=DiLoCo(inner_steps=3), start_method="fork"
        )

    pl.seed_everything(0, verbose=False)
    straight = ParityModule()
    fit(straight, strategy(), max_epochs=3)
    checkpoints = tmp_path / "ckpt"
    pl.seed_everything(0, verbose=False)
    fit(
        StopsMidPhase(),
        strategy(),
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True)],
    )
    ranks = [torch.load(tmp_path / "ckpt.gc_state" / "last.ckpt" / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["inner_step"] == 4
    assert not torch.equal(ranks[0]["local"]["net.head.weight"], ranks[1]["local"]["net.head.weight"])
    pl.seed_everything(0, verbose=False)
    resumed = ParityModule()
    fit(resumed, strategy(), max_epochs=3, ckpt_path=str(checkpoints / "last.ckpt"))
    assert torch.equal(flat_params(resumed), flat_params(straight))


def _offloaded(rank, world_size):
    """offload=True against offload=False: the same weights, bit for bit, with the outer state and
    the residuals in CPU memory (on a GPU the residuals wait there between exchanges; see
    tests/kernels/test_cuda.py)."""
    weights = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = SmallCNN()
        sync = _diloco(model, "topk", "residual", inner_steps=2, fragments=2, overlap_steps=1, offload=offload)
        _train(model, sync, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), rank, range(7))
        weights.append(flat_params(model))
    residuals = [t for s in sync.synchronizers for t in s.memory.buffers.get("residual", {}).values()]
    on_cpu = all(t.device.type == "cpu" for t in [*sync.outer.values(), *residuals]) and bool(residuals)
    return torch.equal(*weights), on_cpu


def test_offloading_the_outer_state_changes_no_result():
    for same, on_cpu in run_ranks(_offloaded, 2):
        assert same and on_cpu


def test_switching_roles_is_refused_under_diloco():
    strategy = GCFusedStrategy(sync=DiLoCo(inner_steps=4))
    with pytest.raises(
        ValueError,
        match=r"not supported with sync=DiLoCo\(inner_steps=4\): its state is made for",
    ):
        strategy.switch_components(build_components("fp16"))


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(inner_steps=5), r"inner_steps is an option of DiLoCo; pass sync=DiLoCo\(inner_steps=5, ...\)"),
        # the modes docs/extending.md registers may be there too
        (dict(sync="local"), r"unknown sync mode 'local'( \(did you mean .*\))?; valid names: diloco, (.*, )?every_"),
        (dict(sync=3), r"sync = 3 is invalid; allowed: a registered name \(diloco, (.*, )?every_step.*\) or a Sync"),
        (
            dict(sync="diloco"),
            r"sync = 'diloco' needs its options \(DiLoCo needs option 'inner_steps'.*allowed: sync=DiLoCo",
        ),
        (dict(sync=DiLoCo(inner_steps=4), compressor="acpsgd"), "compressor 'acpsgd': it alternates"),
        (dict(sync=DiLoCo(inner_steps=4), compressor="topk", memory="dgc"), "memory 'dgc': it applies momentum"),
        (dict(sync=DiLoCo(inner_steps=4), fusion="auto"), "sync=DiLoCo with fusion='auto'"),
    ],
)
def test_bad_sync_options_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        GCFusedStrategy(**options)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(), r"DiLoCo needs option 'inner_steps' \(the local optimizer steps between outer steps, e.g. 100\)"),
        (dict(inner_steps=0), r"DiLoCo: option 'inner_steps' = 0 is invalid; allowed: an integer in \[1, inf\)$"),
        (dict(inner_steps=4, overlap_steps=4), "option 'overlap_steps' = 4 is invalid with inner_steps = 4"),
        (dict(inner_steps=4, fragments=5), "option 'fragments' = 5 is invalid with inner_steps = 4"),
        (dict(inner_steps=4, fragments="many"), r"'many' is invalid; allowed: an integer in \[1, inf\) or 'auto'"),
        (dict(inner_steps=4, fragments="auto"), "option 'overlap_steps' = 0 is invalid with it"),
        (dict(inner_steps=4, mixing=1.5), r"option 'mixing' = 1.5 is invalid; allowed: a number in \[0, 1\]"),
        (dict(inner_steps=4, vectors="int8"), "option 'vectors' = 'int8' is invalid; allowed: one of 'bf16'"),
        (dict(inner_steps=4, outer_lr=0), r"option 'outer_lr' = 0 is invalid; allowed: a number in \(0, inf\)"),
        (dict(inner_steps=4, outer_momentum=1.0), r"'outer_momentum' = 1.0 is invalid; allowed: a number in \[0, 1\)"),
        (dict(inner_steps=4, outer_optimizer="adam"), "'outer_optimizer' = 'adam' is invalid; allowed: a callable"),
        (dict(inner_steps=4, offload=1), "option 'offload' = 1 is invalid; allowed: true or false"),
        (dict(inner_steps=4, inner_step=2), r"does not take option\(s\) inner_step \(did you mean 'inner_steps'\?\)"),
    ],
)
def test_bad_diloco_options_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        DiLoCo(**options)


def test_diloco_defaults_are_written_once():
    """DiLoCo's defaults live in its ``OPTIONS`` alone: a configuration built with none of them
    holds them, and the outer optimizer it builds is the paper's Nesterov SGD at those values."""
    config = DiLoCo(inner_steps=4)
    assert {key: getattr(config, key) for key in DiLoCo.OPTIONS} == {
        key: option.default for key, option in DiLoCo.OPTIONS.items() if key != "inner_steps"
    } | {"inner_steps": 4}
    outer = config.outer()([torch.zeros(1)])
    assert (outer.defaults["lr"], outer.defaults["momentum"], outer.defaults["nesterov"]) == (0.7, 0.9, True)
    assert DiLoCo(inner_steps=4) == config and DiLoCo(inner_steps=5) != config


def _hierarchical(rank, world_size):
    torch.manual_seed(0)
    model = SmallCNN()
    sync = _diloco(model, "topk", "residual", NodeHierarchy(ranks_per_node=2), inner_steps=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    same = []
    for step in range(4):
        _inner_step(model, optimizer, rank, step)
        sync.after_optimizer_step()
        if step % 2 == 1:
            replicas = _gathered(model)
            same.append(all(torch.equal(r, replicas[0]) for r in replicas))
    hierarchical = all(s.route.groups.ranks_per_node == 2 for s in sync.synchronizers)
    return same, sync.step, hierarchical


@pytest.mark.slow
def test_diloco_over_the_node_hierarchy_keeps_replicas_identical():
    """2 nodes x 2 ranks, top-k + residual on Δ across nodes, dense inside each node."""
    for same, outer_steps, hierarchical in run_ranks(_hierarchical, 4):
        assert same == [True, True] and outer_steps == 2
        assert hierarchical  # every synchroniser exchanges through the node groups


def test_fragments_to_overlap_hides_each_exchange_behind_the_overlapped_steps():
    from gc_strategy.fusion.fragments import fragments_to_overlap

    assert fragments_to_overlap(exchange_s=1.0, step_s=0.1, overlap_steps=2, inner_steps=20) == 5  # 1 / 0.2
    assert fragments_to_overlap(exchange_s=1.01, step_s=0.1, overlap_steps=2, inner_steps=20) == 6
    assert fragments_to_overlap(exchange_s=0.01, step_s=0.1, overlap_steps=1, inner_steps=20) == 1
    assert fragments_to_overlap(exchange_s=100.0, step_s=0.1, overlap_steps=1, inner_steps=20) == 20
    with pytest.raises(ValueError, match="overlap_steps = 0"):
        fragments_to_overlap(1.0, 0.1, 0, 20)


def _auto_fragments(rank, world_size, forced):
    """fragments="auto", H=6, τ=1: the first period has one fragment; its exchange is timed and the
    count chosen from the slowest rank's timings (``forced`` replaces the choice, to exercise a cut
    into several fragments whatever this machine measures)."""
    import gc_strategy.sync.diloco.synchronizer as diloco

    if forced is not None:
        diloco.fragments_to_overlap = lambda *args: forced

    def build(model):
        sync = _diloco(model, "topk", "residual", inner_steps=6, fragments="auto", overlap_steps=1)
        return sync, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    torch.manual_seed(0)
    model = SmallCNN()
    sync, optimizer = build(model)
    exchanges = []
    _train(model, sync, optimizer, rank, range(9), exchanges)
    saved = copy.deepcopy((model.state_dict(), sync.state_dict(), optimizer.state_dict()))
    _train(model, sync, optimizer, rank, range(9, 14), exchanges)
    same = _resumes_exactly(build, model, rank, saved, range(9, 14))
    names = sorted(n for n, _ in model.named_parameters())
    second_period = sorted(n for step, fragment in exchanges if 7 < step <= 13 for n in fragment)
    return (
        sync.chosen_fragments,
        len(sync.fragments),
        sync.fragment_timings,
        exchanges[0][0],
        second_period == names,
        same,
    )


def test_auto_fragments_are_chosen_alike_on_every_rank_from_the_measured_timings():
    from gc_strategy.fusion.fragments import fragments_to_overlap

    results = run_ranks(_auto_fragments, 2, None)
    assert results[0][0] == results[1][0] and results[0][2] == results[1][2]  # the slowest rank's timings
    chosen, count, timings, first, _, same = results[0]
    assert chosen == count == fragments_to_overlap(timings["exchange_s"], timings["inner_step_s"], 1, 6)
    assert first == 6 and same


def test_auto_fragments_cut_the_parameters_and_cover_each_once_per_period_after():
    """Forced to 3 fragments: after the first period (one exchange of everything after step 6,
    applied after step 7) every parameter is exchanged exactly once in steps 8..13, and a resume
    from a state saved after step 9 (3 fragments) is exact."""
    for chosen, count, _, first, covered, same in run_ranks(_auto_fragments, 2, 3):
        assert chosen == count == 3 and first == 6
        assert covered and same
