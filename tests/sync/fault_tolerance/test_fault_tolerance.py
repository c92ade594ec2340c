"""Fault tolerance across replica groups (gc_strategy/sync/fault_tolerance/every_step.py), tested for real: a
torchft lighthouse on loopback, each replica group a process started here (tests/ft_worker.py), one
killed with SIGKILL in the middle of a step and started again under its old id."""

import csv
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from locations import ROOT, TESTS

coordination = pytest.importorskip("torchft.coordination")

from doc_blocks import command_overrides  # noqa: E402
from ft_groups import STARTED, TORCHRUN, finish, group_env, launch, same, start, third_killed_and_restarted  # noqa: E402
from ft_lightning_worker import Regression  # noqa: E402
from ft_worker import batch, model  # noqa: E402

from gc_strategy import FaultTolerance, FaultTolerantSynchronizer, build_components  # noqa: E402
from gc_strategy.sync.fault_tolerance.lighthouse import reach_lighthouse  # noqa: E402
from gc_strategy.tools.ranks import run_ranks  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize(
    ("compressor", "memory", "when"),
    [
        ("none", "none", "exchange"),
        ("topk", "residual", "exchange"),
        ("qsgd", "none", "exchange"),
        ("powersgd", "none", "exchange"),
        ("topk", "residual", "between"),
        ("topk", "residual", "accelerate"),
    ],
)
def test_a_group_killed_in_or_between_steps_is_survived_and_comes_back_bit_identical(
    lighthouse, tmp_path, compressor, memory, when
):
    """Three groups; group 2 kills itself (SIGKILL) at a step (from step 6 on) that all three take
    part in: after its forward, before its exchange (``exchange``, also through Accelerate's
    ``prepare``), or after its optimizer step (``between``). The survivors go on as two without a
    restart, and redo at most the step in flight: a failed step leaves their parameters, optimizer
    state, error feedback and compressor state bit-identical to a snapshot taken before it. Group 2,
    started again under its id, heals from a live peer; then every group holds the same parameters,
    optimizer state, compressor state all groups share (PowerSGD's factors) and global step, to the
    bit."""
    options = ["--steps", "30", "--compressor", compressor, "--memory", memory]
    if when == "accelerate":  # through gc_strategy.accelerate.prepare, killed in the exchange
        options, when = [*options, "--via", "accelerate"], "exchange"
    results = third_killed_and_restarted(lighthouse, tmp_path, options, ["--die-at", "6", "--die-when", when])
    for survivor in results[:2]:
        record = survivor["record"]
        committed = [r for r in record if r["committed"]]
        failed = [r for r in record if not r["committed"]]
        assert all(r["state_kept"] for r in failed)  # parameters, optimizer and roles as before the step
        assert len({r["step"] for r in failed}) <= 1  # at most the step in flight is redone
        if when == "exchange":  # the step group 2 died in failed, and was redone as two
            assert failed and failed[0]["participants"] == 3
            alone = failed[0]["step"]
        else:  # the step after group 2's last one
            first_full = next(i for i, r in enumerate(committed) if r["participants"] == 3)
            alone = next(r["step"] for r in committed[first_full:] if r["participants"] == 2)
        assert next(r["participants"] for r in committed if r["step"] == alone) == 2
        steps = [r["step"] for r in committed]
        assert steps == list(range(steps[0], steps[-1] + 1))  # no step skipped, none twice
        assert committed[-1]["participants"] == 3  # three again at the end
    healed = results[2]["record"]
    assert healed[0]["step"] > alone and healed[-1]["participants"] == 3  # took its peer's step, not 0
    for other in results[1:]:
        assert same(results[0]["params"], other["params"])
        assert same(results[0]["optimizer"], other["optimizer"])
        assert other["committed_steps"] == results[0]["committed_steps"]
        assert same(results[0]["state"]["compressor_extra"], other["state"]["compressor_extra"])
    if memory == "residual":  # the healed group's own error feedback started at zero: it differs
        residual = results[2]["state"]["memory"]["residual"]
        assert any(not torch.equal(residual[p], results[0]["state"]["memory"]["residual"][p]) for p in residual)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["usage", "check_group"])
def test_a_kill_in_a_collective_beside_the_exchanges_fails_the_round_instead_of_raising(lighthouse, tmp_path, where):
    """Every collective over the quorum's group is guarded, not only the exchanges. ``usage``: three
    groups with ``find_unused_parameters=True``; group 2 kills itself (SIGKILL) as it is about to
    sum a step's usage flags, its buckets' exchanges launched. ``check_group``: the compressor's
    ``check_group`` sums over the group (as ``randk``'s gathers do on an accelerator); group 2 is
    killed between two steps, and group 1 kills itself inside ``check_group`` at the rebind that
    follows. Either way the survivors fail that round instead of raising (nothing applied, every
    state as before it) and go on; the dead groups, started again, heal, and all end bit-identical."""
    options = ["--steps", "16", "--compressor", "topk", "--memory", "residual"]
    options += ["--find-unused"] if where == "usage" else ["--check-group-collective"]
    if where == "usage":
        dying = {2: ["--die-at", "4", "--die-when", "usage"]}
    else:
        dying = {2: ["--die-at", "4", "--die-when", "between"], 1: ["--die-when", "check_group"]}
    together = ["--barrier", str(tmp_path)]
    groups = [start(lighthouse, g, 3, tmp_path, *options, *together, *dying.get(g, [])) for g in range(3)]
    for g in dying:
        assert groups[g].wait(timeout=120) == -signal.SIGKILL, (tmp_path / f"{g}.log").read_text()[-3000:]
    for g in dying:
        groups[g] = start(lighthouse, g, 3, tmp_path, *options)
    results = [finish(p, tmp_path, g) for g, p in enumerate(groups)]
    survivors = [g for g in range(3) if g not in dying]
    for g in survivors:
        record = results[g]["record"]
        failed = [r for r in record if not r["committed"]]
        assert failed and all(r["state_kept"] for r in failed)  # the round failed; nothing was applied
        steps = [r["step"] for r in record if r["committed"]]
        assert steps == list(range(steps[0], steps[-1] + 1))  # no step skipped, none twice
    for other in results[1:]:
        assert same(results[0]["params"], other["params"])
        assert same(results[0]["optimizer"], other["optimizer"])


