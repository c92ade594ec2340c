"""Buckets: the fused flat gradient buffers the synchroniser compresses and communicates.

A :class:`Bucket` is a contiguous group of parameters (in gradient-ready order) whose gradients are
copied into one flat vector. :class:`BucketState` holds per-element state (error-feedback residuals,
momenta) as one flat vector per bucket and converts it to and from a per-parameter form, so the state
survives a change of fusion plan and is saved in checkpoints independently of the plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

import numpy
import torch
from torch import Tensor

from . import kernels


@dataclass
class Bucket:
    """One fused bucket: ``names[i]`` occupies ``flat[offsets[i] : offsets[i] + numels[i]]``."""

    index: int
    names: list[str]
    shapes: list[torch.Size]
    dtype: torch.dtype
    device: torch.device
    offsets: list[int] = field(init=False)
    numels: list[int] = field(init=False)
    numel: int = field(init=False)
    _device_cache: dict[tuple[str, torch.device], Tensor] = field(
        init=False, default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.numels = [shape.numel() for shape in self.shapes]
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total

    def views(self, flat: Tensor) -> list[Tensor]:
        """The per-parameter views of a flat vector laid out like this bucket."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def tensor_ids(self, device: torch.device) -> Tensor:
        """``ids[j]`` = which of the bucket's tensors element ``j`` of the flat vector belongs to."""
        return self._cached(
            "tensor_ids",
            device,
            lambda: torch.repeat_interleave(torch.arange(len(self.numels)), torch.tensor(self.numels)),
        )

    def sum_per_tensor(self, values: Tensor, magnitudes: bool = False) -> Tensor:
        """Per-tensor sums of a flat fp32 vector: ``out[t] = Σ_{j in tensor t} values[j]`` (of
        ``|values[j]|`` with ``magnitudes``; :func:`gc_strategy.kernels.sum_per_tensor`)."""
        return kernels.sum_per_tensor(values, self.offsets, self.numels, self.lengths(values.device), magnitudes)

    def lengths(self, device: torch.device) -> Tensor:
        """The tensors' element counts, on ``device`` (cached: no host-to-device copy, which would
        block the host, in the step)."""
        return self._cached("lengths", device, lambda: torch.tensor(self.numels))

    def boundaries(self, device: torch.device) -> Tensor:
        """``[0, end of tensor 0, end of tensor 1, ...]`` (int64, ``tensors + 1``), on ``device`` (cached)."""
        return self._cached("boundaries", device, lambda: torch.tensor([0, *self.numels]).cumsum(0))

    def _cached(self, what: str, device: torch.device, make) -> Tensor:
        key = (what, torch.device(device))
        if key not in self._device_cache:
            self._device_cache[key] = to_device(make(), key[1])
        return self._device_cache[key]

    def per_element(self, per_tensor: Tensor) -> Tensor:
        """Spread one value per tensor over the tensor's elements (the inverse layout of the sums)."""
        return per_tensor[self.tensor_ids(per_tensor.device)]

    def select_per_tensor(self, mask: Tensor, if_true: Tensor, if_false: Tensor, out: Tensor | None = None) -> Tensor:
        """``out[j] = if_true[t(j)] if mask[j] else if_false[t(j)]`` for per-tensor values (``t(j)``:
        the tensor of element ``j``; ``mask`` bool or 0/1 integers), written into ``out`` when given
        (of the values' dtype; :func:`gc_strategy.kernels.select_per_tensor`)."""
        ids = partial(self.tensor_ids, mask.device)  # bucket-sized: made only by the variant that gathers
        return kernels.select_per_tensor(mask, if_true, if_false, self.offsets, self.numels, ids, out)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def all_finite(flat: Tensor) -> Tensor:
    """0-d bool tensor: no inf or NaN in ``flat`` (:func:`gc_strategy.kernels.all_finite`: one
    reduction pass, without the bool temporary of ``isfinite(flat).all()``); stays on the device
    (no host synchronisation)."""
    if flat.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=flat.device)
    return kernels.all_finite(flat)


def finite_on_host(finite: Tensor) -> bool:
    """The 0-d bool ``finite`` (from :func:`all_finite`) is True and readable without waiting for a
    device: in host memory. Elsewhere False, so callers take their path that needs no host read."""
    return kernels.in_host_memory(finite) and bool(finite)


