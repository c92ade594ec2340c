"""🤗 Accelerate integration: the gradient synchroniser in an Accelerate training loop.

Accelerate has no plugin point for custom gradient synchronisation (its DDP kwargs take only the
built-in fp16 / bf16 / PowerSGD hooks), so :func:`prepare` installs the synchroniser itself, in place of
DDP::

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader = gc_strategy.integrations.accelerate.prepare(
        accelerator, model, optimizer, loader, compressor="dgc", memory="dgc", fusion="auto")
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(batch)))
            optimizer.step()
            optimizer.zero_grad()

What it does: moves the model to ``accelerator.device`` and broadcasts its parameters and buffers
from rank 0; attaches a :class:`~gc_strategy.sync.base.Synchronizer` (never a DDP wrapper) and
gives the model a ``no_sync()`` so that ``accelerator.accumulate`` / ``accelerator.no_sync`` skip
synchronisation on micro-batches that do not step; wraps ``forward`` in ``accelerator.autocast()``
under mixed precision (as Accelerate does for the models it wraps); registers the compression state
(error feedback, factors, the fusion plan) for ``accelerator.save_state`` / ``load_state``, one file
per rank (:class:`CompressionState`); broadcasts rank 0's buffers before forwards as DDP
does (``broadcast_buffers``); then hands the model and the other objects to
``accelerator.prepare`` (which places optimizers, schedulers and data loaders as usual, and keeps
the model as it is). The synchroniser is ``model.gc_synchronizer``. DDP's ``find_unused_parameters`` and
``broadcast_buffers`` come from the accelerator's ``DistributedDataParallelKwargs`` handler where one
is given, or from the arguments of the same names.

Sharded (``sharding="fsdp"``, the default under Accelerate's FSDP2 plugin): the parameters,
gradients and optimizer state are sharded with FSDP2 over the ranks of each node, and each module's
reduce-scattered shard is compressed across nodes (:mod:`gc_strategy.sync.sharded.synchronizer`), or, with
``sync=DiLoCo(...)``, each node trains its own shards and the outer step runs on them
(:mod:`gc_strategy.sync.sharded.diloco`). :func:`prepare` shards the model itself, before
``accelerator.prepare``, on a ``(nodes, ranks per node)`` mesh (Accelerate's FSDP2 path would
shard across the nodes too, as native HSDP, whose hook runs after its own all-reduce): rank 0's
weights are broadcast, the units are the plugin's ``transformer_cls_names_to_wrap`` classes (else
every module holding parameters of its own) and then the model, with the plugin's
``mixed_precision_policy`` and ``reshard_after_forward``; the optimizers are pointed at the sharded
parameters; ``accelerator.prepare`` then finds an FSDP2 module and leaves it as it is. The ranks of a
node are the ``ParallelismConfig``'s ``dp_shard_size``, else the launcher's ``LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from ..algos import Compressor, Memory
from ..communicators import Communicator
from ..components import DEFAULT_FUSION, build_components, double_momentum
from ..fusion import FusionPlanner
from ..sync.base import Synchronizer
from ..sync.fault_tolerance.options import FaultTolerance
from ..sync.modes import Replicated, Sharded, SyncMode, check_setup, parse_sync, refuse_misplaced_options
from ..sync.paths.hierarchy import NodeHierarchy
from ..sync.sharded.synchronizer import MESH_DIMS, shard_by_policy
from .checkpoint import load_rank_states, save_rank_states
from .loop import attach

#: the folder of the per-rank state files inside Accelerate's checkpoint folder
STATE_FOLDER = "gc_state"
#: Accelerate distributed types the synchroniser can replace DDP (or, for FSDP2, HSDP's all-reduce) in
SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP")
#: ``sharding=``: "auto" shards under Accelerate's FSDP2 plugin, and not otherwise
SHARDING = ("auto", "none", "fsdp")


class CompressionState:
    """The synchroniser's state in Accelerate's checkpoints (:mod:`gc_strategy.integrations.checkpoint`): a
    save-state pre-hook, which Accelerate runs on every process, writes each rank's state to
    ``<output_dir>/gc_state/rank<r>.pt``; ``state_dict`` gives the manifest that the main process
    saves as a custom checkpoint; a load-state pre-hook names the folder that ``load_state_dict``
    reads this rank's state from (the old ranks' mean where the world size changed)."""

    def __init__(self, synchronizer: Synchronizer) -> None:
        self.synchronizer = synchronizer
        self.manifest: dict[str, Any] | None = None
        self.folder: str | None = None

    def before_save(self, models: Any, weights: Any, output_dir: str) -> None:
        self.manifest = save_rank_states(self.synchronizer, os.path.join(output_dir, STATE_FOLDER))

    def before_load(self, models: Any, input_dir: str) -> None:
        self.folder = os.path.join(input_dir, STATE_FOLDER)

    def state_dict(self) -> dict[str, Any] | None:
        return self.manifest

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        load_rank_states(self.synchronizer, saved, self.folder)


def prepare(
    accelerator: Any,
    model: Any,
    *objects: Any,
    compressor: str | Compressor = "none",
    memory: str | Memory = "none",
    communicator: str | Communicator = "auto",
    fusion: str | FusionPlanner = DEFAULT_FUSION,
    find_unused_parameters: bool | None = None,
    broadcast_buffers: bool | None = None,
    sync: str | SyncMode = "every_step",
    hierarchy: str | NodeHierarchy = "flat",
    sharding: str = "auto",
    fault_tolerance: FaultTolerance | None = None,
    **options: Any,
) -> Any:
    """Like ``accelerator.prepare(model, *objects)``, with compressed fused gradient synchronisation
    in place of DDP. Returns what ``accelerator.prepare`` returns (the model first).
    ``find_unused_parameters`` and ``broadcast_buffers`` (None: the accelerator's DDP kwargs handler's,
    else DDP's defaults False and True) mean what they mean for DDP. ``hierarchy="node"`` (or a
    :class:`~gc_strategy.sync.paths.hierarchy.NodeHierarchy`): a dense reduction inside each node and
    compression only across nodes, the nodes of the launcher's ``LOCAL_WORLD_SIZE`` ranks.
    ``sync=DiLoCo(inner_steps=...)``: the one optimizer among ``objects`` takes the inner steps,
    and each of its steps counts towards the next outer step. ``sharding``: ``"auto"`` (``"fsdp"``
    under Accelerate's FSDP2 plugin, else ``"none"``), ``"none"`` or ``"fsdp"`` (see the module's
    docstring). ``fault_tolerance``: a :class:`~gc_strategy.sync.fault_tolerance.quorum.FaultTolerance`;
    the processes of this launch are then a replica group that goes on when others die
    (docs/fault_tolerance.md):
    ``optimizer.step()`` steps only where the step commits, a group that comes back heals the model,
    the optimizers and the LR schedulers among ``objects``, and each group passes its own shard of
    the data (Accelerate splits a loader over the processes of one group only)."""
    sharded = _sharded(accelerator, sharding)
    if getattr(model, "_is_accelerate_prepared", False) or hasattr(model, "gc_synchronizer"):
        raise ValueError(
            "the model was already prepared; pass the plain nn.Module to gc_strategy.integrations.accelerate.prepare"
        )
    refuse_misplaced_options(options)
    components = build_components(compressor, memory, communicator, fusion, **options)
    sync = parse_sync(sync, components)
    handler = getattr(accelerator, "ddp_handler", None)
    if find_unused_parameters is None:
        find_unused_parameters = getattr(handler, "find_unused_parameters", False)
    replicated = {
        "fusion": fusion,
        "hierarchy": hierarchy,
        "find_unused_parameters": find_unused_parameters,
        "broadcast_buffers": broadcast_buffers,
    }
    if sharded:
        placement: Replicated | Sharded = Sharded(fault_tolerance=fault_tolerance)
    else:
        if broadcast_buffers is None:
            broadcast_buffers = getattr(handler, "broadcast_buffers", True)
        placement = Replicated(
            hierarchy=hierarchy,
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            fault_tolerance=fault_tolerance,
        )
    # the processes of this launch: one replica group where fault tolerant
    check_setup(sync, components, placement, getattr(accelerator, "num_processes", None), replicated_options=replicated)
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    twice = double_momentum(components, optimizers)
    if twice is not None:
        warnings.warn(twice, stacklevel=2)
    if sync.one_optimizer and len(optimizers) != 1:
        raise ValueError(f"sync={sync!r} counts the steps of one optimizer; {len(optimizers)} were passed to prepare")
    if sharded:
        placement = Sharded(_node_mesh(accelerator), fault_tolerance)  # the nodes, checked before anything moves
    model = model.to(accelerator.device)
    if sharded:
        _shard(accelerator, model, optimizers, placement.mesh)
    synchronizer = sync.build(model, components, placement)
    schedulers = [o for o in objects if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
    attached = attach(synchronizer, model, optimizers, schedulers)
    gates = {id(optimizer): gate for optimizer, gate in zip(optimizers, attached.optimizers)}
    objects = tuple(gates.get(id(o), o) for o in objects)
    if accelerator.mixed_precision in ("fp16", "bf16") and not _fsdp2(accelerator):  # FSDP2: its policy
        forward = model.forward

        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with accelerator.autocast():
                return forward(*args, **kwargs)

        model.forward = autocast_forward
    model.gc_synchronizer = synchronizer
    model.no_sync = synchronizer.no_sync
    model._is_accelerate_prepared = True  # accelerator.prepare then registers the model without wrapping it
    if sharded and not _fsdp2(accelerator):
        accelerator.register_save_state_pre_hook(_refuse_to_save_shards)
    state = CompressionState(synchronizer)
    accelerator.register_save_state_pre_hook(state.before_save)
    accelerator.register_load_state_pre_hook(state.before_load)
    accelerator.register_for_checkpointing(state)
    return accelerator.prepare(model, *objects)


def _fsdp2(accelerator: Any) -> bool:
    """Whether ``accelerator`` runs Accelerate's FSDP2 plugin."""
    kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    return kind == "FSDP" and getattr(plugin, "fsdp_version", 1) == 2


