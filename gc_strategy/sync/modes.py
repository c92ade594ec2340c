"""``sync=``: when the replicas synchronise, as registered, validated configuration objects that
build their own synchroniser.

A sync mode is a :class:`SyncMode` registered by name in :data:`SYNC_MODES`, as the roles are in
theirs: :class:`EveryStep` averages every optimizer step's gradients (the default); :class:`DiLoCo`
runs ``inner_steps`` local steps, then a compressed outer step (:mod:`gc_strategy.sync.diloco.synchronizer`). Its
options, defaults and ranges are declared once, in ``OPTIONS``, and checked as a role's options are,
before any work, with a message that names the option, the value and what is allowed.

Each mode builds its :class:`~gc_strategy.sync.base.Synchronizer` for a placement of the model
(``mode.build(module, components, placement)``, as torchtitan's configurations build their
objects): :class:`Replicated`, every rank holding the whole model (``gc_fused``, Accelerate's DDP
path, a plain loop), or :class:`Sharded`, FSDP2 inside each node (``gc_fsdp``, Accelerate's FSDP2
path). The integrations call ``build`` and the synchroniser's interface, and ask a mode what they
must know of it through its class attributes (:attr:`SyncMode.fixed_roles`,
:attr:`SyncMode.one_optimizer`): a mode registered in the user's own code works in every
integration with no edit to any of them (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..components import DEFAULT_FUSION, Components
from ..registry import Configuration, Option, Registry
from .base import Synchronizer
from .diloco.synchronizer import DiLoCoSynchronizer
from .every_step.synchronizer import GradientSynchronizer
from .fault_tolerance.diloco import FaultTolerantDiLoCo
from .fault_tolerance.every_step import FaultTolerantSynchronizer
from .fault_tolerance.options import FaultTolerance
from .fault_tolerance.sharded import FaultTolerantShardedSynchronizer
from .paths.hierarchy import NodeHierarchy, hierarchy_of, parse_hierarchy
from .sharded.diloco import ShardedDiLoCo
from .sharded.synchronizer import ShardedSynchronizer, refuse_replicated_options

VECTOR_POLICIES = ("bf16", "fp32", "compressed")


def nesterov_sgd(lr: float = 0.7, momentum: float = 0.9) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD where ``momentum`` is 0)."""
    return partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=momentum > 0)


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the whole model: the synchroniser averages over ``hierarchy`` (``"flat"`` or
    a :class:`~gc_strategy.sync.paths.hierarchy.NodeHierarchy`), broadcasts rank 0's buffers before each
    forward where ``broadcast_buffers`` and its parameters at the start where
    ``broadcast_from_rank0``, and, where ``find_unused_parameters``, takes steps in which a
    parameter got no gradient (DDP's options). With ``fault_tolerance`` the ranks of this launch are a
    replica group that the others survive (:mod:`gc_strategy.sync.fault_tolerance.every_step`)."""

    hierarchy: str | NodeHierarchy = "flat"
    broadcast_buffers: bool = True
    broadcast_from_rank0: bool = True
    find_unused_parameters: bool = False
    #: replica groups that survive each other's loss (:mod:`gc_strategy.sync.fault_tolerance.every_step`)
    fault_tolerance: FaultTolerance | None = None


@dataclass(frozen=True)
class Sharded:
    """FSDP2 shards the model inside each node of ``mesh``, a ``("replicate", "shard")`` device mesh
    (:mod:`gc_strategy.sync.sharded.synchronizer`); the model is already ``fully_shard``-ed over
    ``mesh["shard"]`` (None while the setup is only checked). With ``fault_tolerance`` the mesh is
    one node, the ranks of this launch, a replica group that the others survive
    (:mod:`gc_strategy.sync.fault_tolerance.sharded`)."""

    mesh: Any = None
    fault_tolerance: FaultTolerance | None = None


class SyncMode(Configuration):
    """When the replicas synchronise (see the module's docstring). A subclass declares its
    ``OPTIONS``, refuses roles it cannot serve in :meth:`check` and builds its synchroniser in
    :meth:`build`; registered with ``@SYNC_MODES.register("name")``, it is ``sync="name"`` (or an
    instance) in every integration and ``sync=name`` in the app."""

    #: the registered name (set by the registry)
    name: str
    #: whether the roles stay those the run started with (no ``switch_components``: a baseline
    #: phase, a Pufferfish conversion), because the mode's state is made for them
    fixed_roles = False
    #: whether the mode counts the steps of one optimizer (an integration then refuses several)
    one_optimizer = False
    #: whether the mode builds a synchroniser that survives lost replica groups (``fault_tolerance=``)
    fault_tolerant = False
    #: whether it does so for replica groups that shard the model with FSDP2 too
    fault_tolerant_sharded = False

    def check(self, components: Components) -> None:
        """Refuse, before any work, roles the mode cannot serve (none, by default)."""

    def check_fault_tolerant(self) -> None:
        """Refuse, before any work, options that fault tolerance cannot serve (none, by default)."""

    def check_sharded(self) -> None:
        """Refuse, before any work, options that sharded training cannot serve (none, by default)."""

    def check_replica_group(self, ranks: int, name: str = "ranks") -> None:
        """Refuse, before any work, fault-tolerant replica groups of ``ranks`` processes (the
        option the caller sets them with: ``name``) that the mode cannot serve (none, by default)."""

    def build(self, module: nn.Module, components: Components, placement: Replicated | Sharded) -> Synchronizer:
        """The synchroniser of ``module`` with ``components``, placed as ``placement`` says."""
        raise NotImplementedError


#: the sync modes by name
SYNC_MODES: Registry[SyncMode] = Registry("sync mode")


@SYNC_MODES.register("every_step")
class EveryStep(SyncMode):
    """Average the gradients of every optimizer step (``sync="every_step"``): as DDP, through the
    roles (:class:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer`), or across nodes over FSDP2's
    shards (:class:`~gc_strategy.sync.sharded.synchronizer.ShardedSynchronizer`)."""

    fault_tolerant = True
    fault_tolerant_sharded = True

    def build(self, module: nn.Module, components: Components, placement: Replicated | Sharded) -> Synchronizer:
        if isinstance(placement, Sharded) and placement.fault_tolerance is not None:
            return FaultTolerantShardedSynchronizer(module, components, placement.fault_tolerance, placement.mesh)
        if isinstance(placement, Sharded):
            return ShardedSynchronizer(module, components, placement.mesh)
        if placement.fault_tolerance is not None:
            unused = placement.find_unused_parameters
            return FaultTolerantSynchronizer(
                module, components, placement.fault_tolerance, find_unused_parameters=unused
            )
        return GradientSynchronizer(
            module,
            components,
            broadcast_from_rank0=placement.broadcast_from_rank0,
            find_unused_parameters=placement.find_unused_parameters,
            broadcast_buffers=placement.broadcast_buffers,
            hierarchy=placement.hierarchy,
        )


@SYNC_MODES.register("diloco")
class DiLoCo(SyncMode):
    """``inner_steps`` local optimizer steps, then the compressed, error-corrected exchange of the
    pseudo-gradient and an outer step (Douillard et al. 2023; Streaming DiLoCo, Douillard et al.
    2025: ``fragments``, ``overlap_steps``, ``mixing``). ``outer_optimizer`` builds the outer
    optimizer from a list of tensors; by default SGD with Nesterov momentum at ``outer_lr`` and
    ``outer_momentum``. ``vectors``: how 1-D tensors are sent. ``offload``: the outer state in CPU
    memory. docs/diloco.md has each option's meaning."""

    OPTIONS = {
        "inner_steps": Option(None, int, low=1, help="the local optimizer steps between outer steps, e.g. 100"),
        "outer_lr": Option(0.7, float, low=0, low_open=True),
        "outer_momentum": Option(0.9, float, low=0, high=1, high_open=True),
        "outer_optimizer": Option(None, callable, optional=True),
        "fragments": Option(1, int, low=1, choices=("auto",)),
        "overlap_steps": Option(0, int, low=0),
        "mixing": Option(0.5, float, low=0, high=1),
        "vectors": Option("bf16", str, choices=VECTOR_POLICIES),
        "offload": Option(False, bool),
    }
    fixed_roles = True
    one_optimizer = True
    fault_tolerant = True
    fault_tolerant_sharded = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        inner, overlap, fragments = self.inner_steps, self.overlap_steps, self.fragments
        if fragments == "auto" and overlap < 1:
            raise ValueError(
                "DiLoCo: fragments = 'auto' sizes the fragments to hide each exchange behind overlap_steps inner "
                f"steps; option 'overlap_steps' = {overlap} is invalid with it; allowed: 1 to {inner - 1}"
            )
        if fragments != "auto" and fragments > inner:
            raise ValueError(
                f"DiLoCo: option 'fragments' = {fragments} is invalid with inner_steps = {inner}; allowed: 1 to "
                "inner_steps (each fragment is exchanged at its own inner step)"
            )
        if overlap >= inner:
            raise ValueError(
                f"DiLoCo: option 'overlap_steps' = {overlap} is invalid with inner_steps = {inner}; allowed: 0 to "
                f"{inner - 1} (a fragment's exchange must end before its next one starts)"
            )

    def outer(self) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
        """What builds the outer optimizer."""
        return self.outer_optimizer or nesterov_sgd(self.outer_lr, self.outer_momentum)

    def check(self, components: Components) -> None:
        """Refuse roles that cannot serve the outer exchange, before any work."""
        compressor, memory = components.compressor, components.memory
        if compressor.applies_momentum or memory.applies_momentum:
            role = f"compressor '{compressor.name}'" if compressor.applies_momentum else f"memory '{memory.name}'"
            raise ValueError(
                f"sync=DiLoCo with {role}: it applies momentum to each step's gradient, and the outer optimizer "
                "already applies momentum to the pseudo-gradient; use a compressor and memory without momentum"
            )
        if compressor.per_step_schedule:
            raise ValueError(
                f"sync=DiLoCo with compressor '{compressor.name}': it alternates its payloads step by step and "
                "needs consecutive steps' gradients; use e.g. 'powersgd', 'topk' or 'qsgd' for the outer exchange"
            )
        if components.fusion.measured or components.fusion.fixes_tensors:
            raise ValueError(
                f"sync=DiLoCo with fusion={components.fusion.describe()!r}: automatic and file plans are made for "
                f"the backward's gradients of the whole model; use a fixed plan (e.g. fusion={DEFAULT_FUSION!r})"
            )

    def check_sharded(self) -> None:
        """Over FSDP2's shards one outer exchange covers the model: Streaming DiLoCo is not offered."""
        if self.fragments != 1 or self.overlap_steps != 0:
            raise ValueError(
                f"DiLoCo over shards: fragments = {self.fragments!r} and overlap_steps = {self.overlap_steps!r} "
                "are invalid; allowed: fragments=1, overlap_steps=0 (Streaming DiLoCo is not offered over shards)"
            )

    def check_fault_tolerant(self) -> None:
        """Each fragment's exchange is a round of its own, and one round runs at a time: a
        fragment's exchange must end before the next fragment's starts (``overlap_steps`` at most
        the fewest inner steps between two fragments' exchanges); ``fragments="auto"``, chosen from
        the first exchange's timing, would cut the fragments anew in the middle of the rounds."""
        if self.fragments == "auto":
            raise ValueError(
                "fault_tolerance with DiLoCo: option 'fragments' = 'auto' is not supported; allowed: a number of "
                "fragments (each fragment's exchange is a round, and the rounds need the fragments fixed)"
            )
        offsets = [(j + 1) * self.inner_steps // self.fragments for j in range(self.fragments)]
        gap = min(b - a for a, b in zip([offsets[-1] - self.inner_steps, *offsets], offsets))
        if self.overlap_steps > gap:
            raise ValueError(
                f"fault_tolerance with DiLoCo: option 'overlap_steps' = {self.overlap_steps} is invalid with "
                f"inner_steps = {self.inner_steps} and fragments = {self.fragments}; allowed: 0 to {gap} (one round "
                "at a time: a fragment's exchange ends before the next fragment's starts)"
            )

    def build(self, module: nn.Module, components: Components, placement: Replicated | Sharded) -> Synchronizer:
        """Replicated: :class:`~gc_strategy.sync.diloco.synchronizer.DiLoCoSynchronizer` (every replica starts from rank
        0's values, and the inner steps use whichever parameters they use: ``broadcast_from_rank0``
        and ``find_unused_parameters`` do not apply); sharded:
        :class:`~gc_strategy.sync.sharded.diloco.ShardedDiLoCo`; with fault tolerance,
        :class:`~gc_strategy.sync.fault_tolerance.diloco.FaultTolerantDiLoCo`."""
        mesh = placement.mesh if isinstance(placement, Sharded) else None
        if placement.fault_tolerance is not None:
            return FaultTolerantDiLoCo(module, components, self, placement.fault_tolerance, mesh=mesh)
        if mesh is not None:
            return ShardedDiLoCo(module, components, self, mesh)
        return DiLoCoSynchronizer(
            module, components, self, broadcast_buffers=placement.broadcast_buffers, hierarchy=placement.hierarchy
        )


#: how the library's callers name the options :func:`check_setup` refuses (the app names its own keys)
OPTION_NAMES = {
    "fusion": "option fusion",
    "hierarchy": "option hierarchy",
    "find_unused_parameters": "option find_unused_parameters",
    "broadcast_buffers": "option broadcast_buffers",
    "fault_tolerance": "option fault_tolerance",
    "sharding": "sharding",
    "nodes": "num_nodes",
    "ranks": "devices",
}


def check_setup(
    mode: SyncMode,
    components: Components,
    placement: Replicated | Sharded,
    ranks: int | None = None,
    nodes: int = 1,
    switches_roles: bool = False,
    replicated_options: dict[str, Any] | None = None,
    names: dict[str, str] | None = None,
) -> None:
    """Every refusal made before any work, in one place for every integration and the app: the roles
    the mode cannot serve; roles switched during the run (a baseline phase, a Pufferfish conversion)
    where the mode's or the placement's state is made for the roles it started with; sharded, the
    options of replicated training given (``replicated_options``); with fault tolerance, a mode
    without it, options it cannot serve (the mode's, its own:
    :meth:`~gc_strategy.sync.fault_tolerance.options.FaultTolerance.check`) and, where the launch's
    ``ranks`` per machine and ``nodes`` are known, a replica group it cannot serve. ``names``: how
    the caller names the options (:data:`OPTION_NAMES`), for the messages."""
    names = {**OPTION_NAMES, **(names or {})}
    mode.check(components)
    replicated = isinstance(placement, Replicated)
    fault_tolerance = placement.fault_tolerance
    if switches_roles and (mode.fixed_roles or not replicated or fault_tolerance is not None):
        why = "its state" if mode.fixed_roles else "sharding's" if not replicated else "fault tolerance's"
        raise ValueError(
            "switch_components (a baseline phase, a Pufferfish conversion) is not supported with "
            f"sync={mode!r}{'' if replicated else ', sharded'}{', fault_tolerance' if fault_tolerance else ''}: "
            f"{why} is made for the model and roles the run started with"
        )
    if replicated:
        parse_hierarchy(placement.hierarchy)
    else:
        mode.check_sharded()
        refuse_replicated_options(names, **(replicated_options or {}))
    if fault_tolerance is None:
        return
    if not isinstance(fault_tolerance, FaultTolerance):
        raise ValueError(
            f"{names['fault_tolerance']} = {fault_tolerance!r} is invalid; allowed: None or "
            "FaultTolerance(lighthouse=..., replica_group=...)"
        )
    kind = "fault_tolerant" if replicated else "fault_tolerant_sharded"
    if not getattr(mode, kind):
        allowed = sorted(name for name in SYNC_MODES.names() if getattr(SYNC_MODES.get(name), kind))
        sharded = "" if replicated else f" and {names['sharding']}"
        raise ValueError(
            f"fault_tolerance with sync={mode.name!r}{sharded} is not supported; allowed: sync in {allowed}"
        )
    mode.check_fault_tolerant()
    fault_tolerance.check(components, placement.hierarchy if replicated else "flat")
    if nodes != 1:
        raise ValueError(
            f"fault_tolerance with {names['nodes']} = {nodes} is not supported; allowed: 1 (a replica group is the "
            "ranks of one machine: start a group per machine, each with its own replica_group)"
        )
    if ranks is not None:
        mode.check_replica_group(ranks, names["ranks"])


def parse_sync(sync: Any, components: Components) -> SyncMode:
    """``sync=`` (a registered name, or a mode) as a mode, checked against ``components``."""
    if isinstance(sync, str):
        mode = SYNC_MODES.get(sync)
        try:
            sync = mode()
        except ValueError as error:
            raise ValueError(
                f"sync = {sync!r} needs its options ({error}); allowed: sync={mode.__name__}(...) "
                f"(from gc_strategy import {mode.__name__})"
            ) from None
    elif not isinstance(sync, SyncMode):
        raise ValueError(
            f"sync = {sync!r} is invalid; allowed: a registered name ({', '.join(SYNC_MODES.names())}) or a SyncMode"
        )
    sync.check(components)
    return sync


def sync_of(name: str, options: dict[str, Any]) -> SyncMode:
    """The sync mode of a flat command-line configuration (``sync=diloco,inner_steps=20``: the
    app's and the benchmarks')."""
    return SYNC_MODES.get(name)(**options)


def from_command_line(options: dict[str, Any]) -> dict[str, Any]:
    """A flat command-line configuration (``compressor=topk,sync=diloco,inner_steps=5,hierarchy=node,
    node_precision=bf16``: the benchmarks' form) as keyword arguments of the strategy: DiLoCo's and
    the hierarchy's options gathered into ``sync=`` and ``hierarchy=`` objects."""
    sync = options.get("sync", "every_step")
    declared = SYNC_MODES.options(sync)
    rest = {key: value for key, value in options.items() if key not in declared and key != "sync"}
    hierarchy = hierarchy_of(rest.pop("hierarchy", "flat"), rest.pop("node_precision", "full"))
    mode = sync_of(sync, {key: value for key, value in options.items() if key in declared})
    return {**rest, "sync": mode, "hierarchy": hierarchy or "flat"}


def refuse_misplaced_options(options: dict[str, Any]) -> None:
    """Refuse an option of a sync mode's or of the hierarchy's given beside the roles' options,
    saying where it goes."""
    for key in options:
        for name in SYNC_MODES.names():
            mode = SYNC_MODES.get(name)
            if key in mode.OPTIONS:
                raise ValueError(
                    f"{key} is an option of {mode.__name__}; pass sync={mode.__name__}({key}={options[key]!r}, ...)"
                )
        if key == "node_precision" or key in NodeHierarchy.OPTIONS:
            name = "precision" if key == "node_precision" else key
            raise ValueError(
                f"{key} is an option of the hierarchy; pass hierarchy=NodeHierarchy({name}={options[key]!r})"
            )


#: SparseLoCo's chunk and its entries kept per chunk (Sarfi et al. 2025: 64 of every 4096, 1.6%)
SPARSELOCO_CHUNK, SPARSELOCO_KEPT = 4096, 64


def sparseloco(
    inner_steps: int,
    density: float = SPARSELOCO_KEPT / SPARSELOCO_CHUNK,
    chunk: int = SPARSELOCO_CHUNK,
    value_bits: int = 2,
    beta: float = 0.95,
    outer_lr: float = 1.0,
    **diloco: Any,
) -> dict[str, Any]:
    """SparseLoCo (Sarfi et al. 2025, "Communication Efficient LLM Pre-training with SparseLoCo"):
    DiLoCo whose pseudo-gradients ``Δ`` travel as chunked top-k with ``value_bits``-bit values,
    with error feedback that decays by ``β`` in place of the outer momentum:

        e ← β e + Δ        c = Q(TopK_chunk(e))        e ← e − c        θ ← θ − α (1/N) Σ_nodes c

    (``Q``: :class:`~gc_strategy.algos.topk.TopK`'s ``value_bits``; the memory is ``residual``
    with ``beta``; the outer optimizer plain SGD at ``outer_lr = α``). Why: the error feedback
    already accumulates past pseudo-gradients, as the outer momentum would, and the payload is
    about ``density × (value_bits + 16)`` bits per element (2-byte in-chunk indices for chunks of
    up to 32768, and a 32-bit scale per chunk). ``diloco``: further :class:`DiLoCo` options
    (``vectors``, ``offload``)::

        GCFSDPStrategy(**sparseloco(inner_steps=30))
    """
    return {
        "sync": DiLoCo(inner_steps=inner_steps, outer_lr=outer_lr, outer_momentum=0.0, **diloco),
        "compressor": "topk",
        "density": density,
        "chunk": chunk,
        "value_bits": value_bits,
        "memory": "residual",
        "beta": beta,
    }
