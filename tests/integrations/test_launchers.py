"""Multi-node launches of the Hydra app with hierarchy=node: torchrun and SLURM (its environment, as
srun sets it), each node an emulated machine (a network namespace behind a shaped link,
benchmarks/netns.py), the ranks taking their places from Lightning's cluster environment."""

import json
import os
import subprocess
import sys

import pytest
from locations import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import netns  # noqa: E402

NODES, PER_NODE, PORT = 2, 2, 29581
APP = [
    "train.py",
    "trainer=multinode",
    "trainer.accelerator=cpu",
    f"trainer.devices={PER_NODE}",
    f"trainer.num_nodes={NODES}",
    "trainer.precision=32-true",
    "trainer.threads_per_rank=1",
    "trainer.max_steps=6",
    "trainer.val_check_interval=6",
    "trainer.log_every_n_steps=2",
    "trainer.hierarchy=node",
    "compressor=topk",
    "compressor.density=0.01",
    "memory=residual",
    "data.batch_size=4",
    "logger=csv",
    "speedup.warmup_steps=2",
]


def _torchrun(node: int, master: str) -> list[list[str]]:
    """One launcher process per node; it starts the node's ranks."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}"]
    return [[*launcher, f"--node-rank={node}", f"--master-addr={master}", f"--master-port={PORT}"]]


def _slurm(node: int, master: str) -> list[list[str]]:
    """One process per rank, with the variables srun gives each task."""
    tasks = []
    for local in range(PER_NODE):
        variables = {
            "SLURM_JOB_NAME": "gc",
            "SLURM_JOB_ID": "4242",
            "SLURM_NTASKS": NODES * PER_NODE,
            "SLURM_NTASKS_PER_NODE": PER_NODE,
            "SLURM_NNODES": NODES,
            "SLURM_NODEID": node,
            "SLURM_LOCALID": local,
            "SLURM_PROCID": node * PER_NODE + local,
            "MASTER_ADDR": master,
            "MASTER_PORT": PORT,
        }
        tasks.append(["env", *(f"{key}={value}" for key, value in variables.items()), sys.executable])
    return tasks


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize("launch", [_torchrun, _slurm], ids=["torchrun", "slurm"])
def test_two_nodes_train_hierarchically_under_a_cluster_launcher(tmp_path, launch):
    """Every process ends cleanly, four ranks on two nodes; rank 0's summary shows the hierarchical
    exchange (each node's two ranks send one share between them: top-k 1% of fp32 values with int32
    indices is 50x smaller than the gradients flat, 100x and more with the share) and the CSV logger
    has the steps."""
    with netns.emulated_network(NODES, "1gbit") as nodes:
        processes = []
        for n, node in enumerate(nodes):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": node.interface, "OMP_NUM_THREADS": "1"}
            for command in launch(n, nodes[0].address):
                processes.append(
                    subprocess.Popen(
                        node.command + command + APP + [f"hydra.run.dir={tmp_path / f'node{n}'}"],
                        cwd=ROOT,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
        outputs = []
        try:
            for process in processes:
                outputs.append(process.communicate(timeout=300)[0])
        finally:
            for process in processes:
                process.kill()
    log = "\n".join(outputs)
    assert all(process.returncode == 0 for process in processes), log[-4000:]
    assert "Starting with 4 processes" in log and "GLOBAL_RANK: 3, MEMBER: 4/4" in log
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["compression_ratio"] > 100
    assert list((tmp_path / "node0" / "csv").rglob("metrics.csv"))
    assert netns.existing() == ([], [])
