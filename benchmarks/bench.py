"""Benchmark harness: measured step times of gc_fused configurations against DDP and its compression
hooks, on loopback or an emulated network, as a table, CSV, charts and a W&B run.

    python benchmarks/bench.py                     # the default configurations on loopback
    python benchmarks/bench.py net.rate=1gbit      # ranks in network namespaces on a 1 Gbit/s link (root)
    python benchmarks/bench.py world_size=4 nodes=2 net.rate=1gbit   # 2 emulated nodes x 2 ranks
    python benchmarks/bench.py 'configs=[ddp,gc_fused:compressor=topk,memory=residual,density=0.01]' rounds=5

Every configuration runs ``steps`` measured steps after ``warmup`` steps, in fresh processes (one
per rank; see ``benchmarks/bench_worker.py``), and the configurations are interleaved round by round
(A B C ... A B C ...) so that machine noise hits all alike; medians pool all rounds. The ranks form
``nodes`` emulated nodes of ``world_size / nodes`` ranks (default: one rank per node); with
``net.rate`` each node is a network namespace whose link to the others is shaped
(``benchmarks/netns.py``), and the report counts the bytes that left each node, per step. A configuration
that fails or hangs is reported as such and the others go on. Outputs, in the Hydra run directory:
``results.md`` (also printed), ``results.csv``, ``speedup.png`` (speedup vs ``ddp``),
``breakdown.png`` (one rank computing alone / what the ranks lose by sharing the machine / what
synchronous ranks cost before exchanging anything / encode+decode / exposed communication and the
rest), the W&B run
(offline unless ``logger=wandb_online``) and ``logs/`` (each rank's output).

Fault tolerance (replica groups under torchft's lighthouse, a group killed and started again) runs on
the same emulated network from ``benchmarks/fault_tolerance.py``.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from bench_worker import ALONE, BASELINES, IDEALS, parse_config, ranks, strategy_class
from hydra.core.hydra_config import HydraConfig
from netns import check_can_emulate, emulated_network, loopback
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[1]
PEER_GRACE_S = 10.0  # after a rank fails, how long its peers get to exit on their own
COLUMNS = [
    "configuration",
    "status",
    "median step (s)",
    "samples/s",
    "bytes sent / step",
    "bytes across nodes / step",
    "final loss",
    *(f"step / {ideal}" for ideal in IDEALS),
    *(f"speedup vs {b}" for b in BASELINES if b not in IDEALS),
]


def validate(cfg: DictConfig) -> None:
    """Every configuration and setting is checked before any process starts."""
    for name, value in (("world_size", cfg.world_size), ("rounds", cfg.rounds), ("steps", cfg.steps)):
        if not isinstance(value, int) or value < (2 if name == "world_size" else 1):
            raise ValueError(
                f"{name} = {value!r} is invalid; allowed: an integer >= {2 if name == 'world_size' else 1}"
            )
    if not isinstance(cfg.nodes, int) or cfg.nodes < 1 or cfg.world_size % cfg.nodes:
        raise ValueError(
            f"nodes = {cfg.nodes!r} is invalid with world_size = {cfg.world_size}; allowed: a positive integer "
            "that divides world_size (each node holds world_size / nodes ranks)"
        )
    if not isinstance(cfg.warmup, int) or cfg.warmup < 0:
        raise ValueError(f"warmup = {cfg.warmup!r} is invalid; allowed: an integer >= 0")
    if len(set(cfg.configs)) != len(cfg.configs) or not cfg.configs:
        raise ValueError(f"configs = {list(cfg.configs)} must be a non-empty list without repeats")
    for name in cfg.configs:
        options = parse_config(name)
        if name not in BASELINES:
            strategy_class(name)(**options)  # names, options and values checked here
    if cfg.net.rate:
        check_can_emulate(cfg.net.rate)


def run_config(
    name: str, cfg: DictConfig, config_file: Path, network: list, port: int, out: Path, tag: str
) -> dict[str, Any]:
    """One configuration once: its ranks as processes, each in its node's ``network``. Returns rank
    0's summary, with the bytes that crossed node boundaries per measured step when the links are
    shaped, or ``{"failed": why}``."""
    rank_count = ranks(name, cfg.world_size)
    results = [out / "runs" / (f"{tag}.json" if r == 0 else f"{tag}-rank{r}.json") for r in range(rank_count)]
    logs = [out / "logs" / f"{tag}-rank{r}.log" for r in range(rank_count)]
    worker = [str(ROOT / "benchmarks" / "bench_worker.py"), str(config_file), name]
    arguments = [[*worker, str(path)] for path in results]
    per_node = cfg.world_size // cfg.nodes
    why = run_ranks(arguments, network, per_node, port, cfg.threads_per_rank, logs, cfg.timeout_s, name not in ALONE)
    if why is not None:
        return {"failed": why}
    if not results[0].is_file():
        return {"failed": f"rank 0 wrote no result: {failure_reason(logs[0])[:300]}"}
    per_rank = [json.loads(path.read_text()) for path in results]
    summary = per_rank[0]
    if cfg.net.rate:  # one rank per node counts its node's interface
        leaving = [r["node_sent_bytes"] for r in per_rank if r["local_rank"] == 0]
        summary["bytes_across_nodes_per_step"] = sum(leaving) / cfg.steps
    return summary


def run_ranks(
    arguments: list[list[str]],
    network: list,
    per_node: int,
    port: int,
    threads: int,
    logs: list[Path],
    timeout_s: float,
    distributed: bool = True,
) -> str | None:
    """Run ``python *arguments[r]`` for every rank ``r`` (see :func:`start_ranks`) to the end; None
    when every rank exited cleanly, else why not."""
    processes = start_ranks(arguments, network, per_node, port, threads, logs, distributed)
    try:
        if not wait_for_ranks(processes, timeout_s):
            return f"timed out after {timeout_s} s"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    failed = [r for r, process in enumerate(processes) if process.returncode != 0]
    if not failed:
        return None
    on_their_own = [r for r in failed if processes[r].returncode != -signal.SIGKILL]
    reasons = [(r, failure_reason(logs[r])) for r in on_their_own or failed]
    # a rank that lost its peer only reports the peer's failure: prefer the peer's own error
    rank, reason = next(
        ((r, why) for r, why in reasons if not re.search(r"Connection (reset|closed)", why)), reasons[0]
    )
    return f"rank {rank} exited with {processes[rank].returncode}: {reason[:300]}"


def start_ranks(
    arguments: list[list[str]],
    network: list,
    per_node: int,
    port: int,
    threads: int,
    logs: list[Path],
    distributed: bool = True,
) -> list[subprocess.Popen]:
    """Start one Python process per rank, ``python *arguments[r]``, rank ``r`` in node
    ``r // per_node`` of ``network``, with the rendezvous in its environment (``distributed``) and
    its output in ``logs[r]``."""
    processes = []
    for r, args in enumerate(arguments):
        node = network[r // per_node]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": str(ROOT),
            "GLOO_SOCKET_IFNAME": node.interface,
        }
        if distributed:
            env.update(
                MASTER_ADDR=network[0].address,
                MASTER_PORT=str(port),
                NODE_RANK=str(r // per_node),
                WORLD_SIZE=str(len(arguments)),
                LOCAL_RANK=str(r % per_node),
            )
        with open(logs[r], "w") as log:
            processes.append(
                subprocess.Popen(
                    [*node.command, sys.executable, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                )
            )
    return processes


def wait_for_ranks(processes: list[subprocess.Popen], timeout_s: float) -> bool:
    """Wait until every rank has exited (True) or ``timeout_s`` has passed (False). Once a rank has
    failed, its peers, which would wait on it in their next collective for ever, get
    ``PEER_GRACE_S`` to exit on their own (True after it; the caller kills what still runs)."""
    deadline = time.monotonic() + timeout_s
    while None in (codes := [process.poll() for process in processes]):
        failed = any(code not in (None, 0) for code in codes)
        if failed:
            deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
        if time.monotonic() > deadline:
            return failed
        time.sleep(0.1)
    return True


def failure_reason(log: Path) -> str:
    """The last line of a rank's output that reports an error (or its last line)."""
    lines = log.read_text(errors="replace").strip().splitlines() or ["no output"]
    marked = [line for line in lines if re.search(r"error|what\(\)|exception", line, re.IGNORECASE)]
    return (marked or lines)[-1].strip()


