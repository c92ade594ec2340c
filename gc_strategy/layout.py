"""The gradient synchroniser's bucket layout: the order of its parameters, the buckets cut from it,
their flat buffers, and the roles' per-element state carried across a new cut (by parameter name,
to the ranks its route places the new buckets on). A part of
:class:`~gc_strategy.gradient_sync.GradientSynchronizer`, apart from its pipeline.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .bucket import Bucket
from .fusion.plans import write_plan_file


class BucketLayout:
    """The layout methods of :class:`~gc_strategy.gradient_sync.GradientSynchronizer`, which holds the
    parameters (``names``, ``params``, ``_index``), the roles, the planner and the route."""

    def _build(self, order: list[str], tensors_per_bucket: list[int] | None = None) -> None:
        """Cut ``order`` (parameter names in gradient-ready order) into buckets of
        ``tensors_per_bucket`` tensors each (by default as the planner cuts them)."""
        if tensors_per_bucket is None:
            tensors_per_bucket = self.planner.plan(self.tensor_nbytes(order))
        if sum(tensors_per_bucket) != len(order) or any(count < 1 for count in tensors_per_bucket):
            raise ValueError(
                f"fusion plan {self.planner.describe()} returned buckets of {tensors_per_bucket} tensors "
                f"for {len(order)} tensors"
            )
        #: the parameters' names in bucket order (after the first step, the gradient-ready order)
        self.order = order
        #: how many consecutive tensors of ``order`` each bucket holds
        self.tensors_per_bucket = tensors_per_bucket
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[int, int]] = {}
        start = 0
        for b, count in enumerate(tensors_per_bucket):
            names = order[start : start + count]
            params = [self.parameter(n) for n in names]
            dtype = params[0].dtype
            for p in params[1:]:
                dtype = torch.promote_types(dtype, p.dtype)
            self.buckets.append(Bucket(b, names, [p.shape for p in params], dtype, self.device))
            for slot, name in enumerate(names):
                self._slot[self._index[name]] = (b, slot)
            start += count
        self.buffers = [torch.zeros(b.numel, dtype=b.dtype, device=self.device) for b in self.buckets]
        self.route.place([b.nbytes for b in self.buckets])
        self.views = [b.views(buf) for b, buf in zip(self.buckets, self.buffers)]

    def parameter(self, name: str) -> nn.Parameter:
        """The synchronised parameter called ``name``."""
        return self.params[self._index[name]]

    def tensor_nbytes(self, names: list[str]) -> list[int]:
        """The gradient sizes in bytes of the parameters ``names``."""
        return [self.parameter(n).numel() * self.parameter(n).element_size() for n in names]

    def rebucket(self, tensors_per_bucket: list[int]) -> None:
        """Cut the current order into new buckets (every rank must do the same at the same step);
        per-element compression state carries over by parameter name."""
        self._rebuild(self.order, tensors_per_bucket)

    def _rebuild(self, order: list[str], tensors_per_bucket: list[int] | None = None) -> None:
        """New buckets, carrying per-element compression state across by parameter name (with
        ``hierarchy="node"``, to the parameter's new owner in the node)."""
        shapes = {name: self.parameter(name).shape for name in self.names}
        state = {
            key: self.route.carry_state(by_name, shapes, self.device)
            for key, by_name in self.roles.state_by_parameter(self.buckets).items()
        }
        self._build(order, tensors_per_bucket)
        self.roles.load_state_by_parameter(state, self.buckets)
        self._keep_owned_state()

    def _keep_owned_state(self) -> None:
        """Per-element state only for the buckets this rank compresses (all of them, but with
        ``hierarchy="node"``)."""
        for role in (self.memory, self.compressor):
            for per_bucket in role.buffers.values():
                for b in [b for b in per_bucket if not self.route.keeps_state(b)]:
                    del per_bucket[b]

    def _adopt_recorded_order(self) -> None:
        """After the first synchronised backward: rank 0's ready order becomes every rank's."""
        seen = set(self._recorded)
        order = self._recorded + [n for n in reversed(self.names) if n not in seen]
        if self.world_size > 1:
            indices = torch.tensor([self._index[n] for n in order], dtype=torch.int64, device=self.device)
            src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
            dist.broadcast(indices, src, group=self.process_group)
            order = [self.names[i] for i in indices.tolist()]
        self.ready_order = order
        self._rebuild(order)

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
        numels = [self.parameter(name).numel() for name in self.order]
        write_plan_file(path, self.order, numels, self.tensors_per_bucket, self.planner.describe(), self.plan_report)
