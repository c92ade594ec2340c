"""The gradient synchroniser: hooks, fused buckets and an ordered asynchronous pipeline.

It replaces ``DistributedDataParallel`` for any ``nn.Module`` and process group (no Lightning here).
One synchronised backward (docs/design.md, "How a step runs"):

1. Each trainable parameter's post-accumulate-grad hook copies its gradient into its bucket's flat
   buffer. The first hook of a backward queues the end-of-backward callback on autograd's current
   graph task. Where that task is a nested (reentrant) backward, e.g. inside
   ``torch.utils.checkpoint(..., use_reentrant=True)``, the callback does not finish the step: it
   re-queues itself on the enclosing backward once the node running the nested one returns, so the
   step finishes exactly once, at the end of the outermost backward.
2. When bucket ``k`` is complete and buckets ``0..k-1`` have been launched, bucket ``k`` launches:
   ``memory.compensate -> compressor.encode -> communicator`` (asynchronous; on CUDA on a side stream
   that waits for the compute stream). After its first collective is issued, if the bucket holds
   at least ``EAGER_AFTER_BYTES``, earlier buckets waiting on an eager round (``Round.eager``: a
   length handshake, PowerSGD's P) are advanced, so their next collective is issued during
   backward, at the same point on every rank.
3. End of backward: launch what is left (parameters that got no gradient contribute zeros), then,
   where usage has to be known (``find_unused_parameters``, or the first step), one allreduce
   of which parameters each rank used; advance the eager rounds once more, then every bucket's
   exchange to completion in bucket order (later rounds of multi-round methods are issued here, in
   that order), decode, average, ``memory.update`` (skipped for buckets holding inf/NaN), and make
   each ``param.grad`` a view of the averaged bucket (a copy where the dtypes differ).

Buckets follow reverse registration order until the first synchronised backward has recorded the
real gradient-ready order; then rank 0's order is broadcast and every rank rebuilds its buckets
(the way DDP rebuilds its buckets after the first iteration).

Semantics, those of ``DistributedDataParallel``:
- Frozen parameters (``requires_grad=False``) are not synchronised at all.
- Unused parameters. With ``find_unused_parameters=True``, a parameter that got no gradient on a
  rank contributes zeros there; where some rank used it, every rank holds the average in ``.grad``
  (also a rank whose ``.grad`` was ``None``); where no rank used it, its ``.grad`` is left as it was
  (``None`` after ``zero_grad()``, so optimizers skip it) and its error-feedback and compressor state
  is restored to what it was before the step. With ``find_unused_parameters=False`` (the default, as
  for DDP) a parameter without a gradient is an error: in the first step on every rank (one small
  allreduce tells them all), later on the rank that saw it, after its exchanges completed.
- Inside :meth:`GradientSynchronizer.no_sync` (gradient accumulation) backward launches nothing;
  gradients accumulate locally and the next synchronised backward averages the accumulated sums. A
  parameter used in any backward since the last synchronisation counts as used.
- Buffers (``broadcast_buffers=True``): rank 0's buffers are broadcast before a forward that follows
  a synchronised, grad-enabled forward (call the forward inside :meth:`GradientSynchronizer.forward_pass`;
  Lightning's strategy and the Accelerate integration do), as DDP does before its forwards.
- Where the averaged bucket has the parameter's dtype, ``.grad`` becomes a view of it (no copy-out;
  like DDP's ``gradient_as_bucket_view``): the gradients of a bucket share one storage, the
  bucket's own gradient buffer (the exchange writes its average there), which the next backward
  writes again. Gradients kept from step to step (``zero_grad(set_to_none=False)``) then
  accumulate in their bucket, and the next synchronised backward gathers them with no copy at
  all; gradients set to None arrive as new tensors, each copied into its bucket once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...bucket import Bucket
from ...communicators import EAGER_AFTER_BYTES, RunningExchange
from ...components import Components
from ...fusion import parse_fusion
from ...telemetry import StepTelemetry, TelemetryLog, add_exchange
from ..base import Synchronizer
from ..paths.collectives import broadcast_from_rank0
from ..paths.hierarchy import NodeHierarchy, route_for
from ..paths.routes import Route
from .autotune import AutoTuner
from .layout import BucketLayout, agreed_order
from .state import any_rank_holds_state, load_state, resharded, state_of
from .usage import Usage


class _Job:
    """One bucket's exchange in flight (the memory's :meth:`~gc_strategy.algos.base.Memory.exchange`,
    which returns ``(average, finite)``)."""

    def __init__(self, bucket: Bucket, running: RunningExchange) -> None:
        self.bucket = bucket
        self.running = running


def synchronised_parameters(module: nn.Module, parameters: Iterable[str] | None) -> list[tuple[str, nn.Parameter]]:
    """``module``'s trainable parameters by name, limited to ``parameters`` (names) where given."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if parameters is not None:
        chosen = set(parameters)
        unknown = sorted(chosen - {name for name, _ in named})
        if unknown:
            raise ValueError(f"parameters: {unknown[:5]} are not trainable parameters of the module")
        named = [(name, p) for name, p in named if name in chosen]
    if not named:
        raise ValueError("the module has no parameter with requires_grad=True: nothing to synchronise")
    return named


