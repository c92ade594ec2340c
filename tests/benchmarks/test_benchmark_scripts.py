"""The benchmark scripts refuse bad counts and devices with argparse errors before any work."""

import json
import os
import re
import runpy
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from locations import ROOT

BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from cli import integer_at_least  # noqa: E402


def _run(script: str, monkeypatch, capsys, *args: str) -> str:
    """Run a script as ``python benchmarks/SCRIPT ARGS`` in this process; return what argparse wrote
    to stderr when it refused the arguments (exit status 2)."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_integer_at_least_parses_and_names_what_is_allowed():
    parse = integer_at_least(1)
    assert parse("3") == 3
    for text, message in (("0", "0 is invalid; allowed: an integer >= 1"), ("2.5", "'2.5' is not an integer")):
        with pytest.raises(Exception, match=message):
            parse(text)


@pytest.mark.parametrize(
    "script,option",
    [
        ("compression_costs.py", "--runs"),
        ("convergence_digits.py", "--epochs"),
        ("fusion_auto.py", "--rounds"),
        ("powersgd_costs.py", "--steps"),
        ("pufferfish_layers.py", "--batch"),
        ("sidco_estimators.py", "--repeats"),
        ("quantizer_variance.py", "--samples"),
        ("checkpoint_memory.py", "--world-sizes"),
        ("cpu_paths.py", "--repeats"),
        ("step_overhead.py", "--rounds"),
        ("overlap_cost.py", "--runs"),
        ("op_census.py", "--steps"),
        ("kernel_variants.py", "--repeats"),
        ("fault_tolerance.py", "--rounds"),
        ("fault_chaos.py", "--count"),
        ("fault_tolerance_sharded.py", "--rounds"),
    ],
)
def test_a_zero_count_is_an_argparse_error(script, option, monkeypatch, capsys):
    assert f"argument {option}: 0 is invalid; allowed: an integer >= 1" in _run(
        script, monkeypatch, capsys, option, "0"
    )


@pytest.mark.parametrize(
    "script", ["compression_costs.py", "sidco_estimators.py", "step_overhead.py", "kernel_variants.py"]
)
def test_a_bad_or_missing_device_is_an_argparse_error(script, monkeypatch, capsys):
    assert "argument --device: 'tpu' is invalid; allowed: cuda, cpu" in _run(
        script, monkeypatch, capsys, "--device", "tpu"
    )
    if not torch.cuda.is_available():
        assert "argument --device: no CUDA device is available here" in _run(
            script, monkeypatch, capsys, "--device", "cuda"
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--configs", "ddp", "--target", "1.5"], "--target 1.5 is invalid; allowed: a number in (0, 1]"),
        (["--configs", "ddp", "ddp"], "repeats a configuration"),
        (["--configs", "ddp+fp16"], "'ddp+fp16' is invalid; allowed: ddp, or gc_fused"),
        (["--configs", "gc_fused:sync=diloco"], "DiLoCo needs option 'inner_steps'"),
        (["--configs", "ddp", "--eval-every", "0"], "0 is invalid; allowed: an integer >= 1"),
    ],
)
def test_time_to_accuracy_refuses_bad_settings_before_any_run(args, message, monkeypatch, capsys):
    assert message in _run("time_to_accuracy.py", monkeypatch, capsys, "--rate", "none", *args)


def test_the_fault_tolerance_benchmark_refuses_an_entry_it_cannot_build(monkeypatch, capsys):
    err = _run("fault_tolerance.py", monkeypatch, capsys, "--compressors", "topk+bogus")
    assert "argument --compressors: 'topk+bogus' is invalid" in err and "allowed: [diloco:]COMPRESSOR[+MEMORY]" in err


@pytest.mark.slow
def test_the_fault_tolerance_benchmark_reports_the_cost_and_a_failure_on_loopback():
    """Two groups on loopback, two blocks per mode, then the failure run (group 1 killed at step 2
    and started again): the row of the cost per step, the survivor's lost steps and stall, the
    restarted group's healing, and every group's parameters equal at the end."""
    pytest.importorskip("torchft")
    options = ["--groups", "2", "--rounds", "1", "--steps", "2", "--warmup", "1", "--kill-at", "2"]
    done = subprocess.run(
        [sys.executable, "fault_tolerance.py", *options, "--compressors", "topk+residual"],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| topk+residual |"))
    plain, ft = (float(cell) for cell in row.split("|")[2:4])
    assert plain > 0 and ft > 0
    assert "- group 0: " in done.stdout and "step(s) not committed; stall" in done.stdout
    assert "- group 1 restarted: " in done.stdout
    assert "parameters equal on every group at the end: True" in done.stdout


@pytest.mark.slow
def test_the_sharded_fault_tolerance_benchmark_reports_the_cost_on_loopback():
    """Two groups of two ranks on loopback, two blocks per mode: the row of the cost per step, each
    mode's time positive (the ``ft`` blocks all committed with both groups: none would leave no
    median) and the runs' ratios."""
    pytest.importorskip("torchft")
    options = ["--rounds", "1", "--steps", "2", "--warmup", "1", "--compressors", "topk+residual"]
    done = subprocess.run(
        [sys.executable, "fault_tolerance_sharded.py", *options],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 groups of 2 ranks (FSDP2), loopback" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("| topk+residual |"))
    plain, ft = (float(cell) for cell in row.split("|")[2:4])
    assert plain > 0 and ft > 0
    assert "per run (ft / plain, control / plain): " in done.stdout


@pytest.mark.slow
def test_time_to_accuracy_reports_every_configuration_on_loopback(tmp_path):
    """Two configurations, one epoch each, on loopback: a row per configuration with its accuracy,
    measurements every 5 steps against growing training time, and the plot."""

    configs = ["ddp", "gc_fused:sync=diloco,inner_steps=5,vectors=fp32"]
    done = subprocess.run(
        [
            sys.executable,
            "time_to_accuracy.py",
            "--rate",
            "none",
            "--epochs",
            "1",
            "--eval-every",
            "5",
            "--hidden",
            "64",
            "--target",
            "0.3",
            "--out",
            str(tmp_path),
            "--configs",
            *configs,
        ],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "results.md").read_text()
    for name in configs:
        assert f"| {name} |" in table
    runs = json.loads((tmp_path / "runs.json").read_text())
    for name in configs:
        assert "failed" not in runs[name][0], runs[name][0]
        points = runs[name][0]["points"]
        assert [p["step"] for p in points] == [5, 10, 15, 20, 23]  # 719 samples per rank, batch 32
        times = [p["train_s"] for p in points]
        assert times == sorted(times) and times[0] > 0
        assert 0 <= points[-1]["accuracy"] <= 1 and runs[name][0]["sent_bytes"] > 0
    assert (tmp_path / "accuracy.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--configs", "ddp"], "--configs: 'ddp' is invalid; allowed: ddp+powersgd, topk+residual"),
        (["--configs", "diloco", "diloco"], "repeats a configuration"),
        (["--max-factor", "0.5"], "--max-factor 0.5 is invalid; allowed: a number >= 1"),
        (["--eval-every", "15"], "--eval-every 15 is invalid; allowed: a multiple of DiLoCo's 10"),
        (["--steps", "30"], "--steps 30 is invalid; allowed: a multiple of --eval-every (20)"),
        (["--width", "30"], "--width 30 is invalid with --heads 4; allowed: a multiple of it"),
        (["--nodes", "1"], "1 is invalid; allowed: an integer >= 2"),
    ],
)
def test_time_to_perplexity_refuses_bad_settings_before_any_run(args, message, monkeypatch, capsys):
    assert message in _run("time_to_perplexity.py", monkeypatch, capsys, "--rate", "none", *args)