def aggregate(cfg: DictConfig, runs: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """One row per configuration: pooled median, throughput, bytes, ratios to the baselines."""
    medians: dict[str, float] = {}
    rows = []
    for name, results in runs.items():
        ok = [r for r in results if "failed" not in r]
        row: dict[str, Any] = {"configuration": name}
        if not ok:
            row["status"] = results[0]["failed"]
        else:
            times = [t for r in ok for t in r["step_times_s"]]
            medians[name] = statistics.median(times)
            failures = len(results) - len(ok)
            first_failure = next((r["failed"] for r in results if "failed" in r), "")
            row["status"] = (
                "ok" if not failures else f"ok in {len(ok)}/{len(results)} rounds; otherwise {first_failure}"
            )
            row["median step (s)"] = medians[name]
            row["samples/s"] = cfg.data.batch_size * ok[0]["ranks"] / medians[name]
            for column, key in (
                ("bytes sent / step", "sent_bytes_per_step"),
                ("bytes across nodes / step", "bytes_across_nodes_per_step"),
            ):  # means over steps (and rounds): whole bytes are enough
                values = [r[key] for r in ok if r.get(key) is not None]
                row[column] = round(statistics.mean(values)) if values else None
            row["encode+decode (s)"] = (ok[0].get("breakdown") or {}).get("encode+decode", 0.0)
            losses = [r["final_loss"] for r in ok if r.get("final_loss") is not None]
            row["final loss"] = statistics.mean(losses) if losses else None
        rows.append(row)
    for row in rows:
        median = medians.get(row["configuration"])
        if median is None:
            continue
        for baseline in (b for b in BASELINES if b in medians):
            if baseline in IDEALS:
                row[f"step / {baseline}"] = median / medians[baseline]
            else:
                row[f"speedup vs {baseline}"] = medians[baseline] / median
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3f}" if value < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def write_outputs(cfg: DictConfig, rows: list[dict[str, Any]], out: Path) -> str:
    per_node = cfg.world_size // cfg.nodes
    link = f"{cfg.net.rate} per {'rank' if per_node == 1 else 'node'} (netns + tc tbf)" if cfg.net.rate else "loopback"
    stem = "CIFAR 3x3" if cfg.model.get("cifar_stem") else "standard"
    header = (
        f"{cfg.model.get('arch', cfg.model.recipe)} ({stem} stem), batch {cfg.data.batch_size} per rank, "
        f"{cfg.nodes} node(s) x {per_node} CPU rank(s) x {cfg.threads_per_rank} thread, {link}; {cfg.rounds} rounds x "
        f"{cfg.steps} measured steps after {cfg.warmup}, interleaved; medians over all rounds"
    )
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += ["| " + " | ".join(_cell(row.get(c)) for c in COLUMNS) + " |" for row in rows]
    markdown = header + "\n\n" + "\n".join(table) + "\n"
    (out / "results.md").write_text(markdown)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS + ["encode+decode (s)"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out, header)
    return markdown


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [row for row in rows if "median step (s)" in row]
    names = [row["configuration"].replace("gc_fused:", "gc_fused\n").replace(",", ",\n") for row in ran]
    figure, axis = plt.subplots(figsize=(max(6, 1.4 * len(ran)), 5))
    speedups = [row.get("speedup vs ddp", float("nan")) for row in ran]
    axis.bar(names, speedups, color=["#888888" if row["configuration"] in BASELINES else "#2a7ab9" for row in ran])
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_ylabel("speedup vs ddp (step time ratio)")
    axis.set_title(title, fontsize=8, wrap=True)
    axis.tick_params(axis="x", labelsize=7)
    figure.tight_layout()
    figure.savefig(out / "speedup.png", dpi=120)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(max(6, 1.4 * len(ran)), 5))
    parts = breakdown(ran)
    bottom = [0.0] * len(ran)
    for label, values in parts.items():
        axis.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    axis.set_ylabel("median step time (s)")
    axis.set_title(
        "step-time breakdown\n(from the compute, compute-parallel and ddp+no-comm configurations "
        "and the synchroniser's telemetry)",
        fontsize=9,
        wrap=True,
    )
    axis.legend(fontsize=8)
    axis.tick_params(axis="x", labelsize=7)
    figure.tight_layout()
    figure.savefig(out / "breakdown.png", dpi=120)
    plt.close(figure)


