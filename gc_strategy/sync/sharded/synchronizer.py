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

which, with ``compressor="none"``, is native HSDP's ``(1/W) Σ_ranks g_s``. Each FSDP module's reduced
shard is one bucket of the roles, laid out as the shards of the parameters that reduction holds
(:mod:`gc_strategy.sync.sharded.layout`: FSDP2 leaves out a frozen parameter, and one that got no gradient
in this step), each a matrix for PowerSGD and ACP-SGD; its error-feedback and compressor state cover
this rank's shard alone, ``1/S`` of the module, and follow each parameter from reduction to
reduction. Every rank of a replicate group holds the same shard of the same module and runs the
same exchanges in the same order (FSDP2's reduce-scatters follow backward's order, identical on
every rank), so the collectives match, provided that every node uses the same parameters in a step,
as native HSDP requires too.

The hook runs inside FSDP2's reduce, on its all-reduce stream on an accelerator; it returns once the
average is written into FSDP2's buffer, which FSDP2 then views as each parameter's sharded gradient.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...bucket import Bucket, split_by_parameter
from ...communicators import RunningExchange
from ...components import DEFAULT_FUSION, Components
from ...telemetry import StepTelemetry, TelemetryLog, add_exchange
from ..base import Synchronizer
from ..every_step.state import resharded
from ..paths.routes import FlatRoute, Route
from .layout import ReducedParameters

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


