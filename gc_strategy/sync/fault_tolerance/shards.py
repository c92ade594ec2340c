"""What a healing rank takes of a sharded model: its own shard.

A replica group that shards its model with FSDP2 (:mod:`gc_strategy.sync.fault_tolerance.sharded`)
holds each parameter, and each optimizer state of it, as a ``DTensor`` whose local tensor is this
rank's shard. torchft heals each rank from the rank in the same place of a live peer group, which
holds the same shard of the same parameters (the groups have as many ranks and shard alike). So
:class:`Shards` sends only the local tensors (a ``DTensor`` pickles its mesh, which holds process
groups, and would not travel), and rebuilds each ``DTensor`` on arrival from the one it replaces:
each rank moves its share of the state, ``1/S`` of it in a group of ``S`` ranks. An object with no
``DTensor`` travels as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _dtensor() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def local(value: Any) -> Any:
    """``value`` with every ``DTensor`` in it replaced by its local tensor (dicts and lists walked)."""
    if isinstance(value, _dtensor()):
        return value.to_local()
    if isinstance(value, dict):
        return {key: local(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local(item) for item in value)
    return value


def like(value: Any, template: Any) -> Any:
    """``value``, a local tensor, as a ``DTensor`` placed as ``template`` is (where it is one and
    ``value`` has its local shape); anything else as it is."""
    if not isinstance(template, _dtensor()) or not isinstance(value, torch.Tensor):
        return value
    if value.shape != template.to_local().shape:
        return value
    DTensor = _dtensor()
    return DTensor.from_local(
        value, template.device_mesh, template.placements, shape=template.shape, stride=template.stride()
    )


def parameter_shards(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters by name, each this rank's shard where FSDP2 shards it. An FSDP2 module
    left unsharded is resharded first: FSDP2 keeps its root's parameters gathered after a forward
    (for the backward that may follow), and ``named_parameters`` would then give the whole gathered
    tensors, which FSDP2 frees at its next reshard."""
    from ..sharded.synchronizer import fsdp_modules

    for _, unit in fsdp_modules(module):
        unit.reshard()
    return local(dict(module.named_parameters()))


class Shards:
    """A healed object (a module or an optimizer) whose ``DTensor`` state travels as this rank's
    local shards (see the module's docstring)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return local(self.obj.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.obj, torch.optim.Optimizer):
            params = [p for group in self.obj.param_groups for p in group["params"]]
            per_param = {
                i: {key: like(value, params[int(i)]) for key, value in values.items()}
                for i, values in state["state"].items()
            }
            self.obj.load_state_dict({**state, "state": per_param})
            return
        current = self.obj.state_dict()
        self.obj.load_state_dict({key: like(value, current.get(key)) for key, value in state.items()})