def _sharded(accelerator: Any, sharding: str) -> bool:
    """Whether to shard, after refusing distributed types and ``sharding`` values that cannot work."""
    kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    fsdp2 = _fsdp2(accelerator)
    if kind not in SUPPORTED or (kind == "FSDP" and not fsdp2):
        raise ValueError(
            f"gc_strategy.integrations.accelerate.prepare: Accelerate's distributed type is {kind}; supported: "
            f"{', '.join(SUPPORTED)} (FSDP with fsdp_version=2). DeepSpeed, FSDP1, XLA and the others shard or "
            "synchronise gradients themselves, so compression cannot replace their reductions."
        )
    if sharding not in SHARDING:
        raise ValueError(f"sharding = {sharding!r} is invalid; allowed: {', '.join(SHARDING)}")
    if fsdp2 and sharding == "none":
        raise ValueError("sharding = 'none' is invalid under Accelerate's FSDP2 plugin; allowed: 'auto', 'fsdp'")
    return sharding == "fsdp" or (sharding == "auto" and fsdp2)


def _refuse_to_save_shards(models: Any, weights: Any, output_dir: str) -> None:
    """Accelerate saves the main process's model state only, unless its FSDP2 plugin saves the shards."""
    raise ValueError(
        "accelerator.save_state of a model sharded without Accelerate's FSDP2 plugin would keep the main "
        "process's shards only; save it with torch.distributed.checkpoint, or use the FSDP2 plugin"
    )