def assign_if_finite(target: Tensor, value: Tensor, finite: Tensor) -> None:
    """``target ← value`` where the 0-d bool ``finite`` (from :func:`all_finite`) is True; else
    ``target`` stays as it was (:func:`gc_strategy.kernels.assign_if_finite`)."""
    kernels.assign_if_finite(target, value, finite)


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A host tensor copied to ``device`` without the host waiting: a copy from pageable memory
    waits for the device's stream, one from pinned memory is queued on it (``non_blocking``)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's value on its way to host memory, read later without the host waiting.

    Reading a device value on the host (``int(t)``) waits for everything queued before it. A
    decision that may lag (SIDCo's stage count) starts the copy where the value is made, into
    pinned memory, queued behind the kernels that make it, and reads it when next needed: by then
    the copy has landed. Only a host that runs that far ahead of the device waits for it (on its
    event), and the device then has that much work queued. The host's value lands in a NumPy
    array, so that reading it runs no tensor op.
    """

    def __init__(self, value: Tensor) -> None:
        self._event = None
        if value.device.type == "cuda":
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._array = host.numpy()
        else:
            self._array = numpy.empty(tuple(value.shape), dtype=str(value.dtype).removeprefix("torch."))
            torch.from_numpy(self._array).copy_(value)

    def value(self):
        """The value, as a NumPy array (0-d for a 0-d tensor). The event is asked first: a copy that
        has landed, as it has where the host is not far ahead, takes no host synchronisation."""
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        return self._array


def split_by_parameter(buckets: Iterable[Bucket], flats: dict[int, Tensor]) -> dict[str, Tensor]:
    """Per-bucket flat vectors -> ``{parameter name: tensor of the parameter's shape}``."""
    out: dict[str, Tensor] = {}
    for bucket in buckets:
        if bucket.index in flats:
            out.update(zip(bucket.names, (v.clone() for v in bucket.views(flats[bucket.index]))))
    return out


def join_by_parameter(buckets: Iterable[Bucket], tensors: dict[str, Tensor], device: torch.device) -> dict[int, Tensor]:
    """``{parameter name: tensor}`` -> per-bucket flat fp32 vectors (zeros where a name is missing)."""
    out: dict[int, Tensor] = {}
    for bucket in buckets:
        if not any(name in tensors for name in bucket.names):
            continue
        flat = torch.zeros(bucket.numel, dtype=torch.float32, device=device)
        for name, view in zip(bucket.names, bucket.views(flat)):
            if name in tensors:
                view.copy_(tensors[name].reshape(view.shape))
        out[bucket.index] = flat
    return out


class BucketState:
    """Named per-element fp32 state, one flat vector per bucket, created lazily as zeros.

    Subclasses (memories, stateful compressors) call :meth:`buffer` (or :meth:`rewritten`); the
    synchroniser saves and restores the state with :meth:`state_by_parameter` /
    :meth:`load_state_by_parameter`, which also carries it across a rebuild of the buckets.

    A round that may not commit (fault tolerance) holds a rollback point (:meth:`hold`): the first
    write of each vector after it goes to a second vector and the first is kept, so that
    :meth:`release` can put it back. A writer that forms the new value from the old in one pass
    (``e ← e + g``) reads the old vector and writes the other (:meth:`rewritten`): the rollback point
    then costs no pass at all; :meth:`buffer` copies the old values across first.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, dict[int, Tensor]] = {}
        self._workspaces: dict[tuple[str, int], Tensor] = {}
        #: under a rollback point: each vector written since, as it was (None: there was none), by (name, bucket)
        self._held: dict[tuple[str, int], Tensor | None] | None = None
        #: vectors of earlier rollback points, no longer needed: the next round's second vectors
        self._spares: dict[tuple[str, int], Tensor] = {}
        self._names: set[str] = set()  # the states there were at the rollback point

    def workspace(self, name: str, bucket: Bucket, dtype: torch.dtype = torch.float32) -> Tensor:
        """A bucket-sized scratch vector kept from step to step but never saved, its contents left
        from the last use: for temporaries written in full before they are read (``torch.abs(g,
        out=...)``). On the CPU a fresh bucket-sized tensor costs its page faults at every step
        (above glibc's mmap threshold every allocation is mapped anew), more than the pass that
        fills it. Not for what leaves the step (an average that becomes ``.grad``)."""
        key = (name, bucket.index)
        scratch = self._workspaces.get(key)
        if scratch is None or scratch.numel() != bucket.numel or scratch.dtype != dtype:
            scratch = self._workspaces[key] = torch.empty(bucket.numel, dtype=dtype, device=bucket.device)
        return scratch

    def buffer(self, name: str, bucket: Bucket) -> Tensor:
        """State ``name`` of ``bucket``, to read and update in place."""
        values, target = self.rewritten(name, bucket)
        return target if target is values else target.copy_(values)

    def rewritten(self, name: str, bucket: Bucket) -> tuple[Tensor, Tensor]:
        """``(values, target)``: state ``name`` of ``bucket`` as it is, and the vector to write its
        new value into, in full: the same vector, except at the first write under a rollback point,
        where ``values`` is kept for :meth:`release` and ``target`` takes its place."""
        per_bucket, key = self.buffers.setdefault(name, {}), (name, bucket.index)
        values = per_bucket.get(bucket.index)
        if self._held is None or key in self._held:
            if values is None:
                values = per_bucket[bucket.index] = torch.zeros(bucket.numel, dtype=torch.float32, device=bucket.device)
            return values, values
        self._held[key] = values
        if values is None:
            values = torch.zeros(bucket.numel, dtype=torch.float32, device=bucket.device)
        target = self._spares.pop(key, None)
        if target is None or (target.shape, target.device) != (values.shape, values.device):
            target = torch.empty_like(values)
        per_bucket[bucket.index] = target
        return values, target

    def undo_rewrite(self, name: str, bucket: Bucket) -> None:
        """Take back :meth:`rewritten`'s ``target`` before anything was written into it (a path that
        turned out to update in place): the state is ``values`` again, rewritten at its next write."""
        key = (name, bucket.index)
        if self._held is None or key not in self._held:
            return
        per_bucket, values = self.buffers[name], self._held.pop(key)
        self._spares[key] = per_bucket.pop(bucket.index)
        if values is not None:
            per_bucket[bucket.index] = values

    def hold(self) -> None:
        """A rollback point: the state as it is now is what :meth:`release` puts back (an earlier
        rollback point not released is kept to)."""
        self.release(keep_changes=True)
        self._held, self._names = {}, set(self.buffers)

    def release(self, keep_changes: bool) -> None:
        """End the rollback point: keep the state written since (``True``), or put it back as it was."""
        if self._held is None:
            return
        held, self._held = self._held, None
        for (name, index), old in held.items():
            per_bucket = self.buffers[name]
            if keep_changes:
                spare = old
            else:
                spare = per_bucket.pop(index)
                if old is not None:
                    per_bucket[index] = old
            if spare is not None:
                self._spares[(name, index)] = spare
        if not keep_changes:  # a state first written since
            for name in set(self.buffers) - self._names:
                del self.buffers[name]

    def held_buffers(self) -> dict[str, dict[int, Tensor]]:
        """The per-element state as it was at the rollback point (as it is, where none is held):
        the vectors kept for :meth:`release`, no copy."""
        if self._held is None:
            return self.buffers
        buffers = {name: dict(per_bucket) for name, per_bucket in self.buffers.items() if name in self._names}
        for (name, index), old in self._held.items():
            if name not in buffers:
                continue
            if old is None:
                buffers[name].pop(index, None)
            else:
                buffers[name][index] = old
        return buffers

    def move_state(self, device: torch.device) -> None:
        """Move the per-element state to ``device`` and drop the scratch workspaces: for state
        kept in CPU memory between uses (DiLoCo's ``offload=True``)."""
        for per_bucket in self.buffers.values():
            for index, tensor in per_bucket.items():
                per_bucket[index] = tensor.to(device)
        for key, old in (self._held or {}).items():
            self._held[key] = None if old is None else old.to(device)
        self._workspaces.clear()
        self._spares.clear()

    def state_by_parameter(self, buckets: list[Bucket]) -> dict[str, dict[str, Tensor]]:
        return {name: split_by_parameter(buckets, flats) for name, flats in self.buffers.items()}

    def load_state_by_parameter(self, state: dict[str, dict[str, Tensor]], buckets: list[Bucket]) -> None:
        device = buckets[0].device if buckets else torch.device("cpu")
        self.buffers = {name: join_by_parameter(buckets, tensors, device) for name, tensors in state.items()}
