"""Fault-tolerant replica groups that shard their model with FSDP2 (gc_strategy/sync/fault_tolerance/sharded.py),
tested for real: a torchft lighthouse on loopback, each group two ranks started by a torchrun of its
own (tests/ft_worker.py ``--sharded``), checked against torch's own HSDP and killed for real."""

import pytest
import torch
from ft_groups import finish, same, start
from ft_worker import batch, model, shard

from gc_strategy.sync.fault_tolerance.shards import local
from gc_strategy.tools.ranks import run_ranks

coordination = pytest.importorskip("torchft.coordination")

GROUPS = RANKS = 2


def train_together(out, *options: str) -> None:
    """The worker's sharded groups with ``options``, to their end, every step with both groups (a
    lighthouse that forms no quorum of fewer: ``min_replicas``)."""
    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=GROUPS, join_timeout_ms=500)
    try:
        options = (*options, "--min-replicas", str(GROUPS), "--sharded")
        started = [start(server.address(), g, GROUPS, out, *options, ranks=RANKS) for g in range(GROUPS)]
        for g, process in enumerate(started):
            finish(process, out, g, load=False)
    finally:
        server.shutdown()


def kill_and_restart(lighthouse: str, out, options: list[str], dying: list[str]) -> dict:
    """The worker's sharded groups started together, group 1 killing itself as ``dying`` says and
    started again at once; every rank's results at the end, by (group, rank)."""
    options = [*options, "--sharded"]
    together = ["--barrier", str(out)]
    groups = [
        start(lighthouse, g, GROUPS, out, *options, *together, *(dying if g else []), ranks=RANKS)
        for g in range(GROUPS)
    ]
    assert groups[1].wait(timeout=180) != 0
    groups[1] = start(lighthouse, 1, GROUPS, out, *options, ranks=RANKS)
    for g, process in enumerate(groups):
        finish(process, out, g, load=False)
    return {(g, r): torch.load(out / f"{g}.rank{r}.pt") for g in range(GROUPS) for r in range(RANKS)}