def refuse_replicated_options(
    names: Mapping[str, str],
    fusion: Any = DEFAULT_FUSION,
    hierarchy: Any = "flat",
    find_unused_parameters: Any = False,
    broadcast_buffers: Any = False,
) -> None:
    """Refuse, before any work, the options of replicated training that sharded training does not
    take (through ``gc_fsdp``, Accelerate and the app alike), each named as the caller calls it
    (``names``: ``{"fusion": "option fusion", "sharding": "sharding", ...}``)."""
    require_fsdp2_hook()
    refused = (
        ("fusion", fusion, fusion != DEFAULT_FUSION, f"{DEFAULT_FUSION!r} (each FSDP2 module's shard is one bucket)"),
        ("hierarchy", hierarchy, hierarchy != "flat", "'flat' (the mesh's nodes are the hierarchy)"),
        (
            "find_unused_parameters",
            find_unused_parameters,
            bool(find_unused_parameters),
            "False (each reduction holds the parameters that got a gradient, whatever the option)",
        ),
        ("broadcast_buffers", broadcast_buffers, bool(broadcast_buffers), "False (FSDP2 keeps each rank's buffers)"),
    )
    for name, value, wrong, allowed in refused:
        if wrong:
            raise ValueError(f"{names[name]} = {value!r} is invalid with {names['sharding']}; allowed: {allowed}")


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
    :data:`MESH_DIMS`. A replica group of fault tolerance is a mesh of one node whose exchange
    across the groups runs over the quorum's route (:meth:`rebind`)."""

    def __init__(self, module: nn.Module, components: Components, mesh: Any) -> None:
        self.modules = check_sharded_model(module, mesh)
        self.module = module
        self.roles = components
        self.compressor = components.compressor
        self.memory = components.memory
        self.communicator = components.communicator
        #: how each shard travels to the ranks holding it on the other nodes
        self.route: Route = FlatRoute(mesh["replicate"].get_group())
        components.bind(self.route.group)
        self.place = shard_place(mesh)
        #: this rank's place in the whole mesh (each rank holds shards of its own)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.step = 0
        self.telemetry = TelemetryLog()
        self._step_telemetry = StepTelemetry()
        self.reduced = ReducedParameters(self.modules, {id(p): n for n, p in module.named_parameters()})
        self.buckets: dict[int, Bucket] = {}
        #: the roles' per-element state of the parameters outside every bucket (not reduced in the
        #: last reduction of their unit, or loaded before it): {role: {state name: {parameter: tensor}}}
        self._idle: dict[str, dict[str, dict[str, Tensor]]] = {"memory": {}, "compressor": {}}
        self.roles.begin_step(self.step)
        for b, (_, fsdp_module) in enumerate(self.modules):
            fsdp_module.set_all_reduce_hook(self._hook_for(b))

    def rebind(self, route: Route) -> None:
        """Exchange over ``route`` from the next reduction on (fault tolerance's new quorum: the
        ranks holding this shard in the other replica groups): the roles bound to its group and
        checked again."""
        self.route = route
        self.roles.bind(route.group)
        self.compressor.check_group(route.group, self._whole_units())

    def _whole_units(self) -> list[Bucket]:
        """Each unit's bucket as a reduction that holds all its trainable parameters: the same on
        every rank holding this shard, whatever reductions it has seen (a group that has just
        joined has seen none)."""
        device = next(self.module.parameters()).device
        layouts = [self.reduced.trainable(b) for b in range(len(self.modules))]
        return [Bucket(b, names, shapes, torch.float32, device) for b, (names, shapes) in enumerate(layouts) if names]

    def _hook_for(self, b: int):
        def hook(reduce_output: Tensor) -> None:
            self._exchange(b, reduce_output)

        return hook

    def _bucket(self, b: int, shard: Tensor) -> Bucket:
        """FSDP module ``b``'s bucket: its flat shard, seen as the shards of the parameters this
        reduction holds (:class:`~gc_strategy.sync.sharded.layout.ReducedParameters`; row-shards, each a
        matrix, for a compressor of matrices). Where they are other parameters than last time, the
        roles' per-element state follows the parameters: a parameter left out keeps its state for
        the reduction that next holds it."""
        names, shapes = self.reduced.layout(b, self.compressor.works_on_matrices)
        bucket = self.buckets.get(b)
        if bucket is not None and bucket.names == names and bucket.shapes == shapes:
            return bucket
        bucket = Bucket(b, names, shapes, shard.dtype, shard.device)
        if bucket.numel != shard.numel():
            raise RuntimeError(
                f"FSDP module {self.modules[b][0]!r}: the shards of the parameters it reduces ({', '.join(names)}) "
                f"hold {bucket.numel} elements, its reduced shard {shard.numel()}; this torch lays FSDP2's shards out "
                "in another way"
            )
        self.roles.recut(self.buckets.get(b), bucket, self._idle)
        self.buckets[b] = bucket
        return bucket

    def _exchange(self, b: int, shard: Tensor) -> None:
        """The node's mean of this rank's shard of FSDP module ``b`` becomes the mean over all ranks."""
        bucket = self._bucket(b, shard)
        running = RunningExchange(self.route.exchange(shard, bucket, self.roles))
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
        self.roles.begin_step(self.step)

    def close(self) -> None:
        self.reduced.close()
        for _, fsdp_module in self.modules:
            fsdp_module.set_all_reduce_hook(None)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state for its shards, by parameter, on the CPU."""
        on_cpu: dict[str, dict[str, dict[str, Tensor]]] = {}
        for key, by_parameter in self.roles.state_by_parameter(list(self.buckets.values())).items():
            for state_name, idle in self._idle[key].items():
                by_parameter.setdefault(state_name, {}).update(idle)
            on_cpu[key] = {k: {n: t.detach().cpu() for n, t in v.items()} for k, v in by_parameter.items() if v}
        extra = self.compressor.extra_state()
        return {"format": "sharded-2", "step": self.step, "shard": self.place, **on_cpu, "compressor_extra": extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's :meth:`state_dict`; each parameter's state goes into the bucket that
        next holds it (a resume before the first backward: the first reduction of its unit)."""
        check_shard_place(state["shard"], self.place)
        self.step = int(state["step"])
        self.compressor.load_extra_state(state["compressor_extra"])
        self.roles.begin_step(self.step)
        self.buckets = {}
        self.roles.clear_state()
        for key, _ in self.roles.stateful():
            self._idle[key] = {name: self._by_parameter(dict(tensors)) for name, tensors in state[key].items()}

    def _by_parameter(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """A state saved in format ``sharded-1``, by FSDP module for the flat compressors, split
        into its parameters' shards (which that format's buckets held, all of them, end to end)."""
        for b, (name, _) in enumerate(self.modules):
            flat = tensors.pop(name or "<root>", None)
            if flat is not None:
                names, shapes = self.reduced.trainable(b)
                tensors.update(split_by_parameter([Bucket(b, names, shapes, flat.dtype, flat.device)], {b: flat}))
        return tensors

    def replicated_state(self) -> dict[str, Any]:
        """What the ranks holding this shard in every replica hold alike: all but their own error
        feedback and compressor state."""
        return {**self.state_dict(), "memory": {}, "compressor": {}}

    def load_replicated_state(self, state: dict[str, Any]) -> None:
        """A peer's :meth:`replicated_state`; this rank's own error feedback starts at zero."""
        self.load_state_dict(state)

    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Whether the roles keep state: then every rank keeps its own shards' (the same answer on
        every rank, since every rank runs the same roles on the same FSDP2 modules)."""
        return bool(state["memory"] or state["compressor"])

    def load_states_of(self, states: Iterable[dict[str, Any]], world_size: int) -> None:
        """Start from a run on another number of nodes of as many ranks: the resharding rule of the
        replicated synchroniser (:func:`~gc_strategy.sync.every_step.state.resharded`) over the old
        nodes' ranks that held this rank's shard, ``e_s = (1/N) Σ_nodes e_{n,s}``, so the correction
        the nodes apply together is the old one."""
        self.load_state_dict({**resharded(same_shard(states, self.place)), "shard": self.place})
