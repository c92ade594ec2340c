"""The gradient synchroniser's state in a checkpoint, and the state a run with another world size
starts from (:mod:`gc_strategy.checkpoint` writes and reads the files)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

STATE_FORMAT = 1


def state_of(engine: Any) -> dict[str, Any]:
    """A :class:`~gc_strategy.engine.GradientSynchronizer`'s state for a checkpoint, on the CPU,
    keyed by parameter name: the step, the gradient order and plan, and the roles' state."""
    return _to_cpu(
        {
            "format": STATE_FORMAT,
            "world_size": engine.world_size,
            "step": engine.step,
            "ready_order": engine.ready_order,
            "groups": engine.tensors_per_bucket,
            "plan": engine.planner.describe(),
            "memory": engine.memory.state_by_parameter(engine.buckets),
            "compressor": engine.compressor.state_by_parameter(engine.buckets),
            "compressor_extra": engine.compressor.extra_state(),
            "auto_plan": engine.plan_report,
        }
    )


def any_rank_holds_state(engine: Any, state: dict[str, Any]) -> bool:
    """Whether any rank keeps state of its own for a checkpoint (the memory's, the compressor's),
    given this rank's :func:`state_of`: an allreduce, called on every rank. Without it rank 0's
    state is every rank's."""
    own = state["memory"] or state["compressor"] or state["compressor_extra"]
    held = torch.tensor([float(bool(own))], device=engine.device)
    if engine.world_size > 1:
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=engine.process_group)
    return bool(held.item())


def load_state(engine: Any, state: dict[str, Any]) -> None:
    """Restore :func:`state_of`'s record into ``engine``: its order and buckets (the plan's,
    where it is the same plan), step and roles' state."""
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"gradient synchroniser state has format {state.get('format')!r}; expected {STATE_FORMAT}")
    if state["world_size"] != engine.world_size:
        state = {**state, "auto_plan": None}  # its timings were measured with another world size: plan again
    order = state["ready_order"]
    if order is not None:
        unknown = sorted(set(order) ^ set(engine.names))
        if unknown:
            raise ValueError(f"the checkpoint's gradient order does not match this model's parameters: {unknown[:5]}")
        same_plan = state.get("plan") == engine.planner.describe()
        engine.ready_order = list(order)
        engine._build(engine.ready_order, list(state["groups"]) if same_plan else None)
        if same_plan and engine.tuner is not None and state.get("auto_plan") is not None:
            engine.tuner.restore(state["auto_plan"])
    engine.step = int(state["step"])
    engine.memory.load_state_by_parameter(state["memory"], engine.buckets)
    engine.compressor.load_state_by_parameter(state["compressor"], engine.buckets)
    engine.compressor.load_extra_state(state["compressor_extra"])


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
