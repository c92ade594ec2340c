"""The gradient synchroniser's state in a checkpoint, and the state a run with another world size
starts from (:mod:`gc_strategy.integrations.checkpoint` writes and reads the files)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

STATE_FORMAT = 1


def state_of(synchronizer: Any) -> dict[str, Any]:
    """A :class:`~gc_strategy.sync.every_step.synchronizer.GradientSynchronizer`'s state for a checkpoint, on the CPU,
    keyed by parameter name: the step, the gradient order and plan, and the roles' state."""
    return _to_cpu(
        {
            "format": STATE_FORMAT,
            "world_size": synchronizer.world_size,
            "step": synchronizer.step,
            "ready_order": synchronizer.ready_order,
            "groups": synchronizer.layout.tensors_per_bucket,
            "plan": synchronizer.planner.describe(),
            **synchronizer.roles.state_by_parameter(synchronizer.buckets),
            "compressor_extra": synchronizer.compressor.extra_state(),
            "auto_plan": synchronizer.plan_report,
        }
    )


def any_rank_holds_state(synchronizer: Any, state: dict[str, Any]) -> bool:
    """Whether any rank keeps state of its own for a checkpoint (the memory's, the compressor's),
    given this rank's :func:`state_of`: an allreduce, called on every rank. Without it rank 0's
    state is every rank's."""
    own = state["memory"] or state["compressor"] or state["compressor_extra"]
    held = torch.tensor([float(bool(own))], device=synchronizer.device)
    if synchronizer.world_size > 1:
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=synchronizer.process_group)
    return bool(held.item())


def load_state(synchronizer: Any, state: dict[str, Any]) -> None:
    """Restore :func:`state_of`'s record into ``synchronizer``: its order and buckets (the plan's,
    where it is the same plan), step and roles' state."""
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"gradient synchroniser state has format {state.get('format')!r}; expected {STATE_FORMAT}")
    if state["world_size"] != synchronizer.world_size:
        state = {**state, "auto_plan": None}  # its timings were measured with another world size: plan again
    order = state["ready_order"]
    if order is not None:
        unknown = sorted(set(order) ^ set(synchronizer.names))
        if unknown:
            raise ValueError(f"the checkpoint's gradient order does not match this model's parameters: {unknown[:5]}")
        same_plan = state.get("plan") == synchronizer.planner.describe()
        synchronizer.ready_order = list(order)
        synchronizer.layout.build(synchronizer.ready_order, list(state["groups"]) if same_plan else None)
        if same_plan and synchronizer.tuner is not None and state.get("auto_plan") is not None:
            synchronizer.tuner.restore(state["auto_plan"])
    synchronizer.step = int(state["step"])
    synchronizer.roles.load_state_by_parameter(state, synchronizer.buckets)
    synchronizer.compressor.load_extra_state(state["compressor_extra"])


def resharded(states: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The state every rank of a run with another world size starts from, given the ``W`` old
    ranks' :meth:`~GradientSynchronizer.state_dict` s, taken one at a time (README.md, "Differences
    from ddp"):

    - per-element state of the memory and the compressor (residuals ``e_r``, momenta ``u_r``, DGC's
      accumulation ``v_r``, PowerSGD's error): the mean ``(1/W) Σ_r e_r`` on every new rank. The
      correction all ranks apply together, ``(1/W') Σ_r' e_r'``, is then the old one. With
      ``hierarchy="node"`` only the owner of a bucket on each node holds its state: the mean is over
      the ranks that hold it, ``(1/N) Σ_nodes e_n``, the correction of that run;
    - state all ranks share (PowerSGD's and ACP-SGD's factors, the step, the gradient order, the
      plan): rank 0's, which equals every rank's;
    - per-rank random draws are not state: they are derived anew from (seed, step, rank);
    - a plan measured by ``fusion="auto"`` is dropped (its timings were for ``W`` ranks), and is
      planned again.
    """
    merged: dict[str, Any] = {}
    counts: dict[tuple[str, str, str], int] = {}
    for state in states:
        if not merged:
            merged = {**state, "memory": {}, "compressor": {}}
        for role in ("memory", "compressor"):
            for name, tensors in state[role].items():
                totals = merged[role].setdefault(name, {})
                for param, value in tensors.items():
                    key = (role, name, param)
                    if key in counts:
                        totals[param].add_(value)
                    else:
                        totals[param] = value.float().clone()
                    counts[key] = counts.get(key, 0) + 1
    for (role, name, param), count in counts.items():
        merged[role][name][param].div_(count)
    return merged


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value
