"""Which parameters took part in a synchronised step, and what ``find_unused_parameters`` makes of
it (the semantics of ``DistributedDataParallel``: :mod:`gc_strategy.sync.every_step.synchronizer`'s docstring)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .layout import BucketLayout


class Usage:
    """Which parameters took part in one synchronised step, on this rank and on any rank, and what
    ``find_unused_parameters`` makes of it (see the module's docstring).

    A parameter counts as used on a rank when its gradient arrived in this backward (``filled``) or
    in a ``no_sync`` backward since the last synchronisation (``accumulated``, with a ``.grad``). One
    that did not contributes its ``.grad`` where it has one (as DDP does), else zeros. Where usage
    across ranks must be known, one sum of the per-parameter flags along ``layout``'s route (over
    its ``world_size`` ranks: :meth:`~gc_strategy.sync.paths.routes.Route.sum_counts`) follows the
    launch of every bucket, at the same point of the collective order on every rank: with
    ``find_unused_parameters``, and in the ``first`` step. ``layout`` holds the buckets, their
    buffers, the roles and the route.
    """

    def __init__(
        self,
        layout: BucketLayout,
        filled: list[bool],
        accumulated: list[bool],
        find_unused_parameters: bool,
        first: bool,
        world_size: int,
    ) -> None:
        self.layout, self.filled = layout, filled
        self.used = [f or (a and p.grad is not None) for f, a, p in zip(filled, accumulated, layout.params)]
        self.find_unused_parameters = find_unused_parameters
        self.global_check = find_unused_parameters or first
        self.world_size = world_size
        self._count: Tensor | None = None
        self._work: Any = None
        #: (parameter index, bucket, slot) of each parameter this rank did not use ->
        #: {(role, state name): that state's slice before the step}
        self._saved: dict[tuple[int, int, int], dict[tuple[str, str], Tensor]] = {}

    def prepare_bucket(self, b: int) -> None:
        """Before bucket ``b`` launches at the end of backward: fill the slots of parameters whose
        gradient did not arrive in this backward, and keep their state for :meth:`restore_state`."""
        layout = self.layout
        buffer = layout.buffers[b]
        for slot, name in enumerate(layout.buckets[b].names):
            index = layout.index[name]
            if self.filled[index]:
                continue
            param, view = layout.params[index], layout.views[b][slot]
            if param.grad is None:
                view.zero_()
            else:
                if param.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                    param.grad = param.grad.clone()  # keep it out of the exchange, which writes the buffer
                view.copy_(param.grad)
            if not self.used[index] and self.find_unused_parameters:
                self._save(index, b, slot)

    def _state_slices(self, b: int, slot: int) -> dict[tuple[str, str], Tensor]:
        """The slot's slices of every per-element state of the roles, by role and state name."""
        return self.layout.roles.slot_state(self.layout.buckets[b], slot)

    def _save(self, index: int, b: int, slot: int) -> None:
        self._saved[(index, b, slot)] = {key: view.clone() for key, view in self._state_slices(b, slot).items()}

    def start_exchange(self) -> None:
        """Issue the allreduce of the usage flags (after every bucket's launch)."""
        if not self.global_check or self.world_size == 1:
            return
        self._count = torch.tensor(self.used, dtype=torch.int32, device=self.layout.device)
        self._work = self.layout.route.sum_counts(self._count)

    def unused_by_all(self) -> set[int]:
        """Parameters no rank used (where that is known: with the allreduce, or at world size 1),
        else an empty set."""
        if self._work is not None:
            self._work.wait()
            return {i for i, count in enumerate(self._count.tolist()) if count == 0}
        if self.world_size == 1:
            return {i for i, used in enumerate(self.used) if not used}
        return set()

    def restore_state(self, unused: set[int]) -> None:
        """Put back the error-feedback and compressor state of the parameters no rank used: for
        them the step did not happen (state created during the step starts at zero)."""
        for (index, b, slot), saved in self._saved.items():
            if index in unused:
                for key, view in self._state_slices(b, slot).items():
                    if key in saved:
                        view.copy_(saved[key])
                    else:
                        view.zero_()

    def check(self, unused: set[int], step: int, rank: int) -> None:
        """With ``find_unused_parameters=False``, refuse a step in which a parameter got no gradient
        (``step``: the synchronised step just taken, ``rank``: this rank)."""
        if self.find_unused_parameters:
            return
        missing = sorted(unused | {i for i, used in enumerate(self.used) if not used})
        if not missing:
            return
        names = self.layout.names
        listed = ", ".join(repr(names[i]) for i in missing[:8]) + (", ..." if len(missing) > 8 else "")
        where = "on some rank" if unused else f"on rank {rank}"
        raise RuntimeError(
            f"find_unused_parameters=False (the default, as for DDP), but {len(missing)} parameter(s) got no "
            f"gradient {where} in synchronised step {step}: {listed}. Pass "
            "find_unused_parameters=True (in Lightning: GCFusedStrategy(find_unused_parameters=True) or "
            "strategy='gc_fused_find_unused_parameters_true'), or freeze those parameters (requires_grad=False)."
        )
