"""The gradient synchroniser: hooks, fused buckets and an ordered asynchronous pipeline.

It replaces ``DistributedDataParallel`` for any ``nn.Module`` and process group (no Lightning here).
One synchronised backward (DESIGN.md §One training step):

1. Each trainable parameter's post-accumulate-grad hook copies its gradient into its bucket's flat
   buffer. The first hook of a backward queues the end-of-backward callback.
2. When bucket ``k`` is complete and buckets ``0..k-1`` have been launched, bucket ``k`` launches:
   ``memory.compensate -> compressor.encode -> communicator`` (asynchronous; on CUDA on a side stream
   that waits for the compute stream). After its first collective is issued, if the bucket holds
   at least ``EAGER_AFTER_BYTES``, earlier buckets waiting on an eager round (``Round.eager``: a
   length handshake, PowerSGD's P) are advanced, so their next collective is issued during
   backward, at the same point on every rank.
3. End of backward: launch what is left (parameters that got no gradient contribute zeros), advance
   the eager rounds once more, then every bucket's exchange to completion in bucket order (later
   rounds of multi-round methods are issued here, in that order), decode, average, ``memory.update``
   (skipped for buckets holding inf/NaN), and make each ``param.grad`` a view of the averaged
   bucket (a copy where the dtypes differ).

Buckets follow reverse registration order until the first synchronised backward has recorded the
real gradient-ready order; then rank 0's order is broadcast and every rank rebuilds its buckets
(the way DDP rebuilds its buckets after the first iteration).

Semantics worth knowing:
- Frozen parameters (``requires_grad=False``) are not synchronised at all.
- A parameter that gets no gradient on a rank contributes zeros on that rank; every rank then holds
  the average in ``.grad``, also a rank whose ``.grad`` was ``None`` (zeros if no rank used it).
- Inside :meth:`GradientSynchronizer.no_sync` (gradient accumulation) backward launches nothing;
  gradients accumulate locally and the next synchronised backward averages the accumulated sums.
- Where the averaged bucket has the parameter's dtype, ``.grad`` becomes a view of it (no copy-out;
  like DDP's ``gradient_as_bucket_view``): the gradients of a bucket share one storage, the
  bucket's own gradient buffer (the exchange writes its average there), which the next backward
  writes again.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .algos.base import Compressor, Memory, StartedExchange, start_exchange
from .bucket import Bucket
from .comm import Communicator, Round
from .fusion import AutoPlan, FilePlan, FusionPlanner, parse_fusion
from .fusion.auto import AutoTuner
from .fusion.plans import PLAN_FILE_FORMAT
from .telemetry import StepTelemetry, TelemetryLog

STATE_FORMAT = 1
#: eager rounds are advanced after the launch of a bucket of at least this size (or at the end of
#: backward): a smaller one's gradients and encode give the round too little time to arrive, and
#: waiting for it would stall backward
EAGER_AFTER_BYTES = 1 << 20


class _Job:
    """One bucket's exchange in flight: a generator of rounds and its current round."""

    def __init__(self, bucket: Bucket, started: StartedExchange) -> None:
        self.bucket = bucket
        self.exchange = started.exchange
        self.compensated = started.compensated
        self.finite = started.finite
        self.round: Round | None = None
        self.result: tuple[Tensor, Tensor | None] | None = None


