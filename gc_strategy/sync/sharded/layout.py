"""What one FSDP2 reduction holds: which parameters of a unit, and how their shards lie in the flat
reduce-scattered output that the all-reduce hook receives.

FSDP2 reduces, in a unit's backward, only the parameters whose gradient arrived since the unit's
last reduction (``FSDPParamGroup.post_backward``): not a frozen parameter, nor one that took no part
in this step's forward (a branch taken on some steps only), unless the unit reduces unused
parameters as zeros (``set_reduce_scatter_unused_params(True)``). Its output lays those parameters'
shards end to end, each parameter's rows padded with zeros to a multiple of the ``S`` ranks of a node
(``padded_sharded_param_size``). The hook receives that flat tensor alone, so :class:`ReducedParameters`
watches each unit's unsharded parameters for the gradients that arrive (a post-accumulate-grad hook
on each), and :meth:`ReducedParameters.layout` names the parameters of the next reduction.

FSDP2 says both only through its parameter group (``FSDPParam``, torch 2.7 to 2.14).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _param_group(fsdp_module: nn.Module) -> Any:
    return fsdp_module._get_fsdp_state()._fsdp_param_group


class ReducedParameters:
    """Which parameters of each FSDP2 unit of ``units`` (``(name, module)`` pairs) FSDP2's next
    reduction of that unit holds (see the module's docstring). ``names`` maps a sharded
    parameter's ``id`` to its name."""

    def __init__(self, units: list[tuple[str, nn.Module]], names: dict[int, str]) -> None:
        self.units = units
        self.names = names
        #: ids of the FSDPParams whose gradient arrived since their unit's last reduction
        self._arrived: set[int] = set()
        #: id of an FSDPParam -> the unsharded parameter that carries its hook
        self._watched: dict[int, torch.Tensor] = {}
        self._handles = [module.register_forward_pre_hook(self._watch_unit(module)) for _, module in units]

    def _watch_unit(self, module: nn.Module):
        """A forward pre-hook, run after FSDP2's own (which all-gathers the unsharded parameters):
        a post-accumulate-grad hook on each unsharded parameter not yet watched."""

        def watch(*_: Any) -> None:
            group = _param_group(module)
            for fsdp_param in group.fsdp_params if group is not None else []:
                unsharded = fsdp_param.unsharded_param
                if self._watched.get(id(fsdp_param)) is not unsharded and unsharded.requires_grad:
                    self._handles.append(unsharded.register_post_accumulate_grad_hook(self._arrival(id(fsdp_param))))
                    self._watched[id(fsdp_param)] = unsharded

        return watch

    def _arrival(self, key: int):
        """The post-accumulate-grad hook of the FSDPParam ``key``: its gradient arrived."""

        def arrived(_: torch.Tensor) -> None:
            self._arrived.add(key)

        return arrived

    def layout(self, b: int, matrices: bool) -> tuple[list[str], list[torch.Size]]:
        """The names and the shapes of the shards of the parameters in this reduction of unit ``b``,
        in the order of its output (the row-shards ``padded_sharded_param_size`` where ``matrices``,
        for a compressor of matrices; flat shards otherwise), and forget their arrival."""
        group = _param_group(self.units[b][1])
        zeros_for_unused = group is not None and group.reduce_scatter_unused_params
        out_names, shapes = [], []
        for fsdp_param in group.fsdp_params if group is not None else []:
            key = id(fsdp_param)
            if key not in self._arrived and not (zeros_for_unused and fsdp_param.sharded_param.requires_grad):
                continue
            self._arrived.discard(key)
            size = torch.Size(fsdp_param.padded_sharded_param_size)
            if matrices and fsdp_param.fsdp_placement.dim != 0:
                raise ValueError(
                    f"shard placement = {fsdp_param.fsdp_placement!r} is invalid for a compressor of matrices; "
                    "allowed: Shard(0), FSDP2's default (no shard_placement_fn)"
                )
            out_names.append(self.names[id(fsdp_param.sharded_param)])
            shapes.append(size if matrices else torch.Size([size.numel()]))
        return out_names, shapes

    def trainable(self, b: int) -> tuple[list[str], list[torch.Size]]:
        """The names and flat shard shapes of unit ``b``'s parameters that take gradients: the layout
        of a reduction that holds them all."""
        group = _param_group(self.units[b][1])
        params = [p for p in (group.fsdp_params if group is not None else []) if p.sharded_param.requires_grad]
        names = [self.names[id(p.sharded_param)] for p in params]
        return names, [torch.Size([torch.Size(p.padded_sharded_param_size).numel()]) for p in params]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._watched = [], {}
