"""One rank of one benchmark configuration (started by ``benchmarks/bench.py``, one process per rank).

    python benchmarks/bench_worker.py CONFIG.yaml NAME RESULT.json

The rank, world size and rendezvous come from the environment (``NODE_RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``), so that each emulated node
runs in its own network namespace; each node is a Lightning node with ``world_size / nodes`` CPU
devices. Rank 0 writes ``RESULT.json``: the step times after ``warmup`` steps
(``ThroughputMonitor``'s summary) and the payload bytes per step. Every rank writes its local rank and
the bytes its node's interface sent during the measured steps (``node_sent_bytes``; one rank per node
counts, as the node's ranks share the interface; other ranks write ``RESULT-rankR.json``).

Configuration names: ``compute`` (one rank, no communication), ``compute-parallel`` (``world_size``
ranks at once, each training alone: no communication, but the ranks share the machine's cores, caches
and memory bandwidth as in every distributed configuration), ``ddp``, ``ddp+fp16`` (torch's
``fp16_compress_hook``), ``ddp+powersgd`` (torch's ``powerSGD_hook``, rank 4, DDP's usual 25 MB
buckets), ``ddp+powersgd-1bucket`` (the same hook over one bucket holding every gradient: the form
in which it runs on gloo, where with several buckets it fails), ``ddp+no-comm`` (DDP with a
communication hook that sends nothing, each rank keeping its own gradients: what synchronous data
parallelism costs before any gradient is exchanged, i.e. DDP's copies into buckets and the ranks
running in step, since Lightning starts every step with a broadcast), and
``gc_fused[:key=value,...]`` with the options of :class:`gc_strategy.GCFusedStrategy`
(``gc_fused:compressor=dgc,memory=dgc,density=0.01,fusion=auto:2``); sharded inside each node:
``hsdp`` (torch's native HSDP) and ``gc_fsdp[:key=value,...]`` with those of
:class:`gc_strategy.GCFSDPStrategy` (``gc_fsdp:sync=diloco,inner_steps=10,compressor=topk,density=0.01``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from netns import sent_bytes

from gc_strategy import GCFSDPStrategy, GCFusedStrategy
from gc_strategy.components import parse_options
from gc_strategy.integrations.lightning_glue import end_process_group
from gc_strategy.sync.modes import from_command_line
from gc_strategy.sync.sharded.synchronizer import shard_by_policy

BASELINES = ("compute", "compute-parallel", "ddp+no-comm", "ddp", "ddp+fp16", "ddp+powersgd", "ddp+powersgd-1bucket")
BASELINES += ("hsdp",)
#: the strategies a configuration ``KIND:key=value,...`` names
KINDS = ("gc_fused", "gc_fsdp")
ALONE = ("compute", "compute-parallel")  # each rank trains on its own, without a process group
#: configurations that exchange no gradient: bounds on a step, so ratios to them read "step / X"
IDEALS = (*ALONE, "ddp+no-comm")
#: bytes per gradient element that a DDP baseline's hook puts on the wire
WIRE_BYTES = {"ddp+no-comm": 0, "ddp": 4, "ddp+fp16": 2}
ONE_BUCKET_MB = 1 << 20  # a DDP bucket cap no model reaches (with an explicit cap the first bucket has it too)


class DDPWithCommHook(DDPStrategy):
    """Lightning's DDP with a torch communication hook registered on any device: Lightning itself
    registers ``ddp_comm_hook`` only when the root device is CUDA (``DDPStrategy._register_ddp_hooks``)
    and silently ignores it on CPU, while torch's hooks also run over gloo."""

    def __init__(self, hook: Any, state: Any = None, **ddp_options: Any) -> None:
        super().__init__(process_group_backend="gloo", **ddp_options)
        self._hook, self._state = hook, state

    def _register_ddp_hooks(self) -> None:
        self.model.register_comm_hook(self._state, self._hook)


def keep_local_gradients(state, bucket):  # unannotated: DDP rejects annotations other than its own types
    """A DDP communication hook that communicates nothing: the bucket's "average" is this rank's
    own gradient."""
    import torch

    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def parse_config(name: str) -> dict[str, Any]:
    """``gc_fused:compressor=topk,density=0.01`` -> the strategy's keyword arguments
    (``{"compressor": "topk", "density": 0.01, "sync": EveryStep(), "hierarchy": "flat"}``; DiLoCo's
    and the hierarchy's options gathered into their objects); a baseline name -> ``{}``. Raises
    ValueError naming what is wrong."""
    if name in BASELINES:
        return {}
    kind, _, spec = name.partition(":")
    if kind not in KINDS:
        raise ValueError(
            f"configs: {name!r} is invalid; allowed: {', '.join(BASELINES)}, gc_fused[:key=value,...] or "
            "gc_fsdp[:key=value,...]"
        )
    options = from_command_line(parse_options(spec))
    if kind == "gc_fsdp" and options.pop("hierarchy") != "flat":
        raise ValueError(f"configs: {name!r}: gc_fsdp shards inside each node already; drop hierarchy=")
    return options


