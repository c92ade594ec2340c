"""``topk``: the k largest magnitudes, over the whole bucket or chunk by chunk, with values as they
are or quantized to a few bits (docs/algorithms.md §3)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..bucket import Bucket
from ..communicators import Payload
from ..registry import Option
from .base import COMPRESSORS
from .packing import WIDTHS
from .sparse import DENSITY, Sparsifier, keep_count


@COMPRESSORS.register("topk")
class TopK(Sparsifier):
    """Top-k (Aji & Heafield, EMNLP 2017; Stich et al., NeurIPS 2018): the ``k = max(1, ⌊δn⌋)``
    entries of largest ``|g|``, exactly. Fixed size: every rank sends ``k`` values + ``k`` indices.

    Chunked (``chunk = C > 0``, SparseLoCo's form: Sarfi et al. 2025): the bucket is cut into
    chunks of ``C`` consecutive elements (the last one shorter when ``C`` does not divide ``n``),
    and each chunk of ``c`` elements sends its ``max(1, ⌊δc⌋)`` entries of largest ``|g|``. Why:
    one batched top-k per bucket over small rows (:func:`~gc_strategy.kernels.chunk_top_k`: one
    pass over the bucket on CUDA) instead of a selection over all of it, and
    in-chunk indices of 1 byte (``C ≤ 256``) or 2 (``C ≤ 32768``) instead of 4.

    Quantized values (``value_bits = b`` in 1, 2, 4, 8; SparseLoCo sends 2): each kept value ``v``
    travels as a sign bit and ``b − 1`` magnitude bits on its chunk's scale ``s = max |v|`` (the
    bucket's where unchunked), ``L = 2^(b−1)`` levels at the centres of ``L`` equal steps:

        j = min(⌊|v| L / s⌋, L − 1)        v̂ = sign(v) (j + ½) s / L

    so ``|v − v̂| ≤ s / 2L``, and error feedback keeps ``v − v̂`` with what was not sent. The level
    placement is ours: the paper gives the bit width, not the levels.
    """

    OPTIONS = {
        "density": DENSITY,
        "chunk": Option(0, int, low=0, help="elements per chunk, each with its own top-k (0: one top-k)"),
        "value_bits": Option(0, int, low=0, high=8, help="bits per sent value, 1, 2, 4 or 8 (0: as they are)"),
    }

    def __init__(self, **options) -> None:
        super().__init__(**options)
        bits = self.options["value_bits"]
        if bits not in (0, *WIDTHS):
            raise ValueError(f"topk: option 'value_bits' = {bits} is invalid; allowed: 0, 1, 2, 4, 8")
        self._offsets: dict[tuple[int, int, torch.device], Tensor] = {}

    def select(self, flat: Tensor, bucket: Bucket) -> Tensor:
        return kernels.top_k(self.magnitudes(flat, bucket), keep_count(self.options["density"], flat.numel()))

    def _layout(self, n: int) -> tuple[int, int, int, int]:
        """(full chunks, entries kept per full chunk, length of the last short chunk, entries it keeps)."""
        chunk, density = self.options["chunk"], self.options["density"]
        full, rest = divmod(n, chunk)
        return full, keep_count(density, chunk), rest, keep_count(density, rest) if rest else 0

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        values, indices = self._top(flat, bucket)
        if not self.options["value_bits"]:
            return [values, indices]
        return [*self._quantized(values, flat.numel()), indices]

    def _scale_counts(self, n: int) -> tuple[int, int, int]:
        """(chunks of ``kept`` values, ``kept``, values of the last short chunk): the values each
        scale covers, in payload order."""
        if not self.options["chunk"]:
            return 1, keep_count(self.options["density"], n), 0
        full, kept, _, rest_kept = self._layout(n)
        return full, kept, rest_kept

    def _per_value(self, scales: Tensor, n: int) -> Tensor:
        """Each sent value's scale (fixed counts: no read of the device)."""
        full, kept, rest_kept = self._scale_counts(n)
        return torch.cat([scales[:full].repeat_interleave(kept), scales[full:].expand(rest_kept)])

    def _quantized(self, values: Tensor, n: int) -> list[Tensor]:
        """[packed codes, fp32 scales] of the kept ``values`` (see the class docstring)."""
        full, kept, rest_kept = self._scale_counts(n)
        magnitudes = values.float().abs()
        scales = [magnitudes[: full * kept].view(full, kept).amax(1)] if full else []
        scales += [magnitudes[full * kept :].amax(0, keepdim=True)] if rest_kept else []
        scales = torch.cat(scales)
        levels = 1 << (self.options["value_bits"] - 1)
        ratio = magnitudes.div_(self._per_value(scales, n).clamp_min(torch.finfo(torch.float32).tiny))
        codes = ratio.mul_(levels).floor_().clamp_(max=levels - 1).to(torch.uint8)
        codes |= (values < 0).to(torch.uint8) << (self.options["value_bits"] - 1)
        return [kernels.pack_bits(codes, self.options["value_bits"]), scales]

    def values_of(self, payload: Payload, bucket: Bucket) -> Tensor:
        if not self.options["value_bits"]:
            return payload[0]
        packed, scales, indices = payload
        bits = self.options["value_bits"]
        levels = 1 << (bits - 1)
        codes = kernels.unpack_bits(packed, bits, indices.numel())
        magnitude = (codes & (levels - 1)).float().add_(0.5).mul_(self._per_value(scales, bucket.numel))
        return torch.where(codes >= levels, -magnitude, magnitude).div_(levels)

    def _top(self, flat: Tensor, bucket: Bucket) -> tuple[Tensor, Tensor]:
        """The kept values and their indices (in-chunk ones where chunked)."""
        chunk = self.options["chunk"]
        if not chunk:
            return tuple(super().encode(flat, bucket))
        full, kept, rest, rest_kept = self._layout(flat.numel())
        magnitudes = self.magnitudes(flat, bucket)
        values, indices = [], []
        if full:
            top = kernels.chunk_top_k(magnitudes[: full * chunk].view(full, chunk), kept)
            values.append(flat[: full * chunk].view(full, chunk).gather(1, top).view(-1))
            indices.append(top.view(-1))
        if rest:
            top = torch.topk(magnitudes[full * chunk :], rest_kept, sorted=False).indices
            values.append(flat[full * chunk :].index_select(0, top))
            indices.append(top)
        index_dtype = torch.uint8 if chunk <= 256 else torch.int16 if chunk <= 32768 else torch.int32
        self._selected += full * kept + rest_kept
        self._elements += flat.numel()
        return torch.cat(values), torch.cat(indices).to(index_dtype)

    def positions(self, indices: Tensor, bucket: Bucket) -> Tensor:
        """In-chunk indices plus their chunk's start: one add over the ranks' indices at once."""
        if not self.options["chunk"]:
            return indices
        key = (bucket.index, bucket.numel, indices.device)
        if key not in self._offsets:
            full, kept, rest, rest_kept = self._layout(bucket.numel)
            starts = (
                torch.arange(full * kept, device=indices.device)
                .div_(kept, rounding_mode="floor")
                .mul_(self.options["chunk"])
            )
            self._offsets[key] = torch.cat(
                [starts, torch.full((rest_kept,), full * self.options["chunk"], device=indices.device)]
            )
        offsets = self._offsets[key]
        return (indices.view(-1, offsets.numel()) + offsets).view(-1)  # promoted to int64 by the add