@pytest.mark.slow
@pytest.mark.parametrize("when", ["inner", "outer"])
def test_diloco_survives_a_group_killed_in_inner_steps_or_the_outer_exchange_and_heals_it(lighthouse, tmp_path, when):
    """DiLoCo (``inner_steps=5``, ``topk`` + residual), three groups; group 2 kills itself in the
    first inner step from 12 on after an outer step all three took part in (``inner``), or in the
    first such outer exchange, with the matrices' Δ in flight (``outer``). The survivors go on
    without restart: ``inner``: the next outer step averages the two survivors' Δ; ``outer``: that
    outer step fails, leaves parameters, optimizers, outer values and the roles' state bit-identical
    to a snapshot taken before it, and is redone as two at once (no inner step is lost). Group 2,
    started again, heals in an outer step of the survivors and sends no Δ in it (it trained none);
    then every group holds the same parameters, outer values, outer optimizer and inner step, to
    the bit, and its own error feedback."""
    options = ["--steps", "25", "--inner-steps", "5", "--compressor", "topk", "--memory", "residual"]
    results = third_killed_and_restarted(lighthouse, tmp_path, options, ["--die-at", "12", "--die-when", when])
    for survivor in results[:2]:
        rounds = survivor["record"]
        committed = [r for r in rounds if r["committed"]]
        failed = [r for r in rounds if not r["committed"]]
        steps = [r["step"] for r in committed]
        assert steps == list(range(steps[0], steps[-1] + 1, 5))  # each outer step once, from the group's start
        first_full = next(i for i, r in enumerate(committed) if r["participants"] == 3)
        after_death = next(r for r in committed[first_full:] if r["participants"] == 2)
        assert after_death["step"] >= 15 and after_death["contributors"] == 2
        assert all(r["state_kept"] for r in failed)
        if when == "outer":  # the round group 2 died in failed, and was redone as two at the same step
            assert [(r["step"], r["participants"]) for r in failed] == [(after_death["step"], 3)]
        else:
            assert not failed
        assert committed[-1]["participants"] == 3
    joined = results[2]["record"][0]
    assert joined["committed"] and joined["step"] > after_death["step"]  # healed: its peers' inner step, not 0
    peers_round = next(r for r in results[0]["record"] if r["committed"] and r["step"] == joined["step"])
    assert peers_round["participants"] == 3 and peers_round["contributors"] == 2 == joined["contributors"]
    for other in results[1:]:
        for key in ("params", "outer", "outer_optimizer"):
            assert same(results[0][key], other[key]), key
        assert other["inner_step"] == results[0]["inner_step"]
    residuals = [r["states"][0]["memory"]["residual"] for r in results]
    assert any(not torch.equal(residuals[2][p], residuals[0][p]) for p in residuals[0])  # its own, from zero


@pytest.mark.slow
def test_diloco_groups_started_apart_end_together_at_one_outer_step(lighthouse, tmp_path):
    """DiLoCo (``inner_steps=5``, ``--steps 10``), two groups; group 1 starts seconds after group
    0, which trains past step 10 alone meanwhile. Group 1 heals in an outer step of group 0 to
    which it contributes nothing; the run ends at the next outer step, where both contribute: both
    groups end there, at the same inner step with the same parameters (neither trains on alone)."""
    options = ["--steps", "10", "--inner-steps", "5", "--compressor", "topk", "--memory", "residual"]
    first = start(lighthouse, 0, 2, tmp_path, *options)
    time.sleep(8)
    groups = [first, start(lighthouse, 1, 2, tmp_path, *options)]
    results = [finish(p, tmp_path, g) for g, p in enumerate(groups)]
    assert results[0]["inner_step"] == results[1]["inner_step"] > 10
    assert same(results[0]["params"], results[1]["params"])
    joined = results[1]["record"][0]
    assert joined["contributors"] == 1 and results[1]["record"][-1]["step"] == joined["step"] + 5
    assert [(r["participants"], r["contributors"]) for r in results[1]["record"][-1:]] == [(2, 2)]


@pytest.mark.slow
def test_a_diloco_group_left_out_of_an_outer_step_while_alive_heals_and_says_why(lighthouse, tmp_path):
    """Three DiLoCo groups; group 2 stalls 3 s in inner step 7, past the lighthouse's join timeout
    (0.5 s): groups 0 and 1 take outer steps as two (a majority of the live groups), group 2 then
    heals from them in a later round and warns that it was left out while it trained, naming the
    lighthouse's join timeout. The others, and group 2 at its first round (the run's start, where
    groups take the first one's state), do not warn; all end bit-identical."""
    options = ["--steps", "25", "--inner-steps", "5", "--compressor", "topk", "--memory", "residual"]
    together = ["--barrier", str(tmp_path)]
    stall = ["--pause-at", "7"]
    groups = [start(lighthouse, g, 3, tmp_path, *options, *together, *(stall if g == 2 else [])) for g in range(3)]
    results = [finish(p, tmp_path, g) for g, p in enumerate(groups)]
    without = [r for r in results[0]["record"] if r["committed"] and r["participants"] == 2 and r["step"] >= 10]
    assert without  # groups 0 and 1 went on without the stalled group
    logs = [(tmp_path / f"{g}.log").read_text() for g in range(3)]
    said = "replica group 2 was left out of an outer step while it trained, and healed from a peer"
    assert said in logs[2] and "--join_timeout_ms is shorter than an inner phase" in logs[2]
    assert all("left out of an outer step" not in log for log in logs[:2])
    for other in results[1:]:
        for key in ("params", "outer", "outer_optimizer"):
            assert same(results[0][key], other[key]), key


def _gc_fused_steps(rank: int, world_size: int, steps: int) -> list[dict]:
    """The ft worker's training without fault tolerance, as ``gc_fused`` runs it (a
    GradientSynchronizer over a gloo group of every rank), rank ``r`` on shard ``r``: the
    parameters after each step."""
    from gc_strategy import GradientSynchronizer

    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    sync = GradientSynchronizer(net, build_components("none", fusion="groups:2"))
    after = []
    for step in range(steps):
        with sync.forward_pass():
            x, y = batch(rank, step)
            loss = (net(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after.append({n: p.detach().clone() for n, p in net.named_parameters()})
    sync.close()
    return after


@pytest.mark.slow
@pytest.mark.parametrize(("groups", "ranks"), [(3, 1), (2, 2)])
def test_groups_without_failures_equal_gc_fused_on_the_same_ranks_every_step(tmp_path, groups, ranks):
    """``compressor=none``, three groups of one rank, or two of two ranks (one torchrun each), each
    step committed only with all of them (``min_replicas``): after every step, every rank's
    parameters equal those of ``gc_fused``'s synchroniser on as many ranks (the same shards) within
    fp32 rounding, and those of plain SGD on the average of all ranks' gradients computed here."""
    steps, world = 8, groups * ranks
    fused = run_ranks(_gc_fused_steps, world, steps)  # before the lighthouse: the ranks fork from this process
    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=groups, join_timeout_ms=500)
    try:
        options = ["--steps", str(steps), "--min-replicas", str(groups)]
        started = [start(server.address(), g, groups, tmp_path, *options, ranks=ranks) for g in range(groups)]
        for g, process in enumerate(started):
            finish(process, tmp_path, g, load=False)
    finally:
        server.shutdown()
    names = [f"{g}.pt" if ranks == 1 else f"{g}.rank{r}.pt" for g in range(groups) for r in range(ranks)]
    records = [[r for r in torch.load(tmp_path / name)["record"] if r["committed"]] for name in names]
    reference = model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for step in range(steps):
        grads = []
        for shard in range(world):
            reference.zero_grad()
            x, y = batch(shard, step)
            (reference(x) - y).square().mean().backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        for p, *each in zip(reference.parameters(), *grads):
            p.grad = sum(each) / world
        optimizer.step()
        for rank, record in enumerate(records):
            assert record[step]["step"] == step and record[step]["participants"] == groups
            for name, value in reference.named_parameters():
                torch.testing.assert_close(record[step]["params"][name], fused[rank][step][name])
                torch.testing.assert_close(record[step]["params"][name], value.detach(), rtol=0, atol=1e-6)


def _diloco_steps(
    rank: int, world_size: int, steps: int, inner_steps: int, ranks: int, fragments: int = 1, overlap: int = 0
) -> dict:
    """The ft worker's DiLoCo without fault tolerance, as one process per replica (a
    DiLoCoSynchronizer over a gloo group of ``world_size`` processes): replica ``g`` trains on the
    ``ranks`` shards of group ``g`` at once (its loss the mean of theirs). Its parameters and outer
    values at the end."""
    from gc_strategy import DiLoCo
    from gc_strategy.sync.diloco.synchronizer import DiLoCoSynchronizer

    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    roles = build_components("topk", "residual", fusion="groups:2")
    config = DiLoCo(inner_steps=inner_steps, outer_lr=0.5, fragments=fragments, overlap_steps=overlap)
    sync = DiLoCoSynchronizer(net, roles, config)
    for step in range(steps):
        losses = []
        with sync.forward_pass():
            for shard in range(rank * ranks, (rank + 1) * ranks):
                x, y = batch(shard, step)
                losses.append((net(x) - y).square().mean())
        (sum(losses) / ranks).backward()
        optimizer.step()
        optimizer.zero_grad()
        sync.after_optimizer_step()
    result = {"params": {n: p.detach().clone() for n, p in net.named_parameters()}, "outer": dict(sync.outer)}
    sync.close()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True])
