"""The benchmark harness: outputs, failure reporting, network namespaces, bad input."""

import csv
import os
import subprocess
import sys
import time

import pytest
import torch
from locations import ROOT
from omegaconf import OmegaConf

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench  # noqa: E402
import netns  # noqa: E402
from bench_worker import keep_local_gradients, parse_config, strategy_class  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from gc_strategy import DiLoCo, EveryStep, GCFSDPStrategy, NodeHierarchy  # noqa: E402
from gc_strategy.tools.ranks import run_ranks  # noqa: E402


def _bench(tmp_path, *args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_a_short_run_on_loopback_writes_table_csv_charts_and_wandb(tmp_path):
    done = _bench(
        tmp_path,
        'configs=[compute-parallel,ddp+no-comm,ddp,"gc_fused:compressor=fp16"]',
        "rounds=1",
        "steps=3",
        "warmup=1",
        "data.batch_size=4",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run = tmp_path / "run"
    rows = list(csv.DictReader(open(run / "results.csv")))
    assert [r["configuration"] for r in rows] == ["compute-parallel", "ddp+no-comm", "ddp", "gc_fused:compressor=fp16"]
    assert all(r["status"] == "ok" and float(r["median step (s)"]) > 0 for r in rows)
    assert float(rows[2]["bytes sent / step"]) == 2 * float(rows[3]["bytes sent / step"])  # fp32 vs fp16 payload
    assert float(rows[1]["bytes sent / step"]) == 0
    assert float(rows[2]["speedup vs ddp"]) == 1.0 and float(rows[0]["step / compute-parallel"]) == 1.0
    assert float(rows[1]["step / ddp+no-comm"]) == 1.0
    # both ranks of compute-parallel trained (each alone, without a process group): 2 x batch per step
    assert float(rows[0]["samples/s"]) == pytest.approx(2 * 4 / float(rows[0]["median step (s)"]))
    assert len(list((run / "runs").glob("r0-c0*.json"))) == 2
    assert "| ddp | ok |" in (run / "results.md").read_text() and "| ddp | ok |" in done.stdout
    for chart in ("speedup.png", "breakdown.png"):
        assert (run / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wandb_runs = list((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1 and list(wandb_runs[0].glob("files/media/images/bench/*.png"))


def test_a_failing_configuration_is_reported_and_the_others_go_on(tmp_path):
    cfg = OmegaConf.create(
        {
            "world_size": 2,
            "nodes": 2,
            "threads_per_rank": 1,
            "timeout_s": 60,
            "data": {"batch_size": 4},
            "model": {"recipe": "resnet", "arch": "resnet18"},
            "rounds": 1,
            "steps": 1,
            "warmup": 0,
            "net": {"rate": None},
        }
    )
    (tmp_path / "runs").mkdir()
    (tmp_path / "logs").mkdir()
    crash = netns.NodeNetwork(["sh", "-c", "echo 'RuntimeError: boom' >&2; exit 3", "--"], "127.0.0.1", "lo")
    failed = bench.run_config("ddp", cfg, tmp_path / "none.yaml", [crash, crash], 29999, tmp_path, "r0-c0")
    assert failed == {"failed": "rank 0 exited with 3: RuntimeError: boom"}
    fine = {"step_times_s": [0.5, 0.7, 0.6], "ranks": 2, "sent_bytes_per_step": 100.4, "step_time_s": 0.6}
    rows = bench.aggregate(cfg, {"ddp": [failed], "gc_fused:compressor=fp16": [fine]})
    assert rows[0]["status"] == failed["failed"] and "median step (s)" not in rows[0]
    assert rows[1]["status"] == "ok" and rows[1]["median step (s)"] == 0.6 and rows[1]["samples/s"] == 4 * 2 / 0.6
    assert rows[1]["bytes sent / step"] == 100  # a mean over steps, shown in whole bytes
    markdown = bench.write_outputs(OmegaConf.merge(cfg, {"model": {"cifar_stem": False}}), rows, tmp_path)
    assert "| ddp | rank 0 exited with 3: RuntimeError: boom | n/a |" in markdown
    assert (tmp_path / "speedup.png").is_file()


def test_the_breakdown_stacks_compute_sharing_lockstep_codec_and_the_rest_up_to_each_step():
    cfg = OmegaConf.create({"data": {"batch_size": 32}})

    def ran(step, ranks=2, codec=None):
        return [
            {
                "step_times_s": [step],
                "ranks": ranks,
                "step_time_s": step,
                "breakdown": codec and {"encode+decode": codec},
            }
        ]

    rows = bench.aggregate(
        cfg,
        {
            "compute": ran(0.10, ranks=1),
            "compute-parallel": ran(0.13),
            "ddp+no-comm": ran(0.16),
            "ddp": ran(0.40),
            "gc_fused:compressor=randk": ran(0.20, codec=0.02),
            "gc_fused:compressor=none": ran(0.12),
        },
    )
    randk = rows[4]
    assert randk["step / compute"] == pytest.approx(2.0) and randk["step / compute-parallel"] == pytest.approx(
        0.20 / 0.13
    )
    assert randk["step / ddp+no-comm"] == pytest.approx(1.25) and "speedup vs ddp+no-comm" not in randk
    assert randk["speedup vs ddp"] == pytest.approx(2.0) and "speedup vs compute-parallel" not in randk
    assert rows[1]["samples/s"] == pytest.approx(2 * 32 / 0.13)
    parts = bench.breakdown(rows)
    assert list(parts) == [
        "compute (one rank alone)",
        "ranks sharing the machine",
        "ranks in step, no communication",
        "encode+decode",
        "exposed communication and the rest",
    ]
    expected = [
        [0.10, 0.0, 0.0, 0.0, 0.0],
        [0.10, 0.03, 0.0, 0.0, 0.0],
        [0.10, 0.03, 0.03, 0.0, 0.0],
        [0.10, 0.03, 0.03, 0.0, 0.24],
        [0.10, 0.03, 0.03, 0.02, 0.02],
        [0.10, 0.02, 0.0, 0.0, 0.0],
    ]  # the last step is shorter than compute-parallel's: no part exceeds it
    assert [[parts[label][i] for label in parts] for i in range(6)] == [pytest.approx(row) for row in expected]
    without_parallel = bench.breakdown([rows[0], rows[4]])  # a missing ideal's part is 0; the next ones still count
    assert [values[1] for values in without_parallel.values()] == pytest.approx([0.10, 0.0, 0.0, 0.02, 0.08])
    without_compute = bench.breakdown([rows[2], rows[4]])
    assert [values[1] for values in without_compute.values()] == pytest.approx([0.0, 0.0, 0.16, 0.02, 0.02])


def _ddp_without_communication(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, keep_local_gradients)
    x = torch.full((2, 4), float(rank + 1))
    ddp(x).square().sum().backward()
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    reference(x).square().sum().backward()
    return [(p.grad.clone(), q.grad.clone()) for p, q in zip(model.parameters(), reference.parameters())]


def test_the_no_comm_baseline_keeps_each_ranks_own_gradients():
    """``ddp+no-comm``: DDP runs as usual, but the hook sends nothing and averages nothing."""
    ranks = run_ranks(_ddp_without_communication, 2)
    for grads in ranks:
        for got, local in grads:
            assert torch.equal(got, local)
    assert not torch.equal(ranks[0][0][0], ranks[1][0][0])  # the ranks' inputs differ, and so do their gradients


def test_a_rank_that_dies_ends_the_run_at_once_and_its_error_is_reported(tmp_path, monkeypatch):
    """Rank 1 fails while rank 0 would wait on it for ever (here: sleeps): rank 0 is killed after the
    grace period, long before the timeout, and the report names rank 1's own error."""
    cfg = OmegaConf.create({"world_size": 2, "nodes": 2, "threads_per_rank": 1, "timeout_s": 300})
    (tmp_path / "runs").mkdir()
    (tmp_path / "logs").mkdir()
    monkeypatch.setattr(bench, "PEER_GRACE_S", 1.0)
    waits = netns.NodeNetwork(["sh", "-c", "sleep 300", "--"], "127.0.0.1", "lo")
    dies = netns.NodeNetwork(
        ["sh", "-c", "echo 'ImportError: cannot import name' >&2; exit 1", "--"], "127.0.0.1", "lo"
    )
    started = time.monotonic()
    failed = bench.run_config("ddp", cfg, tmp_path / "none.yaml", [waits, dies], 29999, tmp_path, "r0-c0")
    assert failed == {"failed": "rank 1 exited with 1: ImportError: cannot import name"}
    assert time.monotonic() - started < 60


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_the_emulated_network_is_removed_afterwards_also_on_error():
    with pytest.raises(KeyError):
        with netns.emulated_network(2, "100mbit") as ranks:
            assert sorted(netns.existing()[0]) == ["gcb0", "gcb1"]
            server = subprocess.Popen(
                ranks[1].command
                + [
                    sys.executable,
                    "-c",
                    f"import socket; s = socket.create_server(('{ranks[1].address}', 29111)); c, _ = s.accept(); "
                    "c.sendall(b'hello')",
                ]
            )
            client = subprocess.run(
                ranks[0].command
                + [
                    sys.executable,
                    "-c",
                    "import socket, time\nfor _ in range(50):\n    try:\n"
                    f"        c = socket.create_connection(('{ranks[1].address}', 29111)); break\n"
                    "    except OSError:\n        time.sleep(0.1)\nprint(c.recv(5).decode())",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            server.wait(timeout=30)
            assert client.stdout.strip() == "hello"  # rank 0's namespace reaches rank 1's address
            raise KeyError("a failure inside the benchmark")
    assert netns.existing() == ([], [])


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_second_emulated_network_is_refused_while_one_is_in_use():
    with netns.emulated_network(2, "100mbit"):
        with pytest.raises(RuntimeError, match="net.rate=1gbit: another run's emulated network is in use"):
            with netns.emulated_network(2, "1gbit"):
                pass
        assert sorted(netns.existing()[0]) == ["gcb0", "gcb1"]  # the first run's network is untouched
    assert netns.existing() == ([], [])


def test_bad_configs_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="configs: 'dpp' is invalid; allowed: compute, compute-parallel, ddp"):
        parse_config("dpp")
    assert parse_config("gc_fused:compressor=topk,density=0.01") == {
        "compressor": "topk",
        "density": 0.01,
        "sync": EveryStep(),
        "hierarchy": "flat",
    }
    assert parse_config("gc_fsdp:compressor=topk,sync=diloco,inner_steps=5") == {
        "compressor": "topk",
        "sync": DiLoCo(inner_steps=5),
    }
    assert strategy_class("gc_fsdp:compressor=topk") is GCFSDPStrategy
    with pytest.raises(ValueError, match="gc_fsdp shards inside each node already; drop hierarchy="):
        parse_config("gc_fsdp:hierarchy=node")
    assert parse_config("gc_fused:sync=diloco,inner_steps=5,hierarchy=node,node_precision=bf16") == {
        "sync": DiLoCo(inner_steps=5),
        "hierarchy": NodeHierarchy(precision="bf16"),
    }
    done = _bench(tmp_path, 'configs=[ddp,"gc_fused:compressor=topk,density=2"]', timeout=120)
    assert done.returncode == 2 and "option 'density' = 2 is invalid" in done.stderr
    assert not (tmp_path / "run" / "runs").exists()
    done = _bench(tmp_path, "world_size=1", timeout=120)
    assert done.returncode == 2 and "world_size = 1 is invalid" in done.stderr
    done = _bench(tmp_path, "net.rate=fast", timeout=120)
    assert done.returncode == 2 and "net.rate = 'fast' is invalid; allowed: a number and a unit" in done.stderr
    assert all(netns.RATE.fullmatch(rate) for rate in ("1gbit", "10Gbit", "100mbit", "2.5gbit", "125mbps", "1gibit"))


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_two_emulated_nodes_count_the_bytes_that_cross_between_them(tmp_path):
    """2 nodes x 2 ranks at 1 Gbit/s: ranks of one node share a namespace, and the kernel's
    counters of the nodes' interfaces give what crossed between nodes. Every node must receive the
    other node's payloads, so a flat allgather moves at least 2 x 2 payloads across; the hierarchy
    sends each node's share once, at most half of that."""
    topk = "gc_fused:compressor=topk,memory=residual,density=0.01"
    done = _bench(
        tmp_path,
        f'configs=[compute-parallel,"{topk}","{topk},hierarchy=node"]',
        "world_size=4",
        "nodes=2",
        "net.rate=1gbit",
        "rounds=1",
        "steps=2",
        "warmup=1",
        "data.batch_size=4",
        "logger=csv",
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "2 node(s) x 2 CPU rank(s)" in done.stdout
    rows = {r["configuration"]: r for r in csv.DictReader(open(tmp_path / "run" / "results.csv"))}
    across = {name: float(row["bytes across nodes / step"]) for name, row in rows.items()}
    payload = float(rows[topk]["bytes sent / step"])  # rank 0's allgathered payload
    assert across["compute-parallel"] < 10_000  # ranks that train alone send (next to) nothing
    assert across[topk] >= 4 * payload
    assert across[f"{topk},hierarchy=node"] <= 0.5 * across[topk]
    assert netns.existing() == ([], [])


def test_nodes_must_divide_the_ranks(tmp_path):
    done = _bench(tmp_path, "world_size=4", "nodes=3", timeout=120)
    assert done.returncode == 2 and "nodes = 3 is invalid with world_size = 4" in done.stderr
