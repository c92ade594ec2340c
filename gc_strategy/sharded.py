"""Compressed HSDP on FSDP2: parameters, gradients and optimizer state sharded inside each node,
each shard's gradient compressed across nodes.

With ``N`` nodes of ``S`` ranks, the model is sharded by ``fully_shard`` over the ``"shard"``
dimension of a 2-D device mesh ``(N, S)``: inside a node, FSDP2 all-gathers parameters and
reduce-scatters gradients as usual. Native HSDP would then all-reduce each reduce-scattered shard
across nodes at full precision. Here, FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``,
torch >= 2.7: "custom HSDP") takes that step instead: the node's mean of shard ``s`` of an FSDP
module, ``(1/S) Σ_local g``, goes through the memory, the compressor and the communicator to the
ranks holding shard ``s`` on the other nodes (the mesh's ``"replicate"`` dimension), so

    ĝ_s = (1/N) Σ_nodes D(C((1/S) Σ_local g_s + e_s))        (e_s: this rank's error feedback)

which, with ``compressor="none"``, is native HSDP's ``(1/W) Σ_ranks g_s``. Each FSDP module's flat
shard is one bucket of the roles (seen by PowerSGD and ACP-SGD as its parameters' row-shards, each a
matrix: :func:`row_shards`); its error-feedback and compressor state cover this rank's shard alone,
``1/S`` of the module. Every rank of a replicate group holds the same shard of the same
module and runs the same exchanges in the same order (FSDP2's reduce-scatters follow backward's
order, identical on every rank), so the collectives match.

The hook runs inside FSDP2's reduce, on its all-reduce stream on an accelerator; it returns once the
average is written into FSDP2's buffer, which FSDP2 then views as each parameter's sharded gradient.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .bucket import Bucket, join_by_parameter
from .communicators import RunningExchange
from .components import Components
from .gradient_sync_state import resharded
from .synchronizer import Synchronizer
from .telemetry import StepTelemetry, TelemetryLog, add_exchange

#: the mesh dimensions: across nodes (the compressed exchange) and inside a node (FSDP2's shards)
MESH_DIMS = ("replicate", "shard")


def has_fsdp2_hook() -> bool:
    """Whether this torch has FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``, 2.7)."""
    from torch.distributed import fsdp

    return hasattr(getattr(fsdp, "FSDPModule", None), "set_all_reduce_hook")


def require_fsdp2_hook() -> None:
    """Refuse a torch without FSDP2's all-reduce hook."""
    if not has_fsdp2_hook():
        raise RuntimeError(
            f"sharded training needs torch >= 2.7 (FSDP2's all-reduce hook); this is {torch.__version__}"
        )