def test_groups_of_unequal_ranks_are_refused_at_their_first_quorum(tmp_path, sharded):
    """A group of two ranks and a group of one (one torchrun each where sharded with FSDP2),
    every step only with both (``min_replicas``): rank 1 of the first has no counterpart to
    exchange with. Both groups end at their first quorum, well before ``timeout_s`` would have
    passed twice, with an error that names the ranks per group and what is allowed, and neither
    takes a step."""
    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500)
    try:
        options = ["--steps", "4", "--min-replicas", "2", "--timeout", "30", *(["--sharded"] if sharded else [])]
        started = [start(server.address(), g, 2, tmp_path, *options, ranks=2 - g, torchrun=sharded) for g in range(2)]
        began = time.monotonic()
        for g, process in enumerate(started):
            assert process.wait(timeout=120) != 0
            log = (tmp_path / f"{g}.log").read_text()
            refusal = r"replica groups of unequal ranks in one quorum \(ranks per group: \[(2, 1|1, 2)\]"
            assert re.search(refusal, log), log[-3000:]
            assert "allowed: every group as many ranks" in log
        assert time.monotonic() - began < 60
        assert not list(tmp_path.glob("*.pt"))
    finally:
        server.shutdown()


@pytest.mark.slow
def test_diloco_across_groups_of_two_ranks_is_diloco_over_one_replica_per_group(tmp_path):
    """DiLoCo (``inner_steps=4``, ``topk`` + residual) across two groups of two ranks (one torchrun
    each), no failure, every outer step with both groups (``min_replicas``): each group trains as one
    replica whose inner steps average its ranks' gradients, so every rank ends with the parameters
    and outer values of DiLoCo over two processes that each train on both shards of its group at
    once, within fp32 rounding; and the two ranks of a group hold the same values, to the bit."""
    steps, inner = 12, 4
    reference = run_ranks(_diloco_steps, 2, steps, inner, 2)  # before the lighthouse: the ranks fork from here
    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500)
    try:
        options = ["--steps", str(steps), "--inner-steps", str(inner), "--min-replicas", "2"]
        options += ["--compressor", "topk", "--memory", "residual"]
        started = [start(server.address(), g, 2, tmp_path, *options, ranks=2) for g in range(2)]
        for g, process in enumerate(started):
            finish(process, tmp_path, g, load=False)
    finally:
        server.shutdown()
    for g in range(2):
        ranks = [torch.load(tmp_path / f"{g}.rank{r}.pt") for r in range(2)]
        assert ranks[0]["inner_step"] == steps and same(ranks[0]["params"], ranks[1]["params"])
        assert all(r["participants"] == 2 for r in ranks[0]["record"] if r["committed"])
        for name, value in reference[g]["params"].items():
            torch.testing.assert_close(ranks[0]["params"][name], value, rtol=0, atol=1e-5)
            torch.testing.assert_close(ranks[0]["outer"][name], reference[g]["outer"][name], rtol=0, atol=1e-5)


STREAMING = ["--inner-steps", "6", "--fragments", "2", "--overlap", "1", "--compressor", "topk", "--memory", "residual"]