def strategy_class(name: str) -> type:
    """The strategy class of a ``KIND:...`` configuration."""
    return GCFSDPStrategy if name.startswith("gc_fsdp") else GCFusedStrategy


class NativeHSDP(GCFSDPStrategy):
    """``hsdp``: torch's own HSDP through gc_fsdp's set-up (a ``(nodes, devices)`` mesh, the same
    sharding policy), every shard all-reduced across nodes at full precision by FSDP2 itself."""

    def _shard(self) -> None:
        shard_by_policy(self.model, self.device_mesh, self.shard_modules, through_root=False)  # the 2-D mesh: HSDP

    def _synchronizer(self) -> None:
        return None


def make_strategy(name: str, warmup: int):
    if name in ALONE:
        return "auto"
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if name == "ddp+no-comm":
        return DDPWithCommHook(keep_local_gradients)
    if name == "ddp+fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return DDPWithCommHook(default_hooks.fp16_compress_hook)
    if name.startswith("ddp+powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=max(2, warmup // 2)
        )
        one_bucket = {"bucket_cap_mb": ONE_BUCKET_MB} if name.endswith("-1bucket") else {}
        return DDPWithCommHook(powerSGD_hook.powerSGD_hook, state, **one_bucket)
    if name == "hsdp":
        return NativeHSDP(process_group_backend="gloo")
    return strategy_class(name)(process_group_backend="gloo", **parse_config(name))


class InterfaceBytes(pl.Callback):
    """The bytes sent through ``interface`` from the start of step ``first`` to the end of step
    ``last`` (kernel counters: every byte that left the node, whoever sent it)."""

    def __init__(self, interface: str, first: int, last: int) -> None:
        self.interface, self.first, self.last = interface, first, last
        self.sent: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.first:
            self.sent = -sent_bytes(self.interface)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.last and self.sent is not None:
            self.sent += sent_bytes(self.interface)


def ranks(name: str, world_size: int) -> int:
    """How many processes a configuration runs: one for ``compute``, ``world_size`` otherwise."""
    return 1 if name == "compute" else world_size


def main(config_path: str, name: str, result_path: str) -> None:
    import torch
    from omegaconf import OmegaConf

    from gc_strategy.integrations.monitor import ThroughputMonitor
    from train import build_recipe

    cfg = OmegaConf.load(config_path)
    torch.set_num_threads(cfg.threads_per_rank)
    world_size = 1 if name in ALONE else cfg.world_size
    nodes = 1 if name in ALONE else cfg.nodes
    steps = cfg.warmup + cfg.steps
    samples = cfg.data.batch_size * world_size * steps  # every step's batches, once
    if "train_samples" in cfg.data:  # images
        cfg.data.train_samples, cfg.data.val_samples = samples, cfg.data.batch_size
    else:  # token streams, cut into sequences of max_length (BERT) or bptt (LSTM) tokens
        length = cfg.data.get("max_length", cfg.data.get("bptt"))
        cfg.data.train_tokens, cfg.data.val_tokens = (samples + 1) * length, 4 * cfg.data.batch_size * length
    pl.seed_everything(cfg.seed, verbose=False)
    module, data = build_recipe(cfg, cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        monitor = ThroughputMonitor(cfg.data.batch_size, tmp, baseline_steps=0, warmup_steps=cfg.warmup)
        interface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        traffic = InterfaceBytes(interface, cfg.warmup, steps)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size // nodes,
            num_nodes=nodes,
            strategy=make_strategy(name, cfg.warmup),
            max_steps=steps,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[monitor, traffic],
        )
        trainer.fit(module, datamodule=data)
    losses = [float(value) for key, value in trainer.callback_metrics.items() if "loss" in key]
    result = {
        "local_rank": trainer.local_rank,
        "node_sent_bytes": traffic.sent,
        "final_loss": losses[0] if losses else None,
    }
    if trainer.is_global_zero:
        result.update(monitor.summary)
        elements = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if name in WIRE_BYTES:
            result["sent_bytes_per_step"] = elements * WIRE_BYTES[name]
        result["ranks"] = ranks(name, cfg.world_size)
    with open(result_path, "w") as f:
        json.dump(result, f)
    end_process_group()  # also after Lightning's own ddp, which leaves its gloo group behind


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:4])
