"""DiLoCo and Streaming DiLoCo: ``H`` local optimizer steps, then a compressed, error-corrected outer step.

DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models") synchronises every ``H`` inner steps instead of every step. With ``θ`` the outer
parameters, identical on every rank, and ``θ_r`` replica ``r``'s after ``H`` inner steps:

    Δ_r = θ − θ_r                                     (the pseudo-gradient)
    Δ̄  = (1/W) Σ_r D(C(Δ_r + e_r))                     (compressor C, error feedback e_r: as for gradients)
    θ  ← OuterOpt(θ, Δ̄)                               (SGD with Nesterov momentum, lr 0.7, momentum 0.9)
    θ_r ← θ                                           (every rank continues from the same values)

The exchange of ``Δ`` is a :class:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer` with
``on_backward=False``: the configured compressor, memory and communicator over fused buckets, and
the hierarchy where on. Error feedback therefore acts on ``Δ``: what compression dropped from one
outer step's pseudo-gradient is added to the next one's.

Streaming DiLoCo (Douillard et al., 2025, "Streaming DiLoCo with overlapping communication") splits
the parameters into ``k`` fragments of about equal bytes (the fusion planner's ``groups:k``), in the
module's order. Fragment ``j`` is exchanged after inner steps ``t ≡ (j + 1)·H/k (mod H)``, so each
fragment is exchanged once every ``H`` steps and the exchanges are spread over the ``H`` steps. With
``overlap_steps = τ > 0`` the exchange started after step ``t`` runs during inner steps
``t+1 … t+τ`` and is applied after step ``t + τ``, mixing the fragment's local and outer values:
``θ_r ← α θ_r + (1 − α) θ`` (``mixing = α``, 0.5 in the paper). With ``τ = 0`` the replicas
continue from ``θ`` itself and are identical after each outer step.

1-D tensors (biases, norms' scales) are few bytes and compress poorly; by default their ``Δ`` is
sent at bf16 with no error feedback (``vectors="bf16"``; ``"fp32"``: uncompressed;
``"compressed"``: with the configured compressor like the rest).

Buffers are not optimised, so they have no outer value. After each outer step, with
``broadcast_buffers=True``, floating-point buffers (BatchNorm's running statistics) become their
mean over the replicas and the others (counters) rank 0's: the statistics of all replicas' inner
phases, as the outer parameters are. Rank 0's alone would describe one replica's trajectory.

The outer state (``θ``, the outer optimizer's momentum) is kept in fp32, on the parameters' device
or, with ``offload=True``, in CPU memory, so that accelerator memory does not hold a second copy
of the model; with ``offload=True`` the error-feedback and compressor state also waits in CPU
memory between its fragment's exchanges.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...components import Components, build_components
from ...fusion import parse_fusion
from ...fusion.fragments import fragments_to_overlap
from ...registry import Configuration
from ...telemetry import StepTelemetry, TelemetryLog, add_into
from ..base import Synchronizer
from ..every_step.synchronizer import GradientSynchronizer
from ..paths.collectives import average_buffers
from ..paths.hierarchy import NodeHierarchy

STATE_FORMAT = "diloco-1"


def roles_by_dimension(
    named: list[tuple[str, nn.Parameter]], components: Components, vectors: str
) -> Iterator[tuple[list[str], Components]]:
    """Parameters by the roles that exchange their Δ, each group with fresh roles: 1-D tensors
    apart (at bf16, or fp32 with ``vectors="fp32"``, with no error feedback) unless
    ``vectors="compressed"``."""
    if vectors == "compressed":
        yield [n for n, _ in named], components.fresh()
        return
    matrices = [n for n, p in named if p.dim() > 1]
    others = [n for n, p in named if p.dim() <= 1]
    if matrices:
        yield matrices, components.fresh()
    if others:
        dense = "bf16" if vectors == "bf16" else "none"
        yield others, build_components(dense, "none", "auto", copy.deepcopy(components.fusion))


class _Fragment:
    """Parameters exchanged together at one inner step of every ``H``: their outer values and the
    synchronisers that average their ``Δ`` (matrices with the configured roles, vectors apart)."""

    def __init__(self, index: int, offset: int, names: list[str], params: list[nn.Parameter], outer: list[Tensor]):
        self.index = index
        self.offset = offset
        self.names = names
        self.params = params
        self.outer = outer
        self.synchronizers: list[GradientSynchronizer] = []
        #: the inner step after which the running exchange started (None: none is running)
        self.started: int | None = None
        #: the averaged Δ of a finished exchange not applied yet (a checkpoint was taken meanwhile)
        self.averaged: list[Tensor] | None = None


class DiLoCoSynchronizer(Synchronizer):
    """Synchronise ``module`` as ``config`` (:class:`~gc_strategy.sync.modes.DiLoCo`) says: every
    ``inner_steps`` optimizer steps (see the module's docstring), over ``hierarchy`` (as for
    :class:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer`).

    Call :meth:`after_optimizer_step` after every inner optimizer step on every rank (the Lightning
    strategy and the Accelerate integration do).
    """

    def __init__(
        self,
        module: nn.Module,
        components: Components,
        config: Configuration,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        hierarchy: str | NodeHierarchy = "flat",
    ) -> None:
        config.check(components)
        self.module = module
        self.components = components
        self.vectors = config.vectors
        self.hierarchy = hierarchy
        self.inner_steps = config.inner_steps
        self.overlap_steps = config.overlap_steps
        self.mixing = float(config.mixing)
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group
        self.named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not self.named:
            raise ValueError("the module has no parameter with requires_grad=True: nothing to synchronise")
        self.offload = offload = config.offload
        fragments = config.fragments
        outer_device = torch.device("cpu") if offload else self.named[0][1].device
        #: θ, by parameter name: fp32, where the outer state lives (filled after rank 0's broadcast)
        self.outer = {n: torch.empty(p.shape, dtype=torch.float32, device=outer_device) for n, p in self.named}
        #: fragments="auto": the count is chosen from the first outer exchange (see :meth:`_choose_fragments`)
        self.auto_fragments = fragments == "auto"
        self._step_times: list[float] = []
        self._clock: float | None = None
        #: fragments="auto": the count chosen, and the timings it was chosen from (None until then)
        self.chosen_fragments: int | None = None
        self.fragment_timings: dict[str, float] | None = None
        self.fragments: list[_Fragment] = []
        self._build_fragments(1 if self.auto_fragments else fragments, broadcast=True)
        for outer, (_, p) in zip(self.outer.values(), self.named):  # after the broadcast of rank 0's parameters
            outer.copy_(p.detach())
        first = self.fragments[0].synchronizers[0]
        self.world_size, self.rank = first.world_size, first.rank
        self.outer_optimizer = config.outer()(list(self.outer.values()))
        #: inner optimizer steps taken
        self.inner_step = 0
        #: outer exchanges completed (one per fragment exchange)
        self.step = 0
        self.telemetry = TelemetryLog()
        #: the inner optimizers whose per-rank state a checkpoint keeps (the strategies set them)
        self.inner_optimizers: list[torch.optim.Optimizer] = []
        self.loaded_inner_optimizers: list[dict[str, Any]] = []

    def _build_fragments(self, count: int, broadcast: bool = False) -> None:
        """Cut the parameters into ``count`` fragments of about equal bytes, each with its
        synchronisers, carrying the roles' state over by parameter name from the fragments before
        (``broadcast``: the first synchroniser copies rank 0's parameters and buffers to every rank)."""
        previous = self.synchronizers
        by_role = [s.roles.state_by_parameter(s.buckets) for s in previous]
        states = {key: _merged(state[key] for state in by_role) for key in {k for state in by_role for k in state}}
        sizes = [p.numel() * p.element_size() for _, p in self.named]
        per_fragment = parse_fusion(f"groups:{count}").plan(sizes)
        self.fragments = []
        start = 0
        for j, size in enumerate(per_fragment):
            chunk = self.named[start : start + size]
            start += size
            names = [n for n, _ in chunk]
            offset = (j + 1) * self.inner_steps // len(per_fragment)
            fragment = _Fragment(j, offset, names, [p for _, p in chunk], [self.outer[n] for n in names])
            for group, roles in roles_by_dimension(chunk, self.components, self.vectors):
                synchronizer = GradientSynchronizer(
                    self.module,
                    roles,
                    process_group=self.process_group,
                    broadcast_from_rank0=broadcast,
                    broadcast_buffers=False,
                    parameters=group,
                    on_backward=False,
                    hierarchy=self.hierarchy,
                )
                if previous:
                    synchronizer.roles.load_state_by_parameter(states, synchronizer.buckets)
                fragment.synchronizers.append(synchronizer)
                broadcast = False
            self.fragments.append(fragment)

    # ------------------------------------------------------------------ the schedule
    def after_optimizer_step(self) -> None:
        """After each inner optimizer step: start the exchanges due now, and apply those that have
        overlapped ``overlap_steps`` inner steps (at once where it is 0)."""
        self.inner_step += 1
        choosing = self.auto_fragments and self.step == 0
        if choosing:  # time the inner steps of the first period (the exchanges left out)
            now = time.perf_counter()
            if self._clock is not None:
                self._step_times.append(now - self._clock)
        for fragment in self.fragments:
            if self._due(fragment):
                self._start(fragment)
                if choosing:
                    self._choose_fragments(fragment)
        for fragment in self.fragments:
            if fragment.started is not None and self.inner_step == fragment.started + self.overlap_steps:
                self._apply(fragment)
                if choosing and self.chosen_fragments is not None:
                    self._build_fragments(self.chosen_fragments)
                    for new in self.fragments:  # a new fragment due at this very step
                        if self._due(new):
                            self._start(new)
        if choosing:
            self._clock = time.perf_counter()

    def _due(self, fragment: _Fragment) -> bool:
        """Whether the fragment's exchange starts after the current inner step."""
        return self.inner_step % self.inner_steps == fragment.offset % self.inner_steps

    def _choose_fragments(self, fragment: _Fragment) -> None:
        """``fragments="auto"``: time the first outer exchange (all parameters, run to completion
        now; it is still applied ``overlap_steps`` later) and choose the fragment count with
        :func:`~gc_strategy.fusion.fragments.fragments_to_overlap`, from the slowest rank's
        timings, so that every rank chooses the same."""
        started = time.perf_counter()
        self._collect(fragment)
        timings = torch.tensor(
            [time.perf_counter() - started, statistics.median(self._step_times or [float("inf")])],
            dtype=torch.float64,
        )
        if self.world_size > 1:
            dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=self.process_group)
        exchange_s, step_s = timings.tolist()
        self.chosen_fragments = fragments_to_overlap(exchange_s, step_s, self.overlap_steps, self.inner_steps)
        self.fragment_timings = {"exchange_s": exchange_s, "inner_step_s": step_s}

    def _start(self, fragment: _Fragment) -> None:
        """Launch the exchange of ``Δ_r = θ − θ_r`` for the fragment's parameters."""
        kept = [p.grad for p in fragment.params]
        self._move_role_state(fragment, fragment.params[0].device)
        with torch.no_grad():
            for p, outer in zip(fragment.params, fragment.outer):
                p.grad = outer.to(p.device, p.dtype, non_blocking=True) - p
        try:
            for synchronizer in fragment.synchronizers:
                synchronizer.start_synchronize()
        finally:
            for p, grad in zip(fragment.params, kept):
                p.grad = grad
        fragment.started = self.inner_step

    def _move_role_state(self, fragment: _Fragment, device: torch.device) -> None:
        """``offload=True``: the fragment's error-feedback and compressor state lives in CPU memory
        between its exchanges, on the parameters' device during one."""
        if self.offload:
            for synchronizer in fragment.synchronizers:
                synchronizer.memory.move_state(device)
                synchronizer.compressor.move_state(device)

    def _collect(self, fragment: _Fragment) -> list[Tensor]:
        """Wait for the fragment's exchange; its averaged ``Δ̄`` (kept until applied)."""
        if fragment.averaged is None:
            kept = [p.grad for p in fragment.params]
            try:
                for synchronizer in fragment.synchronizers:
                    synchronizer.finish_synchronize()
                fragment.averaged = [p.grad.detach().clone() for p in fragment.params]
            finally:
                for p, grad in zip(fragment.params, kept):
                    p.grad = grad
            self._move_role_state(fragment, torch.device("cpu"))
            self._record_telemetry(fragment)
        return fragment.averaged

    def _apply(self, fragment: _Fragment) -> None:
        """The outer optimizer's step on the fragment, then its parameters from the outer values."""
        averaged = self._collect(fragment)
        for outer, delta in zip(fragment.outer, averaged):
            outer.grad = delta.to(outer.device, torch.float32)
        self.outer_optimizer.step()
        with torch.no_grad():
            for p, outer in zip(fragment.params, fragment.outer):
                outer.grad = None
                value = outer.to(p.device, p.dtype, non_blocking=True)
                if self.overlap_steps == 0:
                    p.copy_(value)
                else:
                    p.mul_(self.mixing).add_(value, alpha=1.0 - self.mixing)
        fragment.started, fragment.averaged = None, None
        self.step += 1
        if self.broadcast_buffers and self.world_size > 1:
            average_buffers(list(self.module.buffers()), self.process_group)

    # ------------------------------------------------------------------ one fragment's exchange, driven from outside
    # Fault tolerance's rounds drive the exchanges themselves (each fragment's a round of its own).
    def due_fragment(self) -> int | None:
        """The fragment whose exchange starts after the current inner step (None: none)."""
        return next((f.index for f in self.fragments if self._due(f)), None)

    def start_outer(self, index: int) -> None:
        """Start fragment ``index``'s exchange of ``Δ`` (its average kept until :meth:`apply_outer`
        or :meth:`drop_outer`)."""
        self._start(self.fragments[index])

    def collect_outer(self, index: int) -> None:
        """Wait for fragment ``index``'s exchange."""
        self._collect(self.fragments[index])

    def apply_outer(self, index: int, scale: float = 1.0) -> None:
        """The outer step on fragment ``index``'s average, ``Δ̄`` times ``scale`` first (fault
        tolerance: a mean over the participants made a mean over those that trained)."""
        fragment = self.fragments[index]
        if scale != 1.0:
            for delta in self._collect(fragment):
                delta.mul_(scale)
        self._apply(fragment)

    def drop_outer(self, index: int) -> None:
        """Forget fragment ``index``'s exchange (one that did not commit)."""
        fragment = self.fragments[index]
        fragment.started, fragment.averaged = None, None

    def replicated_state(self) -> dict[str, Any]:
        """What every replica holds alike after an outer step (a healing one takes it from a peer):
        ``θ``, the outer optimizer, the counters and each synchroniser's
        :meth:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer.replicated_state`."""
        return {
            "outer": self.outer,
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "synchronizers": [s.replicated_state() for s in self.synchronizers],
            "inner_step": self.inner_step,
            "step": self.step,
        }

    def load_replicated_state(self, state: dict[str, Any]) -> None:
        """A peer's :meth:`replicated_state`; the parameters become ``θ``, and this rank's own error
        feedback starts at zero."""
        with torch.no_grad():
            for name, p in self.named:
                self.outer[name].copy_(state["outer"][name])
                p.copy_(self.outer[name])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for synchronizer, replicated in zip(self.synchronizers, state["synchronizers"]):
            synchronizer.load_replicated_state(replicated)
        self.inner_step, self.step = int(state["inner_step"]), int(state["step"])

    def _record_telemetry(self, fragment: _Fragment) -> None:
        merged = StepTelemetry()
        for synchronizer in fragment.synchronizers:
            add_into(merged, synchronizer.telemetry.last)
        self.telemetry.record(merged)

    @property
    def synchronizers(self) -> list[GradientSynchronizer]:
        """Every fragment's synchronisers, in fragment order."""
        return [s for f in self.fragments for s in f.synchronizers]

    # ------------------------------------------------------------------ what the strategies call
    # Inner forwards need nothing (buffers are averaged at each outer step), and inner steps never
    # synchronise, so gradient accumulation needs nothing more: the interface's defaults.
    def use_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The inner optimizers, whose states differ between ranks inside an inner phase."""
        self.inner_optimizers = list(optimizers)

    def close(self) -> None:
        """Wait for exchanges still running, so that no collective is left in flight."""
        for fragment in self.fragments:
            if fragment.started is not None:
                self._collect(fragment)

    # ------------------------------------------------------------------ checkpoints
    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Always: each replica's own module and inner optimizer states differ inside an inner phase."""
        return True

    def state_dict(self) -> dict[str, Any]:
        """This rank's DiLoCo state: the schedule, the outer values and optimizer, the roles' state
        of every synchroniser, the averaged Δ of exchanges not applied yet (collected now, so
        that a resume mid-way through the overlap applies the same values), and this replica's own
        module state and inner optimizer states, which differ between ranks inside an inner phase."""
        running = {f.index: (f.started, self._collect(f)) for f in self.fragments if f.started is not None}
        return {
            "format": STATE_FORMAT,
            "world_size": self.world_size,
            "inner_step": self.inner_step,
            "step": self.step,
            "fragments": len(self.fragments),
            "outer": {name: t.detach().cpu().clone() for name, t in self.outer.items()},
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "synchronizers": [s.state_dict() for s in self.synchronizers],
            "running": {j: (started, [t.cpu() for t in delta]) for j, (started, delta) in running.items()},
            # mid-way through an inner phase each replica's own values differ from rank 0's
            "local": {name: t.detach().cpu().clone() for name, t in self.module.state_dict().items()},
            "inner_optimizers": [o.state_dict() for o in self.inner_optimizers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"the checkpoint's synchroniser state has format {state.get('format')!r}; sync='diloco' needs "
                f"{STATE_FORMAT!r} (was it saved with sync='every_step'?)"
            )
        if self.auto_fragments and state["fragments"] != len(self.fragments):
            self._build_fragments(state["fragments"])  # the count chosen before the checkpoint
        synchronizers = self.synchronizers
        names = [n for f in self.fragments for n in f.names]
        if len(state["synchronizers"]) != len(synchronizers) or sorted(state["outer"]) != sorted(names):
            raise ValueError(
                "the checkpoint's DiLoCo state does not match this configuration (other fragments, vectors "
                "policy or parameters)"
            )
        for synchronizer, saved in zip(synchronizers, state["synchronizers"]):
            synchronizer.load_state_dict(saved)
        with torch.no_grad():
            for name, outer in self.outer.items():
                outer.copy_(state["outer"][name])
        for fragment in self.fragments:
            fragment.started, fragment.averaged = None, None
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for j, (started, delta) in state["running"].items():
            fragment = self.fragments[int(j)]
            fragment.started = started
            fragment.averaged = [t.to(p.device) for t, p in zip(delta, fragment.params)]
        self.inner_step = int(state["inner_step"])
        self.step = int(state["step"])
        self.module.load_state_dict(state["local"])
        self.loaded_inner_optimizers = state["inner_optimizers"]
        self.restore_optimizers()

    def restore_optimizers(self) -> None:
        """This rank's inner optimizer states from the loaded state, once the optimizers exist
        (Lightning restores rank 0's into every rank first)."""
        if self.loaded_inner_optimizers and self.inner_optimizers:
            for optimizer, saved in zip(self.inner_optimizers, self.loaded_inner_optimizers):
                optimizer.load_state_dict(saved)
            self.loaded_inner_optimizers = []


def _merged(states: Iterable[dict[str, dict[str, Tensor]]]) -> dict[str, dict[str, Tensor]]:
    """Per-parameter role states of several synchronisers (disjoint parameters) as one."""
    merged: dict[str, dict[str, Tensor]] = {}
    for state in states:
        for name, tensors in state.items():
            merged.setdefault(name, {}).update(tensors)
    return merged