@pytest.mark.slow
def test_streaming_diloco_groups_without_failures_are_streaming_diloco_over_one_process_per_group(tmp_path):
    """Streaming DiLoCo (``inner_steps=6``, 2 fragments, ``overlap_steps=1``, ``topk`` + residual),
    two groups of one process, every round with both (``min_replicas``): each fragment's exchange a
    round that begins after its inner step (3, then 6) and ends one inner step later. Both groups end
    with the parameters (local values mixed with the outer ones) and outer values of Streaming
    DiLoCo over two processes without fault tolerance, within fp32 rounding, at inner step 13 (the
    second fragment's round of the second period ends there)."""
    steps = 13
    reference = run_ranks(_diloco_steps, 2, steps, 6, 1, 2, 1)  # before the lighthouse: the ranks fork from here
    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500)
    try:
        options = ["--steps", "12", "--min-replicas", "2", *STREAMING]
        started = [start(server.address(), g, 2, tmp_path, *options) for g in range(2)]
        results = [finish(process, tmp_path, g) for g, process in enumerate(started)]
    finally:
        server.shutdown()
    for g, result in enumerate(results):
        assert result["inner_step"] == steps
        rounds = [(r["step"], r["fragment"], r["participants"], r["contributors"]) for r in result["record"]]
        assert rounds == [(0, 1, 2, 0), (4, 0, 2, 2), (7, 1, 2, 2), (10, 0, 2, 2), (13, 1, 2, 2)]
        for name, value in reference[g]["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=0, atol=1e-5)
            torch.testing.assert_close(result["outer"][name], reference[g]["outer"][name], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("when", "at"),
    [("inner", 13), ("inner", 15), ("outer", 14)],
    ids=["between_rounds", "in_an_overlapped_exchange", "starting_an_exchange"],
)
def test_streaming_diloco_survives_a_group_killed_between_or_in_its_fragments_rounds(lighthouse, tmp_path, when, at):
    """Streaming DiLoCo (``inner_steps=6``, 2 fragments, ``overlap_steps=1``), three groups; group 2
    kills itself in the forward of inner step 13 (no round running), of step 15 (in the overlap of
    the first fragment's round, begun after step 15: its exchange in flight or just ended) or as it
    starts a fragment's vectors' exchange from step 14 on (the matrices' in flight). The survivors go
    on without restart: a round whose exchange it did not finish fails, leaves the outer values, the
    outer optimizer and the roles' state bit-identical to a snapshot taken as it began, and is run
    again at once as two; every fragment's round of every period commits once, at its inner step.
    Group 2, started again, heals in one of the survivors' rounds, contributes no Δ to it and takes
    part in it; then every group holds the same outer values, outer optimizer and inner step, to the
    bit."""
    options = ["--steps", "30", *STREAMING]
    results = third_killed_and_restarted(lighthouse, tmp_path, options, ["--die-at", str(at), "--die-when", when])
    for survivor in results[:2]:
        rounds = survivor["record"]
        committed = [r for r in rounds if r["committed"]][1:]  # after the run's first round
        failed = [r for r in rounds if not r["committed"]]
        assert [(r["step"], r["fragment"]) for r in committed] == [(4 + 3 * i, i % 2) for i in range(len(committed))]
        assert all(r["state_kept"] for r in failed)
        # in inner steps: the next quorum may still hold the dead group, and a round's exchange may have
        # ended before the kill (the round commits: every Δ arrived); starting an exchange, it fails
        assert len(failed) <= 1 if when == "inner" else len(failed) == 1
        assert all(r["participants"] == 3 for r in failed)
        assert committed[-1]["participants"] == 3 and committed[-1]["contributors"] == 3
    joined = results[2]["record"][0]
    assert joined["committed"] and joined["step"] > at and joined["contributors"] == 2
    for other in results[1:]:
        for key in ("outer", "outer_optimizer"):
            assert same(results[0][key], other[key]), key
        assert other["inner_step"] == results[0]["inner_step"]


def _streaming_checkpoints(rank: int, world_size: int, lighthouse: str, save: bool) -> dict:
    """One group of Streaming DiLoCo (``inner_steps=4``, 2 fragments, ``overlap_steps=1``) for 6
    inner steps, with (``save``) a checkpoint's state taken after every step: whether a round ran
    then, and the exchanging synchronisers' saved state; the outer values at the end."""
    import copy

    from gc_strategy import DiLoCo
    from gc_strategy.sync.fault_tolerance.diloco import FaultTolerantDiLoCo

    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    config = DiLoCo(inner_steps=4, outer_lr=0.5, fragments=2, overlap_steps=1)
    roles = build_components("topk", "residual", fusion="groups:2")
    sync = FaultTolerantDiLoCo(net, roles, config, FaultTolerance(lighthouse, 0))
    sync.use_optimizers([optimizer])
    saved = []
    for step in range(6):
        with sync.forward_pass():
            x, y = batch(0, step)
            loss = (net(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sync.after_optimizer_step()
        if save:
            state = copy.deepcopy(sync.state_dict()["synchronizer"]["synchronizers"])
            saved.append({"running": sync.plan is not None, "synchronizers": state})
    outer = {name: value.clone() for name, value in sync.inner.outer.items()}
    sync.close()
    return {"saved": saved, "outer": outer}


@pytest.mark.slow
def test_a_checkpoint_taken_while_a_streaming_round_runs_saves_the_state_from_before_it(tmp_path):
    """One group of Streaming DiLoCo, a checkpoint's state taken after every inner step: after step
    2 the first fragment's round runs (begun there, ends after step 3), and the saved state of the
    roles (error feedback, steps, compressor state) is the one saved after step 1, to the bit (the
    exchange started has written the residual: resumed, the round runs again from that state); after
    the round it differs. Taking the checkpoints changes nothing: the outer values at the end equal
    those of the same run without them, to the bit."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    binary = Path(sys.executable).with_name("torchft_lighthouse")
    command = [str(binary), "--min_replicas", "1", "--join_timeout_ms", "100", "--bind", f"127.0.0.1:{port}"]
    server = launch(command, tmp_path / "lighthouse.log")
    address = f"http://127.0.0.1:{port}"
    reach_lighthouse(FaultTolerance(address, 0, timeout_s=10))
    try:
        with_checkpoints = run_ranks(_streaming_checkpoints, 1, address, True)[0]
        without = run_ranks(_streaming_checkpoints, 1, address, False)[0]
    finally:
        server.kill()
    saved = with_checkpoints["saved"]
    assert [s["running"] for s in saved] == [False, True, False, True, False, True]
    assert same(saved[1]["synchronizers"], saved[0]["synchronizers"])
    assert not same(saved[2]["synchronizers"], saved[0]["synchronizers"])
    assert same(with_checkpoints["outer"], without["outer"])


@pytest.mark.slow
def test_diloco_across_groups_of_two_ranks_survives_a_group_killed_in_inner_steps(lighthouse, tmp_path):
    """DiLoCo (``inner_steps=5``, ``topk`` + residual), two groups of two ranks; both ranks of
    group 1 kill themselves in the first inner step from 7 on after an outer step both took part
    in (a lost node). Group 0 goes on alone; group 1, started again, heals rank by rank in an outer
    step of group 0 and sends no Δ in it; then all four ranks hold the same parameters, outer
    values, outer optimizer and inner step, to the bit."""
    options = ["--steps", "25", "--inner-steps", "5", "--compressor", "topk", "--memory", "residual"]
    dying, together = ["--die-at", "7", "--die-when", "inner"], ["--barrier", str(tmp_path)]
    groups = [start(lighthouse, g, 2, tmp_path, *options, *together, *(dying if g else []), ranks=2) for g in range(2)]
    assert groups[1].wait(timeout=180) != 0
    groups[1] = start(lighthouse, 1, 2, tmp_path, *options, ranks=2)
    for g, process in enumerate(groups):
        finish(process, tmp_path, g, load=False)
    results = {(g, r): torch.load(tmp_path / f"{g}.rank{r}.pt") for g in range(2) for r in range(2)}
    for rank in range(2):
        committed = [r for r in results[0, rank]["record"] if r["committed"]]
        assert any(r["participants"] == 1 and r["contributors"] == 1 for r in committed)  # alone meanwhile
        joined = results[1, rank]["record"][0]
        assert joined["committed"] and joined["step"] >= 10 and joined["contributors"] == 1  # healed, sent no Δ
        assert committed[-1]["participants"] == 2
    first = results[0, 0]
    for other in results.values():
        for key in ("params", "outer", "outer_optimizer"):
            assert same(first[key], other[key]), key
        assert other["inner_step"] == first["inner_step"]


@pytest.mark.slow
def test_a_group_of_two_ranks_killed_in_its_exchange_is_survived_and_comes_back_bit_identical(lighthouse, tmp_path):
    """Two groups of two ranks (one torchrun each), ``topk`` + residual; both ranks of group 1 kill
    themselves in a step both groups take part in (a lost node). Group 0 goes on alone without a
    restart; its failed step leaves both its ranks' parameters, optimizer, error feedback and
    compressor state bit-identical to a snapshot before it. Group 1, started again, heals rank by
    rank from group 0; then all four ranks hold bit-identical parameters and optimizer state, and
    the same global step."""
    options = ["--steps", "20", "--compressor", "topk", "--memory", "residual"]
    dying, together = ["--die-at", "4"], ["--barrier", str(tmp_path)]
    groups = [start(lighthouse, g, 2, tmp_path, *options, *together, *(dying if g else []), ranks=2) for g in range(2)]
    assert groups[1].wait(timeout=120) != 0
    groups[1] = start(lighthouse, 1, 2, tmp_path, *options, ranks=2)
    for g, process in enumerate(groups):
        finish(process, tmp_path, g, load=False)
    results = {(g, r): torch.load(tmp_path / f"{g}.rank{r}.pt") for g in range(2) for r in range(2)}
    for rank in range(2):
        record = results[0, rank]["record"]
        failed = [r for r in record if not r["committed"]]
        assert failed and failed[0]["participants"] == 2 and all(r["state_kept"] for r in failed)
        assert len({r["step"] for r in failed}) == 1  # only the step in flight is redone
        assert any(r["committed"] and r["participants"] == 1 for r in record)  # then on alone
        assert record[-1]["participants"] == 2
        assert results[1, rank]["record"][0]["step"] > failed[0]["step"]  # healed: its peer's step
    first = results[0, 0]
    for other in results.values():
        assert same(first["params"], other["params"])
        assert same(first["optimizer"], other["optimizer"])
        assert other["committed_steps"] == first["committed_steps"]


@pytest.mark.slow
def test_a_healing_that_fails_on_one_rank_of_a_group_is_applied_by_none_and_retried(lighthouse, tmp_path):
    """Two groups of two ranks (one torchrun each); group 0 trains alone for a few steps, then group 1
    joins and heals, but the first fetch of a peer's state fails on its rank 1 alone (as where the
    peer died while sending it). Neither of its ranks applies a peer's state: that round commits
    nowhere in group 1 and leaves both its ranks at step 0; the next heals both, and then all four
    ranks hold bit-identical parameters and optimizer state, and the same global step."""
    options = ["--steps", "12", "--compressor", "topk", "--memory", "residual"]
    first = start(lighthouse, 0, 2, tmp_path, *options, ranks=2)
    log, deadline = tmp_path / "0.log", time.monotonic() + 120
    while b"committed step 3" not in log.read_bytes():
        assert time.monotonic() < deadline and first.poll() is None, log.read_text()
        time.sleep(0.1)
    groups = [first, start(lighthouse, 1, 2, tmp_path, *options, "--lose-first-healing", "1", ranks=2)]
    for g, process in enumerate(groups):
        finish(process, tmp_path, g, load=False)
    results = {(g, r): torch.load(tmp_path / f"{g}.rank{r}.pt") for g in range(2) for r in range(2)}
    for rank in range(2):
        record = results[1, rank]["record"]
        assert not record[0]["committed"] and record[0]["step"] == 0  # the failed healing: applied by neither rank
        assert record[1]["committed"] and record[1]["step"] > 3  # healed at the next round: its peer's step
    first = results[0, 0]
    for other in results.values():
        assert same(first["params"], other["params"])
        assert same(first["optimizer"], other["optimizer"])
        assert other["committed_steps"] == first["committed_steps"]


@pytest.mark.slow
def test_the_documented_plain_loop_survives_a_kill_and_every_step_reads_its_own_batch(lighthouse, tmp_path):
    """docs/fault_tolerance.md's plain loop, executed as written (tests/ft_docs_loop.py records it),
    as three replica groups started together; group 2 is killed (SIGKILL, by the id of the process
    started here) once it took part in a step from 20 on, and started again under its id. Every
    forward of every group, the restarted one's included, read the batch of the step it belongs to;
    the restarted group healed (its first step is its peers', not 0); all three end at the same step
    with the same parameters. Their consoles hold none of torchft's INFO lines, torch's warnings at
    a heal or the checkpoint server's access lines."""
    worker = TESTS / "ft_docs_loop.py"

    def run(group: int, *barrier: str) -> subprocess.Popen:
        env = group_env(LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(group), GROUPS="3")
        with open(tmp_path / f"{group}.log", "ab") as log:
            command = [sys.executable, str(worker), str(tmp_path / f"{group}.pt"), *barrier]
            STARTED.append(subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True))
        return STARTED[-1]

    groups = [run(g, str(tmp_path)) for g in range(3)]
    log, deadline = tmp_path / "2.log", time.monotonic() + 120
    while not any(int(step) >= 20 for step in re.findall(rb"^step (\d+)$", log.read_bytes(), flags=re.M)):
        assert time.monotonic() < deadline and groups[2].poll() is None, log.read_text()
        time.sleep(0.05)
    os.kill(groups[2].pid, signal.SIGKILL)
    assert groups[2].wait(timeout=30) == -signal.SIGKILL
    groups[2] = run(2)
    results = [finish(p, tmp_path, g) for g, p in enumerate(groups)]
    for result in results:
        assert result["record"] and all(r["own_batch"] for r in result["record"])
        assert result["committed_steps"] >= 200
    restarted = [r["step"] for r in results[2]["record"]]
    assert restarted[0] > 20 and restarted == list(range(restarted[0], restarted[-1] + 1))  # healed: its peers' step
    for other in results[1:]:
        assert other["committed_steps"] == results[0]["committed_steps"]
        assert same(results[0]["params"], other["params"])
    for g in range(3):
        console = (tmp_path / f"{g}.log").read_text()
        for noise in ("should_commit=", "reconfiguring for", "setSequenceNumberForGroup", "buffer is not writable"):
            assert noise not in console, (g, noise)
        assert "GET /checkpoint" not in console


ALONE = """
import sys, warnings
import torch
from ft_worker import batch, model
from gc_strategy import FaultTolerance, FaultTolerantSynchronizer, build_components

net = model()
optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
options = FaultTolerance(sys.argv[1], 0, groups=int(sys.argv[2]), host="127.0.0.1")
sync = FaultTolerantSynchronizer(net, build_components("topk", "residual"), options)
sync.use_optimizers([optimizer])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(3):
        assert sync.start_step() == step
        with sync.forward_pass():
            loss = (net(batch(0, step)[0]) - batch(0, step)[1]).square().mean()
        loss.backward()
        assert sync.should_commit() and sync.participants == 1
        optimizer.step()
        optimizer.zero_grad()
sync.close()
for warning in caught:
    if "trains alone" in str(warning.message):
        print(warning.category.__name__, warning.message)
"""


@pytest.mark.parametrize("groups", [2, 1])
def test_a_group_that_trains_alone_while_others_are_planned_says_so_once(lighthouse, tmp_path, groups):
    """One replica group of ``groups`` planned (a process of its own), alone at the lighthouse for
    three steps: with ``groups = 2`` it warns once, at its first step, naming ``min_replicas``;
    alone as planned (``groups = 1``) it says nothing."""
    command = [sys.executable, "-c", ALONE, lighthouse, str(groups)]
    env = group_env(PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.splitlines()
    if groups == 1:
        assert not said
    else:
        assert len(said) == 1 and said[0].startswith("RuntimeWarning "), said
        assert "replica group 0 trains alone: it is the only one of groups = 2" in said[0]
        assert "set min_replicas to the fewest groups a step should have" in said[0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lighthouse": "127.0.0.1:29510"}, "'lighthouse' = '127.0.0.1:29510' is invalid; allowed: the lighthouse's"),
        ({"replica_group": -1}, "'replica_group' = -1 is invalid; allowed: an integer in [0, inf)"),
        ({"replica_group": 3, "groups": 3}, "'replica_group' = 3 is invalid with groups = 3; allowed: 0 to 2"),
        ({"min_replicas": 0}, "'min_replicas' = 0 is invalid; allowed: an integer in [1, inf)"),
        ({"timeout_s": 0}, "'timeout_s' = 0 is invalid; allowed: a number in (0, inf)"),
        ({"timeouts": 5}, "does not take option(s) timeouts (did you mean 'timeout_s'?)"),
    ],
)
def test_bad_options_are_refused_with_the_option_the_value_and_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        FaultTolerance(**{"lighthouse": "http://127.0.0.1:29510", "replica_group": 0, **options})


def test_sharded_training_takes_fault_tolerance_and_refuses_what_it_cannot_serve():
    """``gc_fsdp`` takes ``fault_tolerance`` for every step's exchange and for DiLoCo; Streaming
    DiLoCo (not offered over shards), and a mode that declares no sharded fault tolerance, are
    refused before any work."""
    from gc_strategy import DiLoCo, GCFSDPStrategy
    from gc_strategy.sync.modes import Sharded, SyncMode, check_setup

    options = FaultTolerance("http://127.0.0.1:1", 0)
    for sync in ("every_step", DiLoCo(inner_steps=4)):
        assert GCFSDPStrategy(compressor="topk", sync=sync, fault_tolerance=options).fault_tolerance is options
    with pytest.raises(ValueError, match=re.escape("DiLoCo over shards: fragments = 2 and overlap_steps = 0 are")):
        GCFSDPStrategy(sync=DiLoCo(inner_steps=4, fragments=2), fault_tolerance=options)

    class Replicas(SyncMode):
        name, fault_tolerant = "replicas", True

    message = (
        "fault_tolerance with sync='replicas' and sharding is not supported; allowed: sync in ['diloco', 'every_step']"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        check_setup(Replicas(), build_components("topk"), Sharded(fault_tolerance=options))


def test_a_measured_fusion_plan_is_refused_before_any_work():
    """By the synchroniser, and by the Lightning strategy at its construction (before any process
    group exists)."""
    from gc_strategy import GCFusedStrategy

    options = FaultTolerance("http://127.0.0.1:1", 0)
    with pytest.raises(ValueError, match="fusion = 'auto' is invalid"):
        FaultTolerantSynchronizer(model(), build_components("topk", "residual", fusion="auto"), options)
    with pytest.raises(ValueError, match="fusion = 'auto' is invalid"):
        GCFusedStrategy(compressor="topk", fusion="auto", fault_tolerance=options)


def test_a_lighthouse_that_refuses_connections_is_reported_within_seconds():
    """Nothing listens at the address (connection refused): reported in about 3 s, not after
    ``timeout_s`` (30 s by default), saying so."""
    options = FaultTolerance("http://127.0.0.1:1", 0, host="127.0.0.1")
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=r"lighthouse at http://127.0.0.1:1 refused the connection for 3\.\d s"):
        FaultTolerantSynchronizer(model(), build_components("none"), options)
    assert time.monotonic() - start < 5


def test_a_lighthouse_that_does_not_answer_is_waited_for_timeout_s(monkeypatch):
    """Connections that go unanswered (a dropped packet, a host that is down; here each attempt
    times out): the lighthouse is waited for until ``timeout_s``, then reported."""

    def unanswered(address, timeout):
        time.sleep(min(timeout, 0.3))
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", unanswered)
    options = FaultTolerance("http://lighthouse-host:29510", 0, timeout_s=1.5, host="127.0.0.1")
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=r"lighthouse-host:29510 did not answer within timeout_s = 1.5 s"):
        reach_lighthouse(options)
    assert 1.5 <= time.monotonic() - start < 3


@pytest.mark.slow
def test_fewer_groups_than_min_replicas_is_reported_after_the_quorum_timeout(lighthouse, tmp_path):
    process = start(lighthouse, 0, 1, tmp_path, "--steps", "5", "--min-replicas", "2", "--quorum-timeout", "3")
    assert process.wait(timeout=120) == 1
    log = (tmp_path / "0.log").read_text()
    assert "only 1 replica group(s) took part for over quorum_timeout_s = 3.0 s, and min_replicas = 2" in log


def test_without_torchft_every_path_says_at_construction_how_to_install_it(monkeypatch):
    """The synchroniser, the Lightning strategy and Accelerate's ``prepare``: one message, naming
    the install from a checkout and from a release, before anything is built (Accelerate's own
    state is left untouched: a stand-in accelerator)."""
    from types import SimpleNamespace

    from gc_strategy import GCFusedStrategy
    from gc_strategy.accelerate import prepare

    monkeypatch.setitem(sys.modules, "torchft", None)
    options = FaultTolerance("http://127.0.0.1:1", 0)
    message = r'needs torchft \(torch >= 2.7\), which is not installed: pip install -e "\.\[ft\]" in a checkout'
    message += r'.*, or pip install "gc-strategy\[ft\]"'
    with pytest.raises(ImportError, match=message):
        FaultTolerantSynchronizer(model(), build_components("none"), options)
    with pytest.raises(ImportError, match=message):
        GCFusedStrategy(compressor="topk", fault_tolerance=options)
    net = model()
    with pytest.raises(ImportError, match=message):
        prepare(
            SimpleNamespace(distributed_type="NO"),
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            fault_tolerance=options,
        )
    assert not hasattr(net, "gc_synchronizer")


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["gc_fused", "gc_fsdp"])
def test_under_lightning_a_killed_group_is_survived_and_heals_global_step_and_schedule(lighthouse, tmp_path, sharded):
    """``GCFusedStrategy(compressor="topk", memory="residual", fault_tolerance=...)``, or
    ``GCFSDPStrategy`` sharding the model over each group's ranks, two groups of two ranks, one
    torchrun each, each rank reading its quarter of the data. Both ranks of group 1 are killed
    before their backward at a step from global step 5 on, so group 0's exchange of that step
    fails; group 0 goes on alone; group 1, started again, heals the model, the optimizer, the LR
    schedule and the Trainer's step counters rank by rank (sharded: each rank its shard). Every
    rank ends with the same parameters, optimizer state, schedule and global step as the rank in
    its place in the other group, to the bit (replicated: as every rank)."""
    worker = TESTS / "ft_lightning_worker.py"

    def run(group: int, *extra: str) -> subprocess.Popen:
        args = ["--lighthouse", lighthouse, "--group", str(group), "--groups", "2", "--steps", "40"]
        args += ["--out", str(tmp_path / f"{group}.pt"), *extra, *(["--sharded"] if sharded else [])]
        return launch([*TORCHRUN, "--nproc_per_node=2", str(worker), *args], tmp_path / f"{group}.log")

    together = ["--barrier", str(tmp_path)]
    groups = [run(g, *together, *(["--die-at", "5"] if g == 1 else [])) for g in range(2)]
    assert groups[1].wait(timeout=180) != 0
    groups[1] = run(1)
    for g, process in enumerate(groups):
        finish(process, tmp_path, g, load=False)
    results = {(g, r): torch.load(tmp_path / f"{g}.rank{r}.pt") for g in range(2) for r in range(2)}
    for rank in range(2):
        record = results[0, rank]["record"]
        assert any(not r["committed"] and r["participants"] == 2 for r in record)  # the step in flight failed
        assert any(r["committed"] and r["participants"] == 1 for r in record)  # then on alone
        assert record[-1]["participants"] == 2
        assert results[1, rank]["record"][0]["global_step"] > 5  # healed: it took its peer's counters
    assert all(r["batches_per_epoch"] == math.ceil(4096 / 4 / 8) for r in results.values())  # a quarter each
    for (_, rank), other in results.items():
        first = results[0, rank if sharded else 0]
        assert same(first["params"], other["params"])
        assert same(first["optimizer"], other["optimizer"])
        assert first["scheduler"] == other["scheduler"]
        assert first["global_step"] == other["global_step"]
    assert sharded != same(results[0, 0]["params"], results[0, 1]["params"])  # sharded: a shard each