def _node_mesh(accelerator: Any) -> Any:
    """The ``("replicate", "shard")`` mesh of nodes by ranks per node (see the module's docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and config.non_dp_dim_names:
        raise ValueError(
            f"sharding='fsdp': parallelism dimensions {config.non_dp_dim_names} are invalid; allowed: data "
            "parallelism only (dp_replicate_size, dp_shard_size)"
        )
    if config is not None and config.dp_shard_size > 1:
        per_node = config.dp_shard_size
    elif "LOCAL_WORLD_SIZE" in os.environ:
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    else:
        raise ValueError(
            "sharding='fsdp' shards over the ranks of each node: give them as ParallelismConfig(dp_shard_size=...) "
            "or the launcher's LOCAL_WORLD_SIZE (torchrun and accelerate launch set it)"
        )
    world = accelerator.num_processes
    if per_node < 1 or world % per_node:
        raise ValueError(f"sharding='fsdp': {world} processes cannot form nodes of {per_node} ranks each")
    return init_device_mesh(accelerator.device.type, (world // per_node, per_node), mesh_dim_names=MESH_DIMS)


@torch.no_grad()
def _shard(accelerator: Any, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], mesh: Any) -> None:
    """Broadcast rank 0's weights, shard ``model`` over ``mesh["shard"]`` by the policy, and point
    ``optimizers`` at the sharded parameters (by name)."""
    import torch.distributed as dist

    if any(optimizer.state for optimizer in optimizers):
        raise ValueError("sharding='fsdp' needs optimizers that have not stepped yet: their state would not be sharded")
    names = {id(p): name for name, p in model.named_parameters()}
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor, 0)
    plugin = accelerator.state.fsdp_plugin if _fsdp2(accelerator) else None
    options, classes = {}, None
    if plugin is not None:
        options["reshard_after_forward"] = plugin.reshard_after_forward
        if plugin.mixed_precision_policy is not None:
            options["mp_policy"] = plugin.mixed_precision_policy
        wanted = plugin.transformer_cls_names_to_wrap or []
        classes = tuple({type(m) for m in model.modules() if type(m).__name__ in wanted}) or None
    shard_by_policy(model, mesh["shard"], classes, through_root=True, **options)
    sharded = dict(model.named_parameters())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if any(id(p) not in names for p in group["params"]):
                raise ValueError("sharding='fsdp': an optimizer holds parameters that are not the model's")
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