class GradientSynchronizer:
    """Averages gradients of ``module`` across ``process_group`` through compressor, memory and
    communicator, over buckets cut by ``fusion`` (a planner or its string form, e.g. ``"groups:4"``).
    On CUDA the exchanges run on a side stream unless ``side_stream=False`` (then on the compute
    stream, after backward's kernels: for measuring what the overlap gains).
    """

    def __init__(
        self,
        module: nn.Module,
        compressor: Compressor,
        memory: Memory,
        communicator: Communicator,
        fusion: Union[str, FusionPlanner] = "bucket_mb:25",
        process_group: Any = None,
        broadcast_from_rank0: bool = True,
        side_stream: bool = True,
    ) -> None:
        self.module = module
        self.compressor = compressor
        self.memory = memory
        self.comm = communicator
        self.planner = parse_fusion(fusion)
        self.group = process_group
        communicator.bind(process_group)
        compressor.world_size, compressor.rank = communicator.world_size, communicator.rank
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameter with requires_grad=True: nothing to synchronise")
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self._index = {name: i for i, name in enumerate(self.names)}
        self.device = self.params[0].device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and side_stream else None
        if broadcast_from_rank0:
            self._broadcast_module_states()
        self.step = 0
        self.telemetry = TelemetryLog()
        self.ready_order: list[str] | None = None  # recorded in the first synchronised backward
        self.tuner = AutoTuner(self, self.planner) if isinstance(self.planner, AutoPlan) else None
        if isinstance(self.planner, FilePlan):  # the plan file fixes the order too
            self.planner.check({name: p.numel() for name, p in zip(self.names, self.params)})
            self.ready_order = list(self.planner.order)
            self._build(self.ready_order)
        else:
            self._build(list(reversed(self.names)))
        self._enabled = True
        self._reset_step()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ set-up
    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def _broadcast_module_states(self) -> None:
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor.detach(), src, group=self.group)

    def _build(self, order: list[str], groups: list[int] | None = None) -> None:
        """Cut ``order`` (parameter names in gradient-ready order) into buckets."""
        if groups is None:
            groups = self.planner.plan([self._param(n).numel() * self._param(n).element_size() for n in order])
        if sum(groups) != len(order) or any(g < 1 for g in groups):
            raise ValueError(f"fusion plan {self.planner.describe()} returned groups {groups} for {len(order)} tensors")
        self.order = order
        self.groups = groups
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[int, int]] = {}
        start = 0
        for b, count in enumerate(groups):
            names = order[start : start + count]
            params = [self._param(n) for n in names]
            dtype = params[0].dtype
            for p in params[1:]:
                dtype = torch.promote_types(dtype, p.dtype)
            self.buckets.append(Bucket(b, names, [p.shape for p in params], dtype, self.device))
            for slot, name in enumerate(names):
                self._slot[self._index[name]] = (b, slot)
            start += count
        self.buffers = [torch.zeros(b.numel, dtype=b.dtype, device=self.device) for b in self.buckets]
        self.views = [b.views(buf) for b, buf in zip(self.buckets, self.buffers)]

    def _param(self, name: str) -> nn.Parameter:
        return self.params[self._index[name]]

    def _rebuild(self, order: list[str], groups: list[int] | None = None) -> None:
        """New buckets, carrying per-element compression state across by parameter name."""
        memory_state = self.memory.state_by_parameter(self.buckets)
        compressor_state = self.compressor.state_by_parameter(self.buckets)
        self._build(order, groups)
        self.memory.load_state_by_parameter(memory_state, self.buckets)
        self.compressor.load_state_by_parameter(compressor_state, self.buckets)

    def _adopt_recorded_order(self) -> None:
        """After the first synchronised backward: rank 0's ready order becomes every rank's."""
        seen = set(self._recorded)
        order = self._recorded + [n for n in reversed(self.names) if n not in seen]
        if self.world_size > 1:
            indices = torch.tensor([self._index[n] for n in order], dtype=torch.int64, device=self.device)
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast(indices, src, group=self.group)
            order = [self.names[i] for i in indices.tolist()]
        self.ready_order = order
        self._rebuild(order)

    # ------------------------------------------------------------------ one backward
    def _reset_step(self) -> None:
        self._in_backward = False
        self._filled = [False] * len(self.params)
        self._pending = [len(b.names) for b in self.buckets]
        self._next_launch = 0
        self._jobs: list[_Job] = []
        self._recorded: list[str] = []
        self._step_telemetry = StepTelemetry()
        self.compressor.step = self.step

    def _hook_for(self, index: int):
        def hook(param: Tensor) -> None:
            if self._enabled:
                self._on_grad_ready(index, param)

        return hook

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        if self.tuner is not None and self.tuner.recording:
            tel = self._step_telemetry  # so far only the hooks' own work has been timed this step
            self.tuner.on_ready(index, tel.encode_s + tel.decode_s + tel.exposed_wait_s, param.grad)
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if self._filled[index]:
            raise RuntimeError(f"the gradient of '{self.names[index]}' became ready twice in one backward")
        self._filled[index] = True
        if self.ready_order is None:
            self._recorded.append(self.names[index])
        b, slot = self._slot[index]
        self.views[b][slot].copy_(param.grad)
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
        bucket, flat = self.buckets[b], self.buffers[b]
        tel = self._step_telemetry
        with self._side_stream():
            start = time.perf_counter()
            job = _Job(bucket, start_exchange(self.compressor, self.memory, flat, bucket, self.comm))
            job.round = next(job.exchange)
            tel.encode_s += time.perf_counter() - start
            if bucket.nbytes >= EAGER_AFTER_BYTES:
                self._advance_eager()  # the earlier buckets': they had this bucket's encode to arrive in
            self._jobs.append(job)
        tel.buckets += 1
        tel.raw_bytes += bucket.nbytes

    def _advance(self, job: _Job) -> None:
        """Wait for the job's current round and run its generator to the next round (or the end)."""
        tel, current = self._step_telemetry, job.round
        start = time.perf_counter()
        value = current.wait()
        resumed = time.perf_counter()
        tel.exposed_wait_s += resumed - start
        tel.collective_s += current.duration
        tel.sent_bytes += current.nbytes
        tel.collectives += len(current.works)
        try:
            job.round = job.exchange.send(value)
            tel.encode_s += time.perf_counter() - resumed
        except StopIteration as stop:
            job.round, job.result = None, stop.value
            tel.decode_s += time.perf_counter() - resumed

    def _advance_eager(self) -> None:
        """Advance, in bucket order, every job waiting on an eager round (``Round.eager``)."""
        for job in self._jobs:
            if job.round is not None and job.round.eager:
                self._advance(job)

    def _finish_backward(self) -> None:
        try:
            for b in range(self._next_launch, len(self.buckets)):
                for slot, name in enumerate(self.buckets[b].names):
                    if not self._filled[self._index[name]]:
                        self.views[b][slot].zero_()
                self._launch(b)
            with self._side_stream():
                self._advance_eager()  # the last bucket's next round travels while the others finish
                for job in self._jobs:
                    while job.round is not None:
                        self._advance(job)
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._apply_results()
            self.step += 1
            self._step_telemetry.extra = self.compressor.pop_metrics()
            self.telemetry.record(self._step_telemetry)
            if self.ready_order is None:
                self._adopt_recorded_order()
            if self.tuner is not None and self.tuner.recording:
                self.tuner.on_step_end()
        finally:
            self._reset_step()

    def _apply_results(self) -> None:
        nonfinite = []
        for job in self._jobs:
            average, local = job.result
            if self.stream is not None:
                average.record_stream(torch.cuda.current_stream(self.device))
            if job.compensated is not None:
                self.memory.update(job.compensated, local, job.bucket, job.finite)
            if job.finite is not None:
                nonfinite.append(~job.finite)
            for name, value in zip(job.bucket.names, job.bucket.views(average)):
                param = self._param(name)
                if value.dtype == param.dtype:  # the gradient becomes a view of the average: no copy
                    param.grad = value.detach()
                elif param.grad is None:
                    param.grad = value.detach().to(param.dtype)
                else:
                    param.grad.copy_(value)
        if nonfinite:
            self._step_telemetry.nonfinite_buckets = torch.stack(nonfinite).sum()  # no host synchronisation

    # ------------------------------------------------------------------ public API
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context do not synchronise (gradient accumulation)."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    def close(self) -> None:
        """Remove the hooks; the module trains locally afterwards."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def plan_report(self) -> dict[str, Any] | None:
        """``fusion="auto"``: the chosen plan, its predicted and measured step time, the predictions
        for fixed plans and for an fp32 allreduce, the cost model (None until planned)."""
        return self.tuner.report if self.tuner is not None else None

    def export_plan(self, path: str) -> None:
        """Write the current plan (gradient-ready order and tensors per bucket) as JSON, for
        ``fusion="file:PATH"``."""
        if self.ready_order is None:
            raise RuntimeError("the gradient-ready order is recorded in the first synchronised step; export after it")
        plan = {
            "format": PLAN_FILE_FORMAT,
            "order": self.order,
            "numels": [self._param(name).numel() for name in self.order],
            "groups": self.groups,
            "chosen_by": self.planner.describe(),
            "report": self.plan_report,
        }
        with open(path, "w") as f:
            json.dump(plan, f, indent=1)

    def state_dict(self) -> dict[str, Any]:
        """This rank's synchronisation state, on the CPU, keyed by parameter name."""
        return _to_cpu(
            {
                "format": STATE_FORMAT,
                "world_size": self.world_size,
                "step": self.step,
                "ready_order": self.ready_order,
                "groups": self.groups,
                "plan": self.planner.describe(),
                "memory": self.memory.state_by_parameter(self.buckets),
                "compressor": self.compressor.state_by_parameter(self.buckets),
                "compressor_extra": self.compressor.extra_state(),
                "auto_plan": self.plan_report,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` saved by the same rank of a run with the same world size."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"gradient synchroniser state has format {state.get('format')!r}; expected {STATE_FORMAT}")
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"the checkpoint's compression state was saved with world size {state['world_size']}, "
                f"this run has {self.world_size}; error-feedback state is per rank and cannot be resharded"
            )
        order = state["ready_order"]
        if order is not None:
            unknown = sorted(set(order) ^ set(self.names))
            if unknown:
                raise ValueError(f"the checkpoint's gradient order does not match this model's parameters: {unknown[:5]}")
            same_plan = state.get("plan") == self.planner.describe()
            self.ready_order = list(order)
            self._build(self.ready_order, list(state["groups"]) if same_plan else None)
            if same_plan and self.tuner is not None and state.get("auto_plan") is not None:
                self.tuner.restore(state["auto_plan"])
        self.step = int(state["step"])
        self.memory.load_state_by_parameter(state["memory"], self.buckets)
        self.compressor.load_state_by_parameter(state["compressor"], self.buckets)
        self.compressor.load_extra_state(state["compressor_extra"])
        self._reset_step()


def gather_rank_states(synchronizer: GradientSynchronizer) -> dict[str, Any]:
    """Every rank's :meth:`~GradientSynchronizer.state_dict`, gathered on every rank (a collective:
    call it on all ranks): ``{"world_size": W, "ranks": [state of rank 0, ...]}``. Error-feedback
    state is per rank, so a checkpoint needs all of them."""
    state = synchronizer.state_dict()
    if synchronizer.world_size == 1:
        return {"world_size": 1, "ranks": [state]}
    states: list[Any] = [None] * synchronizer.world_size
    dist.all_gather_object(states, state, group=synchronizer.group)
    return {"world_size": synchronizer.world_size, "ranks": states}


def load_rank_state(synchronizer: GradientSynchronizer, states: dict[str, Any]) -> None:
    """Restore this rank's entry of :func:`gather_rank_states`' result."""
    if states["world_size"] != synchronizer.world_size:
        raise ValueError(
            f"the checkpoint holds compression state for {states['world_size']} ranks, this run has "
            f"{synchronizer.world_size}; per-rank error-feedback state cannot be resharded"
        )
    synchronizer.load_state_dict(states["ranks"][synchronizer.comm.rank])


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value