@pytest.fixture
def lighthouse_of_two():
    """A lighthouse that forms no quorum of fewer than two groups: a group started first waits."""
    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=500)
    yield server.address()
    server.shutdown()


@pytest.mark.slow
def test_under_lightning_one_group_writes_each_checkpoint_and_a_full_restart_resumes_exactly(
    lighthouse_of_two, tmp_path
):
    """Two groups (``topk`` + residual; a lighthouse and groups with ``min_replicas=2``: every step
    with both), a checkpoint at each of three epochs' end. Each checkpoint is written by one group
    (the first participant) and holds both groups' own state files beside it. Both groups started
    again from the first epoch's checkpoint end with the same parameters, optimizer state,
    schedule and global step as the run that was not stopped, to the bit: each took its own error
    feedback back, and the rounds' counter."""
    worker = TESTS / "ft_lightning_worker.py"
    folder = tmp_path / "checkpoints"
    lighthouse = lighthouse_of_two

    def run(group: int, out: str, *extra: str) -> subprocess.Popen:
        args = ["--lighthouse", lighthouse, "--group", str(group), "--groups", "2", "--steps", "1000000"]
        args += ["--samples", "64", "--epochs", "3", "--min-replicas", "2", "--out", str(tmp_path / out), *extra]
        return launch([*TORCHRUN, "--nproc_per_node=1", str(worker), *args], tmp_path / f"{group}.log")

    first = [run(g, f"{g}.pt", "--checkpoints", str(folder)) for g in range(2)]
    for g, process in enumerate(first):
        finish(process, tmp_path, g, load=False)
    uninterrupted = [torch.load(tmp_path / f"{g}.rank0.pt") for g in range(2)]
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"]
    assert all(a != b for a, b in zip(uninterrupted[0]["writers"], uninterrupted[1]["writers"]))  # one group each
    states = Path(f"{folder}.gc_state")
    assert sorted(p.name for p in (states / "epoch=0.ckpt").iterdir()) == ["rank0.pt", "rank1.pt"]
    resume = ["--resume", str(folder / "epoch=0.ckpt")]
    second = [run(g, f"{g}.resumed.pt", *resume) for g in range(2)]
    for g, process in enumerate(second):
        finish(process, tmp_path, g, load=False)
    for g in range(2):
        resumed = torch.load(tmp_path / f"{g}.resumed.rank0.pt")
        assert resumed["record"][0]["global_step"] == 5  # the first step after the checkpoint's 4
        for key in ("params", "optimizer", "scheduler", "global_step"):
            assert same(resumed[key], uninterrupted[g][key]), key