def breakdown(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each row's median step split into stacked parts: one rank computing alone (``compute``), what
    the ranks lose by sharing the machine (``compute-parallel`` minus ``compute``), what synchronous
    ranks cost before any gradient is exchanged (``ddp+no-comm`` minus ``compute-parallel``: copies
    into buckets, running in step), the synchroniser's encode+decode, and the rest (exposed
    communication, waiting, bookkeeping). A part without its baseline in ``rows`` is 0; no part
    exceeds what is left of the step."""
    ideal = {row["configuration"]: row["median step (s)"] for row in rows if row["configuration"] in IDEALS}
    parts: dict[str, list[float]] = {
        "compute (one rank alone)": [],
        "ranks sharing the machine": [],
        "ranks in step, no communication": [],
        "encode+decode": [],
        "exposed communication and the rest": [],
    }
    for row in rows:
        step, levels = row["median step (s)"], [0.0]
        for name in IDEALS:  # each ideal bounds the step from below, and each includes the one before
            levels.append(min(step, max(levels[-1], ideal.get(name, 0.0))))
        codec = min(row.get("encode+decode (s)", 0.0), step - levels[-1])
        values = [high - low for low, high in zip(levels, levels[1:])] + [codec, step - levels[-1] - codec]
        for label, value in zip(parts, values):
            parts[label].append(value)
    return parts


def log_to_wandb(cfg: DictConfig, rows: list[dict[str, Any]], out: Path) -> str | None:
    if cfg.logger.kind != "wandb":
        return None
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=cfg.logger.project,
        mode=cfg.logger.mode,
        dir=str(out),
        name="bench",
        config=OmegaConf.to_container(cfg, resolve=True),
        job_type="benchmark",
    )
    run.log(
        {
            "bench/results": wandb.Table(columns=COLUMNS, data=[[_cell(row.get(c)) for c in COLUMNS] for row in rows]),
            "bench/speedup": wandb.Image(str(out / "speedup.png")),
            "bench/breakdown": wandb.Image(str(out / "breakdown.png")),
        }
    )
    directory = run.dir
    run.finish()
    return directory


def benchmark(cfg: DictConfig, out: Path) -> list[dict[str, Any]]:
    validate(cfg)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    config_file = out / "bench_config.yaml"
    OmegaConf.save(cfg, config_file, resolve=True)
    runs: dict[str, list[dict]] = {name: [] for name in cfg.configs}
    network = (
        emulated_network(cfg.nodes, cfg.net.rate, cfg.net.burst, cfg.net.latency)
        if cfg.net.rate
        else loopback(cfg.nodes)
    )
    port = 29400 + os.getpid() % 500
    with network as links:
        for round_index in range(cfg.rounds):
            for index, name in enumerate(cfg.configs):
                port += 1
                tag = f"r{round_index}-c{index}"
                started = time.monotonic()
                result = run_config(name, cfg, config_file, links, port, out, tag)
                state = result.get("failed") or f"median {result['step_time_s']:.3f} s"
                print(
                    f"[round {round_index + 1}/{cfg.rounds}] {name}: {state} ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
                runs[name].append(result)
    return aggregate(cfg, runs)


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the network is torn down on kill
    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        rows = benchmark(cfg, out)
    except (ValueError, PermissionError, FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    markdown = write_outputs(cfg, rows, out)
    print("\n" + markdown)
    directory = log_to_wandb(cfg, rows, out)
    print(
        f"results: {out / 'results.md'}, {out / 'results.csv'}, {out / 'speedup.png'}, {out / 'breakdown.png'}"
        + (f"\nW&B run: {Path(directory).parent}" if directory else "")
    )


if __name__ == "__main__":
    main()
