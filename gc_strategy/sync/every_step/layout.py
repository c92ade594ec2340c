"""The gradient synchroniser's bucket layout: the order of its parameters, the buckets cut from it,
their flat buffers, and the roles' per-element state carried across a new cut (by parameter name,
to the ranks its route places the new buckets on). An object that
:class:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer` owns, apart from its pipeline.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...bucket import Bucket
from ...components import Components
from ...fusion import FusionPlanner
from ...fusion.plans import write_plan_file
from ..paths.routes import Route


class BucketLayout:
    """The buckets of the parameters ``names`` (``params``, on ``device``), cut by ``planner``,
    placed by ``route``, with ``roles``' per-element state kept to the buckets this rank compresses
    and carried by parameter name across a new cut. Empty until :meth:`build`."""

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        device: torch.device,
        planner: FusionPlanner,
        route: Route,
        roles: Components,
    ) -> None:
        self.names, self.params, self.device = names, params, device
        #: a parameter's index in ``names``
        self.index = {name: i for i, name in enumerate(names)}
        self.planner, self.route, self.roles = planner, route, roles
        #: the parameters' names in bucket order (after the first step, the gradient-ready order)
        self.order: list[str] = []
        #: how many consecutive tensors of ``order`` each bucket holds
        self.tensors_per_bucket: list[int] = []
        self.buckets: list[Bucket] = []
        #: each bucket's flat buffer, and its per-parameter views
        self.buffers: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        #: a parameter's index -> its bucket and its slot there
        self.slots: dict[int, tuple[int, int]] = {}

    def build(self, order: list[str], tensors_per_bucket: list[int] | None = None) -> None:
        """Cut ``order`` (parameter names in gradient-ready order) into buckets of
        ``tensors_per_bucket`` tensors each (by default as the planner cuts them)."""
        if tensors_per_bucket is None:
            tensors_per_bucket = self.planner.plan(self.tensor_nbytes(order))
        if sum(tensors_per_bucket) != len(order) or any(count < 1 for count in tensors_per_bucket):
            raise ValueError(
                f"fusion plan {self.planner.describe()} returned buckets of {tensors_per_bucket} tensors "
                f"for {len(order)} tensors"
            )
        self.order, self.tensors_per_bucket = order, tensors_per_bucket
        self.buckets, self.slots = [], {}
        start = 0
        for b, count in enumerate(tensors_per_bucket):
            names = order[start : start + count]
            params = [self.parameter(n) for n in names]
            dtype = params[0].dtype
            for p in params[1:]:
                dtype = torch.promote_types(dtype, p.dtype)
            self.buckets.append(Bucket(b, names, [p.shape for p in params], dtype, self.device))
            for slot, name in enumerate(names):
                self.slots[self.index[name]] = (b, slot)
            start += count
        self.buffers = [torch.zeros(b.numel, dtype=b.dtype, device=self.device) for b in self.buckets]
        self.route.place([b.nbytes for b in self.buckets])
        self.views = [b.views(buf) for b, buf in zip(self.buckets, self.buffers)]

    def build_first(self, recorded: bool) -> list[str] | None:
        """The first cut, and the gradient-ready order where it is known already: a plan file's
        (which fixes the order too), else the reverse registration order, taken as the ready
        order where no backward will record one (``recorded`` False)."""
        if self.planner.fixes_tensors:  # a plan file's order
            self.planner.check({name: p.numel() for name, p in zip(self.names, self.params)})
            self.build(list(self.planner.order))
            return list(self.order)
        self.build(list(reversed(self.names)))
        return None if recorded else list(self.order)

    def parameter(self, name: str) -> nn.Parameter:
        """The synchronised parameter called ``name``."""
        return self.params[self.index[name]]

    def tensor_nbytes(self, names: list[str]) -> list[int]:
        """The gradient sizes in bytes of the parameters ``names``."""
        return [self.parameter(n).numel() * self.parameter(n).element_size() for n in names]

    def assign_gradients(self, bucket: Bucket, average: torch.Tensor, skip: set[int]) -> None:
        """Each parameter's ``.grad`` from its slot of the bucket's ``average``: a view of it (a copy
        where the dtypes differ); the parameters ``skip`` (indices: no rank used them) keep their
        ``.grad`` as it was, as with DDP."""
        for name, value in zip(bucket.names, bucket.views(average)):
            if self.index[name] in skip:
                continue
            param = self.parameter(name)
            if value.dtype == param.dtype:  # the gradient becomes a view of the average: no copy
                param.grad = value.detach()
            elif param.grad is None:
                param.grad = value.detach().to(param.dtype)
            else:
                param.grad.copy_(value)

    def rebucket(self, tensors_per_bucket: list[int]) -> None:
        """Cut the current order into new buckets (every rank must do the same at the same step);
        per-element compression state carries over by parameter name."""
        self.rebuild(self.order, tensors_per_bucket)

    def rebuild(self, order: list[str], tensors_per_bucket: list[int] | None = None) -> None:
        """New buckets, carrying per-element compression state across by parameter name (with
        ``hierarchy="node"``, to the parameter's new owner in the node)."""
        shapes = {name: self.parameter(name).shape for name in self.names}
        state = {
            key: self.route.carry_state(by_name, shapes, self.device)
            for key, by_name in self.roles.state_by_parameter(self.buckets).items()
        }
        self.build(order, tensors_per_bucket)
        self.roles.load_state_by_parameter(state, self.buckets)
        self.keep_owned_state()

    def use_route(self, route: Route) -> None:
        """Exchange along ``route`` from now on: the buckets placed on its ranks, per-element state
        kept for those this rank compresses."""
        self.route = route
        route.place([b.nbytes for b in self.buckets])
        self.keep_owned_state()

    def keep_owned_state(self) -> None:
        """Per-element state only for the buckets this rank compresses (all of them, but with
        ``hierarchy="node"``)."""
        self.roles.keep_buckets(self.route.keeps_state)

    def export(self, path: str, report: dict[str, Any] | None) -> None:
        """Write the current plan (order and tensors per bucket) as JSON, for ``fusion="file:PATH"``."""
        numels = [self.parameter(name).numel() for name in self.order]
        write_plan_file(path, self.order, numels, self.tensors_per_bucket, self.planner.describe(), report)


def agreed_order(recorded: list[str], names: list[str], world_size: int, group: Any, device: torch.device) -> list[str]:
    """After the first synchronised backward: rank 0's gradient-ready order (``recorded``, then the
    parameters that got no gradient, last first) becomes every rank's."""
    seen = set(recorded)
    order = recorded + [n for n in reversed(names) if n not in seen]
    if world_size > 1:
        index = {name: i for i, name in enumerate(names)}
        indices = torch.tensor([index[n] for n in order], dtype=torch.int64, device=device)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(indices, src, group=group)
        order = [names[i] for i in indices.tolist()]
    return order
