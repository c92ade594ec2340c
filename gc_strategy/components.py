"""Build and check the compressor / memory / communicator / fusion combination from names.

Keyword options are routed to every selected role that declares them (``density`` to a sparsifier,
``beta`` to the residual memory, ...); an option that no selected role takes is an error. The
communicator ``auto`` picks ``allreduce`` for summable payloads and ``allgather`` otherwise; an
explicit ``allreduce`` for a compressor whose payloads cannot be summed is refused, and so is an
error-feedback memory on a compressor that keeps its own (PowerSGD, ACP-SGD).
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .algos import COMPRESSORS, MEMORIES, Compressor, Memory
from .bucket import Bucket, BucketState, join_by_parameter, split_by_parameter
from .communicators import COMMUNICATORS, Communicator, Exchange
from .fusion import FusionPlanner, parse_fusion
from .registry import closest, fresh_copy

#: the keywords that choose the roles, which an unknown option may have meant
ROLE_KEYWORDS = ("compressor", "memory", "communicator", "fusion")
#: the fusion plan where none is given: buckets of 25 MB, as DDP's
DEFAULT_FUSION = "bucket_mb:25"


@dataclass
class Components:
    compressor: Compressor
    memory: Memory
    communicator: Communicator
    fusion: FusionPlanner

    def fresh(self) -> Components:
        """The same roles with the same options and fresh state (e.g. for a model whose parameters
        changed); the fusion planner copied, so that a custom one (docs/extending.md) carries over."""
        return Components(
            fresh_copy(self.compressor),
            fresh_copy(self.memory),
            fresh_copy(self.communicator),
            copy.deepcopy(self.fusion),
        )

    def bind(self, group: Any) -> None:
        """Attach the roles to the process group their payloads travel in (``None``: the default
        group): the communicator to the group, the compressor to its size and this rank's place in
        it. The one place the roles are bound; called again where the group changes."""
        self.communicator.bind(group)
        self.compressor.bind(self.communicator.world_size, self.communicator.rank)

    def begin_step(self, step: int) -> None:
        """Before synchronised step ``step`` (0-based, the same on every rank): the compressor's
        schedules (start_iter, warm-ups, per-step draws) move to it."""
        self.compressor.begin_step(step)

    def exchange(self, flat: Tensor, bucket: Bucket) -> Exchange:
        """One bucket's exchange through the roles, one layer down at each call: the memory
        compensates and hands the compressor its input, which encodes and hands the communicator its
        payload; returns ``(average, finite)`` (:meth:`~gc_strategy.algos.base.Memory.exchange`)."""
        return self.memory.exchange(flat, bucket, self.compressor, self.communicator)

    def state_by_parameter(self, buckets: list[Bucket]) -> dict[str, dict[str, dict[str, Tensor]]]:
        """The memory's and the compressor's per-element state over ``buckets``, by role, state name
        and parameter name (``{"memory": {...}, "compressor": {...}}``)."""
        return {key: role.state_by_parameter(buckets) for key, role in self.stateful()}

    def load_state_by_parameter(self, state: dict[str, dict[str, dict[str, Tensor]]], buckets: list[Bucket]) -> None:
        """Lay :meth:`state_by_parameter`'s state (or another run's, by the same names) out over
        ``buckets``; a role missing from ``state`` starts empty."""
        for key, role in self.stateful():
            role.load_state_by_parameter(state.get(key, {}), buckets)

    def slot_state(self, bucket: Bucket, slot: int) -> dict[tuple[str, str], Tensor]:
        """Views of one parameter's slice (``slot`` of ``bucket``) of every per-element state, by
        role and state name."""
        return {
            (key, name): bucket.views(per_bucket[bucket.index])[slot]
            for key, role in self.stateful()
            for name, per_bucket in role.buffers.items()
            if bucket.index in per_bucket
        }

    def keep_buckets(self, keep: Callable[[int], bool]) -> None:
        """Drop the per-element state of the buckets (by index) that ``keep`` refuses."""
        for _, role in self.stateful():
            for per_bucket in role.buffers.values():
                for b in [b for b in per_bucket if not keep(b)]:
                    del per_bucket[b]

    def recut(self, old: Bucket | None, new: Bucket, idle: dict[str, dict[str, dict[str, Tensor]]]) -> None:
        """Lay the state of bucket ``new.index`` out for ``new``, another cut of it: the state of
        ``old`` (its cut so far) goes to ``idle`` by parameter (``{role: {state name: {parameter:
        tensor}}}``), and ``new``'s parameters take theirs from there."""
        for key, role in self.stateful():
            for state_name, per_bucket in role.buffers.items():
                if old is not None and old.index in per_bucket:
                    flat = per_bucket.pop(old.index)
                    idle[key].setdefault(state_name, {}).update(split_by_parameter([old], {old.index: flat}))
            for state_name, held in idle[key].items():
                taken = {n: held.pop(n) for n in new.names if n in held}
                role.buffers.setdefault(state_name, {}).update(join_by_parameter([new], taken, new.device))

    def hold(self) -> None:
        """Hold a rollback point on the per-element state (:meth:`~gc_strategy.bucket.BucketState.hold`)."""
        for _, role in self.stateful():
            role.hold()

    def release(self, keep_changes: bool) -> None:
        """Release the rollback point: keep the per-element state written since, or put it back."""
        for _, role in self.stateful():
            role.release(keep_changes)

    def clear_state(self) -> None:
        """Forget the per-element state (of every bucket)."""
        for _, role in self.stateful():
            role.buffers = {}

    def stateful(self) -> tuple[tuple[str, BucketState], ...]:
        """The roles that keep per-element state, by the key their state is saved under."""
        return (("memory", self.memory), ("compressor", self.compressor))

    def describe(self) -> str:
        return (
            f"compressor={self.compressor.name} memory={self.memory.name} "
            f"communicator={self.communicator.name} fusion={self.fusion.describe()}"
        )