@pytest.mark.slow
def test_under_lightning_a_diloco_group_that_joins_late_takes_its_peers_step_and_schedule(lighthouse, tmp_path):
    """``sync=DiLoCo(inner_steps=4)`` under Lightning with a per-step LR schedule; group 1 starts
    seconds after group 0 and heals in one of its outer steps, whose state is taken inside the
    peer's optimizer step. The healed group trains on with the peer's ``global_step`` and schedule:
    both end at the same ``global_step`` with the same parameters, schedule and learning rate, to the
    bit (each keeps its own inner optimizer's momentum, as DiLoCo's replicas do)."""
    worker = TESTS / "ft_lightning_worker.py"
    args = ["--lighthouse", lighthouse, "--groups", "2", "--steps", "12", "--inner-steps", "4", "--out"]
    launcher = [*TORCHRUN, "--nproc_per_node=1", str(worker), *args]
    first = launch([*launcher, str(tmp_path / "0.pt"), "--group", "0"], tmp_path / "0.log")
    time.sleep(10)
    groups = [first, launch([*launcher, str(tmp_path / "1.pt"), "--group", "1"], tmp_path / "1.log")]
    for g, process in enumerate(groups):
        finish(process, tmp_path, g, load=False)
    results = [torch.load(tmp_path / f"{g}.rank0.pt") for g in range(2)]
    assert results[1]["record"][0]["global_step"] > 4  # joined late: its first step is past the first outer step
    assert results[0]["global_step"] == results[1]["global_step"]
    for key in ("params", "scheduler"):
        assert same(results[0][key], results[1][key]), key
    assert same(*(r["optimizer"]["param_groups"] for r in results))