class GradientSynchronizer(Synchronizer):
    """Averages gradients of ``module`` across ``process_group`` through ``roles`` (compressor,
    memory and communicator, :func:`~gc_strategy.components.build_components`), over buckets cut by
    their fusion planner. On CUDA the exchanges run on a side stream unless ``side_stream=False``
    (then on the compute stream, after backward's kernels: to measure what the overlap gains).
    ``find_unused_parameters`` and ``broadcast_buffers`` mean what they mean for DDP (see the
    module's docstring). ``hierarchy``: ``"flat"``, or ``"node"`` / a
    :class:`~gc_strategy.sync.paths.hierarchy.NodeHierarchy`: a reduction inside each node and
    compression only across nodes. ``parameters`` (names) limits it to some of the trainable
    parameters. With ``on_backward=False`` backward does nothing: the caller averages the current
    ``.grad`` with :meth:`start_synchronize` and :meth:`finish_synchronize` (DiLoCo's outer step)."""

    def __init__(
        self,
        module: nn.Module,
        roles: Components,
        process_group: Any = None,
        broadcast_from_rank0: bool = True,
        side_stream: bool = True,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        hierarchy: str | NodeHierarchy = "flat",
        parameters: Iterable[str] | None = None,
        on_backward: bool = True,
    ) -> None:
        self.module = module
        #: the roles as one bundle (bound to the route's group below)
        self.roles = roles
        self.compressor, self.memory, self.communicator = roles.compressor, roles.memory, roles.communicator
        self.planner = parse_fusion(roles.fusion)
        self.process_group = process_group
        self.find_unused_parameters, self.broadcast_buffers = find_unused_parameters, broadcast_buffers
        self._buffers_due = True  # broadcast the buffers before the next forward (DDP's rule)
        initialized = dist.is_available() and dist.is_initialized()
        #: the process group's size and this process's rank in it
        self.world_size = dist.get_world_size(process_group) if initialized else 1
        self.rank = dist.get_rank(process_group) if initialized else 0
        #: how each bucket travels across ranks (flat, or per node)
        self.route = route_for(hierarchy, process_group, self.world_size)
        self.roles.bind(self.route.group)
        named = synchronised_parameters(module, parameters)
        self.names, self.params = [name for name, _ in named], [p for _, p in named]
        self.device = self.params[0].device
        #: the buckets, their buffers, and the roles' state laid out over them
        self.layout = BucketLayout(self.names, self.params, self.device, self.planner, self.route, self.roles)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and side_stream else None
        if broadcast_from_rank0:
            self._broadcast([*module.parameters(), *module.buffers()])
        self.step = 0
        self.telemetry = TelemetryLog()
        self.tuner = AutoTuner(self, self.planner) if self.planner.measured else None
        #: the gradient-ready order, recorded in the first synchronised backward (None until then)
        self.ready_order = self.layout.build_first(recorded=on_backward)
        self.compressor.check_group(self.communicator.group, self.buckets)
        self._enabled = True
        self._accumulated = [False] * len(self.params)  # got a gradient inside no_sync since the last synchronisation
        self._reset_step()
        self._hooks = (
            [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(self.params)]
            if on_backward
            else []
        )

    def _broadcast(self, tensors: list[Tensor]) -> None:
        if self.world_size > 1:
            broadcast_from_rank0(tensors, self.process_group)

    def rebind(self, route: Route) -> None:
        """Synchronise over ``route`` from the next step on (fault tolerance's new quorum): the roles
        bound to its group and checked again (a collective for some compressors), the buckets placed."""
        self.route, self.process_group = route, route.group
        self.roles.bind(route.group)
        self.world_size, self.rank = self.communicator.world_size, self.communicator.rank
        self.layout.use_route(route)
        self.compressor.check_group(route.group, self.buckets)

    # ------------------------------------------------------------------ one backward
    def _reset_step(self) -> None:
        self._in_backward = False
        self._filled = [False] * len(self.params)
        self._pending = [len(b.names) for b in self.buckets]
        self._next_launch = 0
        self._jobs: list[_Job] = []
        self._recorded: list[str] = []
        self._usage: Usage | None = None
        self._step_telemetry = StepTelemetry()
        self.roles.begin_step(self.step)

    def _hook_for(self, index: int):
        def hook(param: Tensor) -> None:
            if self._enabled:
                self._on_grad_ready(index, param)
            else:
                self._accumulated[index] = True

        return hook

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        if self.tuner is not None and self.tuner.recording:
            hooks_s = sum(job.running.host_s for job in self._jobs)  # the synchroniser's own work so far
            self.tuner.on_ready(self.names[index], hooks_s, param.grad)
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_graph_task)
        if self._filled[index]:
            raise RuntimeError(f"the gradient of '{self.names[index]}' became ready twice in one backward")
        self._filled[index] = True
        if self.ready_order is None:
            self._recorded.append(self.names[index])
        b, slot = self.layout.slots[index]
        view = self.layout.views[b][slot]
        if param.grad.data_ptr() != view.data_ptr():  # else it accumulated in its bucket already
            view.copy_(param.grad)
        self._pending[b] -= 1
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _side_stream(self):
        if self.stream is None:
            return nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _launch(self, b: int) -> None:
        bucket, flat = self.buckets[b], self.layout.buffers[b]
        with self._side_stream():
            exchange = self.route.exchange(flat, bucket, self.roles)
            running = RunningExchange(exchange)
            if bucket.nbytes >= EAGER_AFTER_BYTES:
                self._advance_eager()  # the earlier buckets': they had this bucket's encode to arrive in
            self._jobs.append(_Job(bucket, running))

    def _advance_eager(self) -> None:
        """Advance, in bucket order, every job waiting on an eager round (``Round.eager``)."""
        for job in self._jobs:
            if not job.running.done and job.running.round.eager:
                job.running.advance()

    def _end_of_graph_task(self) -> None:
        """Autograd's final callback of the graph task the step's first gradient arrived in. In a
        nested backward (run by node ``_current_autograd_node()`` of an enclosing one, as reentrant
        checkpointing does) more gradients may follow: queue it again when that node returns."""
        node = torch._C._current_autograd_node()
        if node is None:
            self._finish_backward()
            return
        handles = []

        def requeue(grad_inputs: Any, grad_outputs: Any) -> None:
            handles.pop().remove()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_graph_task)

        handles.append(node.register_hook(requeue))

    def _finish_backward(self) -> None:
        try:
            self._launch_rest()
            self._complete()
        finally:
            self._reset_step()

    def _launch_rest(self) -> None:
        """Launch every bucket not launched yet (:class:`~.usage.Usage`: the missing gradients)."""
        first = self.ready_order is None
        usage = (self._filled, self._accumulated, self.find_unused_parameters, first)
        self._usage = Usage(self.layout, *usage, self.world_size)
        for b in range(self._next_launch, len(self.buckets)):
            self._usage.prepare_bucket(b)
            self._launch(b)
        self._next_launch = len(self.buckets)
        self._usage.start_exchange()

    def _complete(self) -> None:
        """Run every launched exchange to completion and make each ``.grad`` the average."""
        with self._side_stream():
            self._advance_eager()  # the last bucket's next round travels while the others finish
            for job in self._jobs:
                job.running.finish()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        unused = self._usage.unused_by_all()
        self._apply_results(unused)
        self._usage.restore_state(unused)
        self._accumulated = [False] * len(self.params)
        self.step += 1
        for job in self._jobs:
            add_exchange(self._step_telemetry, job.bucket.nbytes, job.running)
        self._step_telemetry.extra = self.compressor.pop_metrics()
        self.telemetry.record(self._step_telemetry)
        if self.ready_order is None:
            self.ready_order = agreed_order(
                self._recorded, self.names, self.world_size, self.process_group, self.device
            )
            self.layout.rebuild(self.ready_order)
        if self.tuner is not None and self.tuner.recording:
            self.tuner.on_step_end()
        self._usage.check(unused, self.step - 1, self.rank)

    def _apply_results(self, unused: set[int]) -> None:
        finite_flags = []
        for job in self._jobs:
            average, finite = job.running.result
            if self.stream is not None:
                average.record_stream(torch.cuda.current_stream(self.device))
            if finite is not None:
                finite_flags.append(finite)
            self.layout.assign_gradients(job.bucket, average, unused)
        if finite_flags:  # no host synchronisation
            self._step_telemetry.nonfinite_buckets = len(finite_flags) - torch.stack(finite_flags).sum()

    # ------------------------------------------------------------------ public API
    def before_forward(self) -> None:
        """With ``broadcast_buffers``, rank 0's buffers are broadcast before a forward where DDP would
        (the previous forward was grad-enabled and synchronised, or there was none)."""
        if self._buffers_due and self.broadcast_buffers:
            self._broadcast(list(self.module.buffers()))

    def after_forward(self) -> None:
        self._buffers_due = torch.is_grad_enabled() and self._enabled

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context do not synchronise (gradient accumulation)."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    def start_synchronize(self) -> None:
        """Average every synchronised ``.grad`` outside backward (``on_backward=False``; DiLoCo's outer
        exchange), in two halves that other work can overlap: this one copies each ``.grad`` into its
        bucket (zeros where None) and launches every exchange, at the same point on every rank."""
        if self._in_backward or self._jobs:
            raise RuntimeError("start_synchronize: an exchange is already running; finish it first")
        self._accumulated = [p.grad is not None for p in self.params]
        try:
            self._launch_rest()
        except BaseException:
            self._reset_step()
            raise

    def finish_synchronize(self) -> None:
        """:meth:`start_synchronize`'s second half: wait, decode, make each ``.grad`` the average."""
        if not self._jobs:
            raise RuntimeError("finish_synchronize: no exchange was started (call start_synchronize first)")
        try:
            self._complete()
        finally:
            self._reset_step()

    def close(self) -> None:
        """Remove the hooks; the module trains locally afterwards."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def buckets(self) -> list[Bucket]:
        return self.layout.buckets

    @property
    def plan_report(self) -> dict[str, Any] | None:
        """``fusion="auto"``: the chosen plan, its predictions and measurements (None until planned)."""
        return self.tuner.report if self.tuner is not None else None

    def export_plan(self, path: str) -> None:
        """Write the current plan as JSON, for ``fusion="file:PATH"`` (after the first step's order)."""
        if self.ready_order is None:
            raise RuntimeError("the gradient-ready order is recorded in the first synchronised step; export after it")
        self.layout.export(path, self.plan_report)

    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Whether any rank keeps state of its own (the memory's, the compressor's): a collective."""
        return any_rank_holds_state(self, state)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, on the CPU, by parameter name (:func:`~.state.state_of`)."""
        return state_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by this rank, or made by :func:`~.state.resharded` from
        a run with another world size (:func:`~.state.load_state`)."""
        load_state(self, state)
        self.layout.keep_owned_state()
        self._reset_step()

    def load_states_of(self, states: Iterable[dict[str, Any]], world_size: int) -> None:
        """Start from the :func:`resharded` states of a run with another world size."""
        self.load_state_dict(resharded(states))

    def replicated_state(self) -> dict[str, Any]:
        """What every replica holds alike: all but each rank's own error feedback and compressor state."""
        return {**self.state_dict(), "memory": {}, "compressor": {}}

    def load_replicated_state(self, state: dict[str, Any]) -> None:
        """A peer's :meth:`replicated_state`; this rank's own error feedback starts at zero."""
        self.roles.clear_state()
        self.load_state_dict(state)