def build_components(
    compressor: str | Compressor = "none",
    memory: str | Memory = "none",
    communicator: str | Communicator = "auto",
    fusion: str | FusionPlanner = DEFAULT_FUSION,
    **options: Any,
) -> Components:
    """Validate everything and build the roles; raises ``ValueError`` with a readable message."""
    registries = [(COMPRESSORS, compressor), (MEMORIES, memory)]
    if communicator != "auto":
        registries.append((COMMUNICATORS, communicator))
    declared: dict[str, list[Any]] = {}
    for registry, choice in registries:
        if isinstance(choice, str):
            for key in registry.options(choice):
                declared.setdefault(key, []).append(registry)
    unknown = sorted(set(options) - set(declared))
    if unknown:
        names = ", ".join(f"{r.role}={c if isinstance(c, str) else type(c).__name__}" for r, c in registries)
        meant = {key: closest(key, [*declared, *ROLE_KEYWORDS]) for key in unknown}
        hints = ", ".join(f"{match}= for {key}" for key, match in meant.items() if match)
        hint = f" (did you mean {hints}?)" if hints else ""
        accepted = f"accepted options: {', '.join(sorted(declared))}" if declared else "they take no options"
        raise ValueError(f"option(s) {', '.join(unknown)} are not taken by {names}{hint}; {accepted}")

    def build(registry: Any, choice: Any, base: type) -> Any:
        if isinstance(choice, base):
            return choice
        mine = {key: value for key, value in options.items() if registry in declared[key]}
        return registry.build(choice, **mine)

    built_compressor = build(COMPRESSORS, compressor, Compressor)
    built_memory = build(MEMORIES, memory, Memory)
    if communicator == "auto":
        communicator = "allreduce" if built_compressor.summable else "allgather"
    built_communicator = build(COMMUNICATORS, communicator, Communicator)
    if built_communicator.sums and not built_compressor.summable:
        raise ValueError(
            f"communicator '{built_communicator.name}' sums payloads element-wise, but compressor "
            f"'{built_compressor.name}' sends payloads that cannot be summed; use communicator='allgather' or "
            "communicator='auto'"
        )
    if built_compressor.allreduce_only and not built_communicator.sums:
        raise ValueError(
            f"compressor '{built_compressor.name}' runs its own allreduce rounds and needs communicator='allreduce' "
            f"(or 'auto'), not '{built_communicator.name}'"
        )
    if built_compressor.keeps_error_feedback and built_memory.local_form is not None:
        raise ValueError(
            f"compressor '{built_compressor.name}' keeps its own error feedback (use_error_feedback=True), and "
            f"memory '{built_memory.name}' would stack a second loop on it; use memory='none', or "
            "use_error_feedback=False to let the memory's feedback act instead"
        )
    if built_communicator.sums and built_compressor.variable_size:
        raise ValueError(
            f"communicator '{built_communicator.name}' needs equal payload sizes on every rank, but compressor "
            f"'{built_compressor.name}' sends variable-size payloads; use communicator='allgather' or "
            "communicator='auto'"
        )
    return Components(built_compressor, built_memory, built_communicator, parse_fusion(fusion))


def parse_options(spec: str, option: str = "configs") -> dict[str, Any]:
    """``"compressor=topk,density=0.01"`` -> ``{"compressor": "topk", "density": 0.01}``: the
    command-line form of a configuration (values read as Python literals, else kept as strings)."""
    options: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, separator, value = item.partition("=")
        if not separator:
            raise ValueError(f"{option}: {spec!r}: {item!r} is not key=value")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()
    return options


def double_momentum(components: Components, optimizers: list[Any]) -> str | None:
    """A warning where a role applies momentum itself (DGC's memory, signum) and an optimizer has
    momentum on as well, which would apply it twice; None otherwise."""
    owner = next((r.name for r in (components.memory, components.compressor) if r.applies_momentum), None)
    if owner is None:
        return None
    for optimizer in optimizers:
        if any(group.get("momentum", 0) or group.get("betas", (0,))[0] for group in optimizer.param_groups):
            return (
                f"'{owner}' applies momentum itself, and the optimizer {type(optimizer).__name__} has momentum "
                "on as well: momentum is applied twice. Set the optimizer's momentum to 0 (DGC, Lin et al. 2018)."
            )
    return None