@pytest.mark.slow
def test_time_to_perplexity_trains_to_ddps_loss_and_reports_it_on_loopback(tmp_path):
    """2 nodes of 2 ranks on loopback, a small GPT: ddp trains its 20 steps and sets the target; the
    others train at least as many, and stop at the first validation that reaches it or at twice as
    many; the control repeats ddp (same seed: the same losses); the table and the plot."""
    configs = ["topk+residual", "diloco"]
    options = ["--rate", "none", "--steps", "20", "--eval-every", "10", "--width", "32", "--val-tokens", "2048"]
    done = subprocess.run(
        [sys.executable, "time_to_perplexity.py", *options, "--out", str(tmp_path), "--configs", *configs],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = json.loads((tmp_path / "runs.json").read_text())
    ddp = runs["ddp"][0]
    assert [p["step"] for p in ddp["points"]] == [10, 20] and ddp["sent_bytes"] > 0
    target = ddp["points"][-1]["val_loss"]
    assert [p["val_loss"] for p in runs["ddp (control)"][0]["points"]] == pytest.approx(
        [p["val_loss"] for p in ddp["points"]], rel=1e-5
    )
    for name in configs:
        points = runs[name][0]["points"]
        steps = [p["step"] for p in points]
        assert steps[:2] == [10, 20] and steps[-1] <= 40 and steps == list(range(10, steps[-1] + 1, 10))
        reached = [p["step"] >= 20 and p["val_loss"] <= target for p in points]
        assert not any(reached[:-1]) and (reached[-1] or steps[-1] == 40)  # stopped at the first, or at the cap
        times = [p["train_s"] for p in points]
        assert times == sorted(times) and times[0] > 0
    table = (tmp_path / "results.md").read_text()
    assert f"| time to loss {target:.4f} (s) |" in table
    for name in ["ddp", *configs, "ddp (control)"]:
        assert f"| {name} |" in table
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_a_layout_without_a_link_inside_the_node_is_an_argparse_error(monkeypatch, capsys):
    assert "argument --layouts: '2x1' is invalid; allowed: NODESxRANKS" in _run(
        "overlap_cost.py", monkeypatch, capsys, "--layouts", "2x1"
    )


def test_the_overlap_cost_times_each_collective_beside_the_step():
    done = subprocess.run(
        [sys.executable, "overlap_cost.py", "--layouts", "1x2", "--megabytes", "4", "--batch", "2", "--runs", "1"],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| 1 x 2 |")]
    assert [row[1].strip() for row in rows] == ["reduce", "broadcast", "allreduce"]
    for row in rows:
        step, collective, beside, lost = (float(cell) for cell in row[2:6])
        assert step > 0 and collective > 0 and lost == pytest.approx(beside - step, abs=1.5e-3)


def test_the_op_census_counts_one_copy_per_tensor_for_none_and_the_waits_of_a_host_read(monkeypatch):
    """``none`` adds one copy per tensor into its bucket (4 more layers: 8 more ops), and no wait;
    a compressor that reads a value back to the host in its step shows it in the census."""
    import op_census

    from gc_strategy import Compressor, kernels

    added = []
    with kernels.forced("torch"):
        for layers in (4, 8):
            model, loss = op_census.mlp(layers)
            plain, _, _ = op_census.census(model, loss, None, 1)
            ops, waits, buckets = op_census.census(model, loss, "none", 1)
            added.append(ops - plain)
            assert waits == {} and buckets == 1
        original = Compressor.begin_step

        def reading(self, step):
            float(torch.ones(1).sum())
            original(self, step)

        monkeypatch.setattr(Compressor, "begin_step", reading)
        _, waits, _ = op_census.census(*op_census.mlp(4), "fp16", 1)
    assert added[1] - added[0] == 8
    assert waits.get("_local_scalar_dense", 0) >= 1


def test_a_buckets_work_on_the_accelerators_path_does_not_grow_with_its_tensors():
    """Every compressor, its usual memory, along the accelerator's code path: an MLP of 12 layers
    launches, per bucket, as many ops beyond the one copy per tensor as one of 4 layers (both
    sizes leave a short last chunk for the chunked quantizers, whose tail costs a few ops)."""
    import op_census

    from gc_strategy import COMPRESSORS, kernels

    grown = {}
    with kernels.forced("torch"):
        for name in COMPRESSORS.names():
            per_bucket = []
            for layers in (4, 12):
                model, loss = op_census.mlp(layers)
                plain, _, _ = op_census.census(model, loss, None, 1)
                ops, _, buckets = op_census.census(model, loss, name, 2)
                per_bucket.append((ops - plain - 2 * layers) / buckets)
            if per_bucket[0] != per_bucket[1]:
                grown[name] = per_bucket
    assert not grown, grown


def test_every_compressor_keeps_to_its_launch_budget_on_resnet50():
    """Along the accelerator's code path, on torchvision's ResNet-50 (161 tensors, 5 buckets of
    25 MB), each compressor with its usual memory: ``none`` adds at most 200 kernel launches to
    plain backward, every other compressor at most 150 more than ``none``, PowerSGD and ACP-SGD at
    most 300 more; and none makes the host wait."""
    import op_census
    from compression_costs import model_and_loss

    from gc_strategy import COMPRESSORS, kernels

    over = {}
    with kernels.forced("torch"):
        model, loss = model_and_loss("resnet50", batch=2, image_size=32, device=torch.device("cpu"))
        plain = op_census.census(model, loss, None, 1)[0]
        added = {}
        for name in ["none", *[n for n in COMPRESSORS.names() if n != "none"]]:
            ops, waits, _ = op_census.census(model, loss, name, 1)
            added[name] = ops - plain
            budget = 200 if name == "none" else added["none"] + (300 if name in ("powersgd", "acpsgd") else 150)
            if added[name] > budget or waits:
                over[name] = (added[name], budget, dict(waits))
    assert not over, over


#: the environment as collected, before any test ran, without rendezvous variables
ONE_PROCESS_ENV = {
    key: value
    for key, value in os.environ.items()
    if key not in {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GLOO_SOCKET_IFNAME"}
}


def test_the_step_overhead_times_torch_s_hooks_and_bf16_autocast_beside_the_synchroniser():
    """Under bf16 autocast on the CPU, DDP with torch's fp16, bf16 and PowerSGD hooks and a
    compressor each get a row with a step time, beside plain training."""
    configs = ["plain", "ddp fp16 hook", "ddp bf16 hook", "ddp powerSGD hook rank 4"]
    done = subprocess.run(
        [sys.executable, "step_overhead.py", "--device", "cpu", "--model", "resnet18", "--image-size", "16"]
        + ["--batch", "2", "--rounds", "1", "--steps", "1", "--warmup", "3", "--autocast", "bf16"]
        + ["--configs", *configs, "--compressors", "topk+residual"],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=240,
        env=ONE_PROCESS_ENV,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "autocast bf16" in done.stdout
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for name in [*configs, "gc topk+residual"]:
        assert float(rows[name].split("|")[2]) > 0, rows


def test_the_step_overhead_stopped_by_sigterm_reports_the_rounds_it_completed():
    """``timeout``'s SIGTERM in the rounds: the table of the rounds done is printed, the one under
    way left out (a part of the GPU check cut at its limit keeps its measurement)."""
    process = subprocess.Popen(
        [sys.executable, "step_overhead.py", "--device", "cpu", "--model", "resnet18", "--image-size", "16"]
        + ["--batch", "2", "--rounds", "100000", "--steps", "1", "--warmup", "1", "--configs", "plain", "ddp"],
        cwd=BENCHMARKS,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ONE_PROCESS_ENV,
    )
    lines: list[str] = []
    warmed = threading.Event()

    def read_stderr() -> None:
        for line in process.stderr:
            lines.append(line)
            if "warmed up" in line:
                warmed.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert warmed.wait(timeout=120), "".join(lines)[-3000:]
        time.sleep(2)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)  # its table is printed at the end: well within a pipe's buffer
        stdout = process.stdout.read()
        reader.join(timeout=10)
    finally:
        process.kill()
    stderr = "".join(lines)
    assert process.returncode == 0 and "stopped by SIGTERM after" in stderr, stderr[-3000:]
    rounds = int(stderr.split("stopped by SIGTERM after ")[1].split()[0])
    assert rounds >= 1 and f"{rounds} rounds x 1 steps" in stdout
    rows = {line.split("|")[1].strip() for line in stdout.splitlines() if line.startswith("| ")}
    assert {"plain", "ddp"} <= rows


def test_a_density_outside_0_1_is_refused_by_the_kernel_variants(monkeypatch, capsys):
    assert "--density 0.0 is invalid; allowed: a number in (0, 1]" in _run(
        "kernel_variants.py", monkeypatch, capsys, "--density", "0"
    )


def test_the_kernel_variants_agree_and_are_timed_side_by_side_on_the_cpu(monkeypatch):
    """On the CPU the torch and numpy variants of each operation are checked against each other
    and timed (the chunked top-k has only torch's on the CPU); a variant whose output differs
    stops the run, naming it."""
    import kernel_variants

    from gc_strategy.kernels import numpy_ops

    results = kernel_variants.measure(torch.device("cpu"), 4096, 0.01, runs=1, repeats=1)
    assert len(results) == 5
    for op, times in results.items():
        assert set(times) == ({"torch"} if op.startswith("chunk_top_k") else {"torch", "numpy"}), op
    rows = kernel_variants.table(results).splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == list(results)
    assert all(row.split("|")[-2].strip() in ("torch", "numpy") for row in rows)
    monkeypatch.setattr(numpy_ops, "pack_bits", lambda codes, bits: torch.zeros(codes.numel() // 8, dtype=torch.uint8))
    with pytest.raises(SystemExit, match="pack_signs: the numpy variant's output differs"):
        kernel_variants.measure(torch.device("cpu"), 4096, 0.01, runs=1, repeats=1)


def test_the_exposed_time_is_the_difference_of_medians_and_its_range_is_per_round():
    """Two rounds: plain takes 10 and 20 ms, a configuration 15 and 21 ms: exposed 3 ms (medians
    18 against 15), per round 5 and 1 ms."""
    from step_overhead import exposure_table

    times = {"plain": [[0.010, 0.010], [0.020, 0.020]], "gc x": [[0.015, 0.015], [0.021, 0.021]]}
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in exposure_table(times).splitlines()[2:]}
    assert [cell.strip() for cell in rows["gc x"]] == ["18.00", "1.200", "3.00", "1.00 to 5.00"]
    assert [cell.strip() for cell in rows["plain"]] == ["15.00", "1.000", "0.00", "0.00 to 0.00"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_the_chaos_benchmark_strikes_a_fault_and_reports_its_cost():
    """One hang of the last of three groups on emulated nodes: its row (a stall within
    ``silence_s`` + 1 s) and every group's parameters equal at the end. The lighthouse's join
    timeout exceeds a step on a loaded machine, so that no group is left out of the quorums while
    alive (they would rotate, two at a time, and never settle with all three)."""
    pytest.importorskip("torchft")
    options = ["--count", "1", "--faults", "hang", "--silence-s", "2", "--join-timeout-ms", "5000"]
    done = subprocess.run(
        [sys.executable, "fault_chaos.py", *options], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| hang | 1 |"))
    median, worst = (float(cell) for cell in row.split("|")[3:5])
    assert median == worst < 2 + 1
    assert "every group ended with the same parameters: True (3 digests)" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_the_chaos_benchmark_kills_a_diloco_group_and_the_survivors_lose_no_inner_step():
    """DiLoCo (``inner_steps=3``) on three emulated nodes, one kill of the last group at a moment
    drawn within an inner phase: its row says no inner step lost, and every group ended with the
    same outer parameters."""
    pytest.importorskip("torchft")
    options = ["--count", "1", "--faults", "kill", "--compressor", "diloco:topk+residual", "--inner-steps", "3"]
    options += ["--join-timeout-ms", "5000"]
    done = subprocess.run(
        [sys.executable, "fault_chaos.py", *options], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| kill | 1 |"))
    assert row.split("|")[5].strip() == "0, 0", row
    assert "every group ended with the same parameters: True (3 digests)" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_the_chaos_benchmark_kills_a_rank_of_a_sharded_group():
    """Two groups of two ranks (FSDP2 over each group's ranks, one torchrun per group) on emulated
    nodes, one rank of the last group killed at a moment drawn within a step: the survivor lost at
    most one step, and each rank's shards ended equal across the groups."""
    pytest.importorskip("torchft")
    options = ["--count", "1", "--faults", "kill", "--groups", "2", "--ranks", "2"]
    done = subprocess.run(
        [sys.executable, "fault_chaos.py", *options], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 groups of 2 ranks (FSDP2)" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("| kill | 1 |"))
    assert int(row.split("|")[5].split(",")[1]) <= 1, row
    assert "every group ended with the same parameters: True (4 digests)" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_heal_benchmark_measures_a_restarted_groups_transfer(ranks):
    """A small MLP (2 layers of 256) on two emulated nodes: the restarted group receives at least
    its parameters' bytes, and the survivor's steps before and after are reported. Sharded over 2
    ranks (FSDP2), each rank receives its shard: less than the parameters, and the two together at
    least all of them."""
    pytest.importorskip("torchft")
    options = ["--width", "256", "--layers", "2", "--steps", "2", "--rate", "1gbit", "--ranks", str(ranks)]
    done = subprocess.run(
        [sys.executable, "heal_large.py", *options], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    parameters = 2 * (256 * 256 + 256) * 4
    received = re.search(r"state received: [\d.]+ GB \((\d+) bytes\) in [\d.]+ s", done.stdout)
    assert received and int(received[1]) >= parameters
    assert "group 0's steps: before the kill median" in done.stdout
    if ranks > 1:
        shares = [int(n) for n in re.findall(r"rank \d (\d+) bytes in", done.stdout)]
        assert len(shares) == ranks and all(share < parameters for share in shares), done.stdout