def fsdp_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP2 modules of ``module`` (``fully_shard`` applied), by qualified name, outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [(name, m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def shard_by_policy(
    module: nn.Module, mesh: Any, classes: tuple[type, ...] | None, *, through_root: bool, **options: Any
) -> None:
    """``fully_shard`` over ``mesh`` every submodule of a class in ``classes`` (None: every one that
    holds parameters of its own), innermost first, then the module that encloses them:

    - ``through_root=True`` (a model called as ``model(x)``, as under Accelerate): ``module``
      itself, whose unit holds whatever parameters the others leave;
    - ``through_root=False`` (a LightningModule, whose ``training_step`` calls its children, not its
      own forward, so that the root's hooks would never gather its parameters): every direct child
      of ``module`` that holds parameters; parameters of the root's own are refused.

    A module holding a parameter tied to another module's (BERT's decoder and word embeddings) is
    left to its enclosing unit, since FSDP2 must hold a tied parameter in one unit. ``options`` go to
    every ``fully_shard`` (``mp_policy``)."""
    from torch.distributed.fsdp import fully_shard

    if not through_root and any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"{type(module).__name__} holds parameters of its own, which FSDP2 would gather only in its forward; "
            "keep them in a submodule, or shard the model in configure_model"
        )
    holders: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1

    def chosen(m: nn.Module) -> bool:
        own = list(m.parameters(recurse=False))
        if any(holders[id(p)] > 1 for p in own):
            return False
        return isinstance(m, classes) if classes is not None else bool(own)

    enclosing = [module] if through_root else [m for m in module.children() if any(True for _ in m.parameters())]
    units = [m for m in module.modules() if m is not module and m not in enclosing and chosen(m)]
    for m in [*reversed(units), *enclosing]:
        fully_shard(m, mesh=mesh, **options)


def check_sharded_model(module: nn.Module, mesh: Any) -> list[tuple[str, nn.Module]]:
    """``module``'s FSDP2 modules, after refusing a torch without FSDP2's hook, a mesh whose
    dimensions are not :data:`MESH_DIMS` and a module that FSDP2 has not sharded."""
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(
            f"mesh dimensions = {mesh.mesh_dim_names!r} are invalid; allowed: {MESH_DIMS!r} (nodes, then the "
            "ranks of a node)"
        )
    require_fsdp2_hook()
    modules = fsdp_modules(module)
    if not modules:
        raise ValueError(
            "the module has no FSDP2 module: call torch.distributed.fsdp.fully_shard(..., mesh=mesh['shard']) "
            "on it (and on its blocks) first"
        )
    return modules


def row_shards(fsdp_module: nn.Module, names: dict[int, str]) -> tuple[list[str], list[torch.Size]]:
    """The parameters' names and the shapes of their row-shards, in the order FSDP2's reduce-scatter
    output of ``fsdp_module`` lays them end to end: each parameter's rows are padded with zeros to a
    multiple of the ``S`` ranks of a node, and this rank holds ``rows / S`` of them (FSDP2's
    ``padded_sharded_param_size``). ``names`` maps a sharded parameter's ``id`` to its name.

    FSDP2 says the layout only through its parameter group (``FSDPParam``, torch 2.7 to 2.14):
    PowerSGD needs it to see each row-shard as a matrix."""
    group = fsdp_module._get_fsdp_state()._fsdp_param_group
    out_names, shapes = [], []
    for fsdp_param in group.fsdp_params if group is not None else []:
        if fsdp_param.fsdp_placement.dim != 0:
            raise ValueError(
                f"shard placement = {fsdp_param.fsdp_placement!r} is invalid for a compressor of matrices; "
                "allowed: Shard(0), FSDP2's default (no shard_placement_fn)"
            )
        out_names.append(names[id(fsdp_param.sharded_param)])
        shapes.append(torch.Size(fsdp_param.padded_sharded_param_size))
    return out_names, shapes


def shard_place(mesh: Any) -> list[int]:
    """``[S, s]``: the ranks of a node and this rank's place among them, saved with its state."""
    return [mesh["shard"].size(), mesh["shard"].get_local_rank()]


def check_shard_place(saved: list[int], place: list[int]) -> None:
    """Refuse the state of another shard: FSDP2's shards change with the ranks of a node."""
    if list(saved) != list(place):
        raise ValueError(
            f"the state saved by shard {saved[1]} of {saved[0]} cannot be loaded by shard {place[1]} of "
            f"{place[0]}; sharded state resumes on another number of nodes, with the same ranks per node"
        )


def same_shard(states: Iterable[dict[str, Any]], place: list[int]) -> Iterator[dict[str, Any]]:
    """The old ranks' states that held this rank's shard (one a node), read one at a time."""
    for state in states:
        if state["shard"][0] != place[0]:
            check_shard_place(state["shard"], place)
        if state["shard"][1] == place[1]:
            yield state


class ShardedSynchronizer(Synchronizer):
    """Averages the sharded gradients of ``module`` (already ``fully_shard``-ed over
    ``mesh["shard"]``) across ``mesh["replicate"]`` through ``components``' compressor, memory and
    communicator (see the module's docstring). ``mesh`` is a 2-D ``DeviceMesh`` with the dimensions
    :data:`MESH_DIMS`."""

    def __init__(self, module: nn.Module, components: Components, mesh: Any) -> None:
        self.modules = check_sharded_model(module, mesh)
        self.module = module
        self.compressor = components.compressor
        self.memory = components.memory
        self.communicator = components.communicator
        self.communicator.bind(mesh["replicate"].get_group())
        self.place = shard_place(mesh)
        self.compressor.bind(self.communicator.world_size, self.communicator.rank)
        #: this rank's place in the whole mesh (each rank holds shards of its own)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.step = 0
        self.telemetry = TelemetryLog()
        self._step_telemetry = StepTelemetry()
        self.buckets: dict[int, Bucket] = {}
        self._pending: dict[str, Any] | None = None  # a loaded state, applied as each bucket appears
        self.compressor.begin_step(self.step)
        for b, (_, fsdp_module) in enumerate(self.modules):
            fsdp_module.set_all_reduce_hook(self._hook_for(b))

    def _hook_for(self, b: int):
        def hook(reduce_output: Tensor) -> None:
            self._exchange(b, reduce_output)

        return hook

    def _bucket(self, b: int, shard: Tensor) -> Bucket:
        """FSDP module ``b``'s bucket: its flat shard, seen by a compressor of matrices as the
        parameters' row-shards (:func:`row_shards`)."""
        bucket = self.buckets.get(b)
        if bucket is None or bucket.numel != shard.numel():
            name, fsdp_module = self.modules[b]
            names, shapes = [name or "<root>"], [shard.shape]
            if self.compressor.works_on_matrices:
                names, shapes = row_shards(fsdp_module, {id(p): n for n, p in self.module.named_parameters()})
            bucket = Bucket(b, names, shapes, shard.dtype, shard.device)
            if bucket.numel != shard.numel():
                raise RuntimeError(
                    f"FSDP module {name!r}: the row-shards of its parameters hold {bucket.numel} elements, its "
                    f"reduced shard {shard.numel()}; this torch lays FSDP2's shards out in another way"
                )
            self.buckets[b] = bucket
            if self._pending is not None:
                self._load_into(bucket, self._pending)
        return bucket

    def _exchange(self, b: int, shard: Tensor) -> None:
        """The node's mean of this rank's shard of FSDP module ``b`` becomes the mean over all ranks."""
        bucket = self._bucket(b, shard)
        running = RunningExchange(self.memory.exchange(self.compressor, shard, bucket, self.communicator))
        average, _ = running.finish()
        if average.data_ptr() != shard.data_ptr():
            shard.copy_(average)
        add_exchange(self._step_telemetry, bucket.nbytes, running)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate sharded gradients with no reduction at all (FSDP2's
        ``set_requires_gradient_sync(False)``): neither inside the node nor across nodes."""
        _, root = self.modules[0]
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def after_optimizer_step(self) -> None:
        self.step += 1
        self._step_telemetry.extra = self.compressor.pop_metrics()
        self.telemetry.record(self._step_telemetry)
        self._step_telemetry = StepTelemetry()
        self.compressor.begin_step(self.step)

    def close(self) -> None:
        for _, fsdp_module in self.modules:
            fsdp_module.set_all_reduce_hook(None)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state for its shards, on the CPU."""
        buckets = list(self.buckets.values())
        on_cpu = {
            role: {k: {n: t.detach().cpu() for n, t in v.items()} for k, v in r.state_by_parameter(buckets).items()}
            for role, r in (("memory", self.memory), ("compressor", self.compressor))
        }
        extra = self.compressor.extra_state()
        return {"format": "sharded-1", "step": self.step, "shard": self.place, **on_cpu, "compressor_extra": extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's :meth:`state_dict`; the state of a shard whose bucket FSDP2 has not
        reduced yet (a resume before the first backward) is applied when it first is."""
        check_shard_place(state["shard"], self.place)
        self.step = int(state["step"])
        self.compressor.load_extra_state(state["compressor_extra"])
        self.compressor.begin_step(self.step)
        self.memory.buffers, self.compressor.buffers = {}, {}
        self._pending = state
        for bucket in self.buckets.values():
            self._load_into(bucket, state)

    def _load_into(self, bucket: Bucket, state: dict[str, Any]) -> None:
        for role, values in ((self.memory, state["memory"]), (self.compressor, state["compressor"])):
            for name, tensors in values.items():
                role.buffers.setdefault(name, {}).update(join_by_parameter([bucket], tensors, bucket.device))

    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Whether the roles keep state: then every rank keeps its own shards' (the same answer on
        every rank, since every rank runs the same roles on the same FSDP2 modules)."""
        return bool(state["memory"] or state["compressor"])

    def load_states_of(self, states: Iterable[dict[str, Any]], world_size: int) -> None:
        """Start from a run on another number of nodes of as many ranks: the resharding rule of the
        replicated synchroniser (:func:`~gc_strategy.gradient_sync_state.resharded`) over the old
        nodes' ranks that held this rank's shard, ``e_s = (1/N) Σ_nodes e_{n,s}``, so the correction
        the nodes apply together is the old one."""
        self.load_state_dict({**resharded(same_shard(states, self.place)), "shard": self.place})