def _native_hsdp_steps(rank: int, world_size: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """torch's HSDP on ``world_size`` ranks, a ``(GROUPS, RANKS)`` mesh sharded as the groups shard
    (each Linear a unit, then the whole), rank ``r`` reading the worker's shard ``r``: this rank's
    shards of the parameters after every step."""
    net = model()
    shard(net, (GROUPS, RANKS), hsdp=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    after = []
    for step in range(steps):
        x, y = batch(rank, step)
        (net(x) - y).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        after.append(local({n: p.detach().clone() for n, p in net.named_parameters()}))
    return after


@pytest.mark.slow
def test_sharded_groups_without_failures_equal_native_hsdp_on_the_same_ranks_every_step(tmp_path):
    """Two groups of two ranks, each sharding the model with FSDP2, ``compressor=none``, each step
    committed only with both (``min_replicas``): after every step, each rank's shards equal those of
    the rank in the same place of torch's HSDP on the four ranks (a ``(2, 2)`` mesh, the same data)
    within fp32 rounding."""
    steps = 6
    native = run_ranks(_native_hsdp_steps, GROUPS * RANKS, steps)  # before the lighthouse: forked from here
    train_together(tmp_path, "--steps", str(steps))
    for g in range(GROUPS):
        for r in range(RANKS):
            record = [s for s in torch.load(tmp_path / f"{g}.rank{r}.pt")["record"] if s["committed"]]
            assert [s["step"] for s in record] == list(range(steps))
            for step in range(steps):
                assert record[step]["participants"] == GROUPS
                for name, value in native[g * RANKS + r][step].items():
                    torch.testing.assert_close(record[step]["params"][name], value, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["exchange", "between", "accelerate"])
def test_a_sharded_group_killed_is_survived_and_heals_shard_by_shard_bit_identical(lighthouse, tmp_path, when):
    """Two groups of two ranks sharding with FSDP2, ``topk`` + residual; both ranks of group 1 kill
    themselves in a step both take part in, before its exchange (``exchange``; ``accelerate``: the
    same through Accelerate's ``prepare(..., sharding="fsdp", fault_tolerance=...)``) or after its
    optimizer step (``between``). Group 0 goes on alone; a failed step leaves its shards, optimizer state,
    error feedback and compressor state bit-identical to a snapshot before it. Group 1, started
    again, heals each rank from the rank holding the same shard in group 0; at the end every rank
    holds the same shards, optimizer state and step as its counterpart."""
    options = ["--steps", "16", "--compressor", "topk", "--memory", "residual"]
    options += ["--via", "accelerate"] if when == "accelerate" else []
    dying = ["--die-at", "4", "--die-when", "exchange" if when == "accelerate" else when]
    results = kill_and_restart(lighthouse, tmp_path, options, dying)
    for r in range(RANKS):
        record = results[0, r]["record"]
        failed = [s for s in record if not s["committed"]]
        assert all(s["state_kept"] for s in failed)
        assert len({s["step"] for s in failed}) <= 1  # only the step in flight is redone
        assert any(s["committed"] and s["participants"] == 1 for s in record)  # then on alone
        assert record[-1]["participants"] == GROUPS
        assert results[1, r]["record"][0]["step"] > 4  # healed: its peer's step
        survivor, healed = results[0, r], results[1, r]
        assert same(survivor["params"], healed["params"])
        assert same(survivor["optimizer"], healed["optimizer"])
        assert healed["committed_steps"] == survivor["committed_steps"]
    assert not same(results[0, 0]["params"], results[0, 1]["params"])  # each rank holds a shard of its own


def _sharded_diloco_steps(rank: int, world_size: int, steps: int, inner_steps: int) -> dict:
    """DiLoCo over FSDP2 shards without fault tolerance (``ShardedDiLoCo`` on a ``(GROUPS, RANKS)``
    mesh, ``topk`` + residual, the worker's optimizers), rank ``r`` on the worker's shard ``r``:
    this rank's shards of the parameters and its outer shards at the end."""
    from gc_strategy import DiLoCo, build_components
    from gc_strategy.sync.sharded.diloco import ShardedDiLoCo

    net = model()
    mesh = shard(net, (GROUPS, RANKS))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    sync = ShardedDiLoCo(net, build_components("topk", "residual"), DiLoCo(inner_steps=inner_steps, outer_lr=0.5), mesh)
    for step in range(steps):
        x, y = batch(rank, step)
        (net(x) - y).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        sync.after_optimizer_step()
    params = local({n: p.detach().clone() for n, p in net.named_parameters()})
    return {"params": params, "outer": {n: t.clone() for n, t in sync.outer.items()}}


@pytest.mark.slow
def test_diloco_across_sharded_groups_equals_diloco_over_shards_without_fault_tolerance(tmp_path):
    """DiLoCo (``inner_steps=4``, ``topk`` + residual) across two groups of two ranks, each sharding
    the model with FSDP2, no failure, every outer step with both groups: every rank ends with the
    shards and outer shards of ``ShardedDiLoCo`` on a ``(2, 2)`` mesh of four ranks with the same
    data, within fp32 rounding."""
    steps, inner = 12, 4
    reference = run_ranks(_sharded_diloco_steps, GROUPS * RANKS, steps, inner)  # before the lighthouse
    train_together(
        tmp_path, "--steps", str(steps), "--inner-steps", str(inner), "--compressor", "topk", "--memory", "residual"
    )
    for g in range(GROUPS):
        for r in range(RANKS):
            result, expected = torch.load(tmp_path / f"{g}.rank{r}.pt"), reference[g * RANKS + r]
            assert result["inner_step"] == steps
            assert all(s["participants"] == GROUPS for s in result["record"] if s["committed"])
            for name, value in expected["params"].items():
                torch.testing.assert_close(result["params"][name], value, rtol=0, atol=1e-6)
                torch.testing.assert_close(result["outer"][name], expected["outer"][name], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_diloco_across_sharded_groups_survives_a_group_killed_in_inner_steps(lighthouse, tmp_path):
    """DiLoCo (``inner_steps=5``, ``topk`` + residual) across two groups of two ranks sharding with
    FSDP2; both ranks of group 1 kill themselves in the first inner step from 7 on after an outer
    step both took part in. Group 0 goes on alone; group 1, started again, heals shard by shard in
    an outer step of group 0 and sends no Δ in it; then every rank holds the same shards, outer
    shards, outer optimizer and inner step as the rank in its place in the other group, to the bit
    (the inner optimizers are each replica's own, as in DiLoCo without failures)."""
    options = ["--steps", "25", "--inner-steps", "5", "--compressor", "topk", "--memory", "residual"]
    results = kill_and_restart(lighthouse, tmp_path, options, ["--die-at", "7", "--die-when", "inner"])
    for r in range(RANKS):
        committed = [s for s in results[0, r]["record"] if s["committed"]]
        assert any(s["participants"] == 1 and s["contributors"] == 1 for s in committed)  # alone meanwhile
        joined = results[1, r]["record"][0]
        assert joined["committed"] and joined["step"] >= 10 and joined["contributors"] == 1  # healed, sent no Δ
        assert committed[-1]["participants"] == GROUPS
        for key in ("params", "outer", "outer_optimizer"):  # the inner optimizers: each replica's own
            assert same(results[0, r][key], results[1, r][key]), key
        assert results[1, r]["inner_step"] == results[0, r]["inner_step"]
    assert not same(results[0, 0]["outer"], results[0, 1]["outer"])  # each rank holds a shard of its own
