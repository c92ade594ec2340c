"""🤗 Accelerate integration: the gradient synchroniser in an Accelerate training loop.

Accelerate has no plugin point for custom gradient synchronisation (its DDP kwargs take only the
built-in fp16 / bf16 / PowerSGD hooks), so :func:`prepare` installs the synchroniser itself, in place of
DDP::

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader = gc_strategy.accelerate.prepare(
        accelerator, model, optimizer, loader, compressor="dgc", memory="dgc", fusion="auto")
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(batch)))
            optimizer.step()
            optimizer.zero_grad()

What it does: moves the model to ``accelerator.device`` and broadcasts its parameters and buffers
from rank 0; attaches a :class:`~gc_strategy.synchronizer.Synchronizer` (never a DDP wrapper) and
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
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .algos import Compressor, Memory
from .checkpoint import load_rank_states, save_rank_states
from .communicators import Communicator
from .components import build_components
from .fusion import FusionPlanner
from .hierarchy import NodeHierarchy, parse_hierarchy
from .sync import build_synchronizer
from .sync_modes import DiLoCo, EveryStep, parse_sync, refuse_misplaced_options
from .synchronizer import Synchronizer

#: the folder of the per-rank state files inside Accelerate's checkpoint folder
STATE_FOLDER = "gc_state"
#: Accelerate distributed types the synchroniser can replace DDP in
SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU")


class CompressionState:
    """The synchroniser's state in Accelerate's checkpoints (:mod:`gc_strategy.checkpoint`): a
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
    fusion: str | FusionPlanner = "bucket_mb:25",
    find_unused_parameters: bool | None = None,
    broadcast_buffers: bool | None = None,
    sync: str | EveryStep | DiLoCo = "every_step",
    hierarchy: str | NodeHierarchy = "flat",
    **options: Any,
) -> Any:
    """Like ``accelerator.prepare(model, *objects)``, with compressed fused gradient synchronisation
    in place of DDP. Returns what ``accelerator.prepare`` returns (the model first).
    ``find_unused_parameters`` and ``broadcast_buffers`` (None: the accelerator's DDP kwargs handler's,
    else DDP's defaults False and True) mean what they mean for DDP. ``hierarchy="node"`` (or a
    :class:`~gc_strategy.hierarchy.NodeHierarchy`): a dense reduction inside each node and
    compression only across nodes, the nodes of the launcher's ``LOCAL_WORLD_SIZE`` ranks.
    ``sync=DiLoCo(inner_steps=...)``: the one optimizer among ``objects`` takes the inner steps,
    and each of its steps counts towards the next outer step."""
    kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    if kind not in SUPPORTED:
        raise ValueError(
            f"gc_strategy.accelerate.prepare: Accelerate's distributed type is {kind}; supported: "
            f"{', '.join(SUPPORTED)} (plain data parallelism). DeepSpeed, FSDP, XLA and the others shard or "
            "synchronise gradients themselves, so compression cannot replace their DDP."
        )
    if getattr(model, "_is_accelerate_prepared", False) or hasattr(model, "gc_synchronizer"):
        raise ValueError("the model was already prepared; pass the plain nn.Module to gc_strategy.accelerate.prepare")
    refuse_misplaced_options(options)
    parse_hierarchy(hierarchy)
    components = build_components(compressor, memory, communicator, fusion, **options)
    sync = parse_sync(sync, components)
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if isinstance(sync, DiLoCo) and len(optimizers) != 1:
        raise ValueError(
            f"sync=DiLoCo counts the inner steps of one optimizer; {len(optimizers)} were passed to prepare"
        )
    handler = getattr(accelerator, "ddp_handler", None)
    if find_unused_parameters is None:
        find_unused_parameters = getattr(handler, "find_unused_parameters", False)
    if broadcast_buffers is None:
        broadcast_buffers = getattr(handler, "broadcast_buffers", True)
    model = model.to(accelerator.device)
    synchronizer = build_synchronizer(
        model,
        components,
        sync,
        hierarchy=hierarchy,
        broadcast_buffers=broadcast_buffers,
        find_unused_parameters=find_unused_parameters,
    )
    synchronizer.use_optimizers(optimizers)
    for optimizer in optimizers:
        optimizer.register_step_post_hook(lambda optimizer, args, kwargs: synchronizer.after_optimizer_step())
    model.register_forward_pre_hook(lambda module, args: synchronizer.before_forward())
    model.register_forward_hook(lambda module, args, output: synchronizer.after_forward())
    if accelerator.mixed_precision in ("fp16", "bf16"):
        forward = model.forward

        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with accelerator.autocast():
                return forward(*args, **kwargs)

        model.forward = autocast_forward
    model.gc_synchronizer = synchronizer
    model.no_sync = synchronizer.no_sync
    model._is_accelerate_prepared = True  # accelerator.prepare then registers the model without wrapping it
    state = CompressionState(synchronizer)
    accelerator.register_save_state_pre_hook(state.before_save)
    accelerator.register_load_state_pre_hook(state.before_load)
    accelerator.register_for_checkpointing(state)
    return accelerator.prepare(model, *objects)