@pytest.mark.slow
def test_under_lightning_diloco_groups_train_their_inner_steps_and_meet_at_each_outer_step(lighthouse_of_two, tmp_path):
    """``GCFusedStrategy(sync=DiLoCo(inner_steps=4), fault_tolerance=...)``, two groups (every outer
    step with both), each on its half of the data: after the last outer step both hold the same
    parameters and ``global_step`` to the bit, and differ from where they started."""
    worker = TESTS / "ft_lightning_worker.py"
    args = ["--lighthouse", lighthouse_of_two, "--groups", "2", "--steps", "12", "--inner-steps", "4"]
    args += ["--min-replicas", "2", "--out"]
    launcher = [*TORCHRUN, "--nproc_per_node=1", str(worker), *args]
    groups = [
        launch([*launcher, str(tmp_path / f"{g}.pt"), "--group", str(g)], tmp_path / f"{g}.log") for g in range(2)
    ]
    for g, process in enumerate(groups):
        finish(process, tmp_path, g, load=False)
    results = [torch.load(tmp_path / f"{g}.rank0.pt") for g in range(2)]
    assert results[0]["global_step"] == results[1]["global_step"] == 12
    assert [r["participants"] for r in results[0]["record"]] == [2] * 12
    assert same(results[0]["params"], results[1]["params"])
    start = {n: p.detach() for n, p in Regression().named_parameters()}
    assert not same(results[0]["params"], start)


