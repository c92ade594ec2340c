"""Collectives over a module's tensors, coalesced like DDP's: one per dtype and device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def broadcast_from_rank0(tensors: list[Tensor], group: Any = None) -> None:
    """Rank 0's (of ``group``) values of ``tensors`` to every rank, coalesced like DDP's broadcast."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    _coalesced(tensors, lambda flat: dist.broadcast(flat, src, group=group))


def average_buffers(buffers: list[Tensor], group: Any = None) -> None:
    """Floating-point ``buffers`` (BatchNorm's running mean and variance) to their mean over the
    ranks of ``group``, the others (counters such as ``num_batches_tracked``) to rank 0's.

    Why: DiLoCo's outer step moves every replica to the outer parameters, which come from the mean
    of all replicas' progress. One replica's running statistics describe its own inner trajectory
    only; their mean describes all of them, as the outer parameters do.
    """
    world_size = dist.get_world_size(group)

    def mean(flat: Tensor) -> None:
        dist.all_reduce(flat, group=group)
        flat.div_(world_size)

    _coalesced([b for b in buffers if b.is_floating_point()], mean)
    broadcast_from_rank0([b for b in buffers if not b.is_floating_point()], group)


def _coalesced(tensors: list[Tensor], collective: Callable[[Tensor], None]) -> None:
    """Run ``collective`` in place on one flat buffer per dtype and device holding ``tensors``,
    then copy the results back (one collective per kind instead of one per tensor)."""
    same_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        same_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor.detach())
    with torch.no_grad():
        for same in same_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            collective(flat)
            start = 0
            for t in same:
                t.copy_(flat[start : start + t.numel()].view_as(t))
                start += t.numel()