def _app(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = group_env(OMP_NUM_THREADS="1")
    command = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}"]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_app_starts_a_lighthouse_and_the_groups_kills_one_restarts_it_and_plots_the_run(tmp_path):
    """``fault_tolerance.lighthouse=local`` with a kill: two groups; group 1 kills itself at a step
    both take part in, group 0's step fails and it goes on alone; group 1, started again, heals, and
    both end together at the same step with the same parameters, as the console says. The per-step
    CSV and the plot are written; the checkpoints are in one folder, each group's state beside them;
    both groups' summaries hold the last validation."""
    done = _app(
        tmp_path,
        *("fault_tolerance.lighthouse=local", "fault_tolerance.groups=2", "fault_tolerance.kill_group=1"),
        *("fault_tolerance.kill_at=4", "trainer.max_steps=12", "model=lstm", "data=synthetic_text"),
        *("compressor=topk", "memory=residual", "logger=csv", "trainer.checkpoint_every_n_steps=6"),
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "2 replica groups (1 process each)" in done.stdout
    assert "replica group 1 was killed (SIGKILL); starting it again" in done.stdout
    run = tmp_path / "run"
    rows = list(csv.DictReader((run / "fault_tolerance.csv").open()))
    mine = [r for r in rows if r["group"] == "0"]
    failed = [r for r in mine if r["committed"] == "0"]
    assert failed and failed[0]["participants"] == "2"
    after = mine[mine.index(failed[0]) + 1 :]
    assert after[0]["participants"] == "1" and after[-1]["participants"] == "2"  # alone, then with group 1 again
    last = {g: [r for r in rows if r["group"] == g][-1] for g in ("0", "1")}
    assert last["0"]["step"] == last["1"]["step"] and int(last["0"]["step"]) >= 12
    healed = next(r for r in rows if r["group"] == "1" and float(r["time"]) > float(failed[0]["time"]))
    assert (
        f"replica group 1 was killed (SIGKILL) in step {failed[0]['step']}: that step failed on the others and was "
        f"applied nowhere; they went on without it and lost {len(failed)} step" in done.stdout
    )
    assert f"healed from a live peer and took part from step {healed['step']}, " in done.stdout
    ended = f"all 2 replica groups ended at step {last['0']['step']}, with the same parameters, to the bit"
    assert ended in done.stdout
    assert (run / "fault_tolerance.png").stat().st_size > 10_000
    assert (run / "checkpoints" / "last.ckpt").is_file() and not (run / "group0" / "checkpoints").exists()
    assert sorted(p.name for p in (run / "checkpoints.gc_state" / "last.ckpt").iterdir()) == ["rank0.pt", "rank1.pt"]
    for g in range(2):
        assert "val/loss" in json.loads((run / f"group{g}" / "summary.json").read_text())


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fault_tolerance.kill_group=1"], "fault_tolerance.kill_group and fault_tolerance.kill_at go together"),
        (
            ["fault_tolerance.kill_group=5", "fault_tolerance.kill_at=2"],
            "fault_tolerance.kill_group = 5 is invalid with fault_tolerance.groups = 3; allowed: 0 to 2",
        ),
        (["fault_tolerance.kill_group=1", "fault_tolerance.kill_at=9"], "fault_tolerance.kill_at = 9 is invalid"),
    ],
)
def test_the_apps_demo_options_are_checked(args, message):
    from train import check_demo

    with pytest.raises(ValueError, match=message):
        check_demo(_compose("trainer.max_steps=4", *args))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fault_tolerance.groups=0"], "FaultTolerance: option 'groups' = 0 is invalid; allowed: an integer in [1"),
        (
            ["sync=diloco", "sync.inner_steps=4", "sync.fragments=2", "sync.overlap_steps=3", "trainer.devices=1"],
            "fault_tolerance with DiLoCo: option 'overlap_steps' = 3 is invalid with inner_steps = 4 and fragments = "
            "2; allowed: 0 to 2 (one round at a time",
        ),
        (
            ["sync=diloco", "sync.inner_steps=4", "sync.fragments=auto", "sync.overlap_steps=1"],
            "fault_tolerance with DiLoCo: option 'fragments' = 'auto' is not supported; allowed: a number of",
        ),
        (["trainer.num_nodes=2"], "fault_tolerance with trainer.num_nodes = 2 is not supported; allowed: 1"),
        (["speedup.baseline_steps=10"], "switch_components (a baseline phase, a Pufferfish conversion) is not supp"),
        (["fusion=auto"], "fault_tolerance: fusion = 'auto' is invalid"),
        (["trainer.hierarchy=node"], "fault_tolerance with hierarchy = NodeHierarchy"),
    ],
)
def test_the_app_refuses_what_fault_tolerance_cannot_serve(args, message):
    """Each refusal names the one option that is wrong; the app's checks include the library's."""
    from train import check_app

    cfg = _compose("fault_tolerance.lighthouse=http://127.0.0.1:1", *args)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_app(cfg)


def test_the_readme_and_the_docs_give_the_same_demo():
    start = "python train.py fault_tolerance.lighthouse=local"
    pages = ("README.md", "docs/fault_tolerance.md", "docs/app.md")
    commands = {tuple(command_overrides(ROOT / page, start)) for page in pages}
    assert len(commands) == 1 and "fault_tolerance.kill_group=2" in next(iter(commands))


@pytest.mark.parametrize("sync", [[], ["sync=diloco", "sync.inner_steps=4"]], ids=["every_step", "diloco"])
def test_the_app_takes_fault_tolerance_for_groups_that_shard_their_model(sync):
    from train import check_app

    check_app(_compose("fault_tolerance.lighthouse=http://127.0.0.1:1", "trainer.sharding=fsdp", *sync))


@pytest.mark.parametrize("trainer", ["cpu", "gpu"])
def test_the_documented_cluster_command_passes_the_apps_checks_on_the_default_and_a_gpu_trainer(trainer):
    """docs/fault_tolerance.md's command for one replica group of a cluster, as written, with the
    default trainer (2 CPU ranks: a group of 2) and with ``trainer=gpu`` (every GPU of a node)."""
    from train import check_app, fault_tolerance_of

    overrides = command_overrides(ROOT / "docs" / "fault_tolerance.md", "REPLICA_GROUP_ID=3 python train.py")
    assert "fault_tolerance.lighthouse=http://lighthouse-host:29510" in overrides
    cfg = _compose(*overrides, *([] if trainer == "cpu" else ["trainer=gpu"]))
    check_app(cfg)
    options = fault_tolerance_of(cfg)
    assert (options.replica_group, options.groups, cfg.trainer.devices) == (3, 4, 2 if trainer == "cpu" else -1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fault_tolerance.groups=0"], "fault_tolerance options (fault_tolerance.<name>=...): FaultTolerance: option"),
        (
            ["trainer.sharding=fsdp", "sync=diloco", "sync.inner_steps=2", "sync.fragments=2"],
            "DiLoCo over shards: fragments = 2 and overlap_steps = 0 are invalid",
        ),
    ],
)
def test_a_refused_option_stops_the_app_before_any_group_starts(tmp_path, args, message):
    done = _app(tmp_path, "fault_tolerance.lighthouse=local", "trainer.max_steps=4", *args)
    assert done.returncode == 2 and f"error: {message}" in done.stderr, done.stderr[-2000:]
    assert "lighthouse http" not in done.stdout and not (tmp_path / "run").exists()


def test_a_lighthouse_that_refuses_connections_ends_the_app_with_its_error_line(tmp_path):
    done = _app(tmp_path, "fault_tolerance.lighthouse=http://localhost:1", "trainer.max_steps=4")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: fault_tolerance: the lighthouse at http://localhost:1 refused the connection" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


def test_without_torchft_the_apps_demo_ends_with_its_error_line_before_any_group_starts(tmp_path):
    """torchft hidden from the app (``None`` in ``sys.modules``, what an environment without it gives)."""
    hide = "import runpy, sys; sys.modules['torchft'] = None; sys.argv = sys.argv[1:]; "
    hide += "runpy.run_path(sys.argv[0], run_name='__main__')"
    command = [sys.executable, "-c", hide, str(ROOT / "train.py"), "fault_tolerance.lighthouse=local"]
    command += ["trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run(command, cwd=tmp_path, env=group_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert 'error: fault_tolerance needs torchft (torch >= 2.7), which is not installed: pip install -e ".[ft]"' in (
        done.stderr
    )
    assert "lighthouse http" not in done.stdout and not (tmp_path / "run").exists()
