"""Stochastic quantizers (ALGORITHMS.md §4): ``qsgd``, ``terngrad``, ``natural``.

Each rank quantizes with its own scale and independent randomness, so payloads are gathered and
the decodes averaged. Codes are bit-packed (:mod:`.packing`): the wire carries what the method claims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..bucket import Bucket
from ..comm import Payload
from ..registry import Option
from .base import COMPRESSORS, Compressor, written
from . import triton_bits
from .packing import bits_for, pack_bits, unpack_bits
from .sparse import SEED


class _Quantizer(Compressor):
    summable = False

    def _uniform(self, shape: tuple[int, ...], bucket: Bucket, device: torch.device) -> Tensor:
        """U[0, 1) draws, independent across ranks, reproducible from (seed, step, bucket, rank)."""
        return torch.rand(shape, device=device, generator=self.generator(bucket, device, shared=False))


class _LevelQuantizer(_Quantizer):
    """Stochastic rounding of ``|x| · s / scale`` to a neighbouring integer level in ``[0, s]``, with
    the sign of ``x`` and one scale per chunk: payload ``[scales, codes q + s packed]``, decode
    ``(code − s) · scale / s``. On CUDA with Triton the encode is one kernel drawing its own Philox
    uniforms (the same distribution as the torch code's draws, not the same numbers) and the
    aggregate one pass over all ranks' codes (:func:`~gc_strategy.algos.triton_bits.level_codes`,
    :func:`~gc_strategy.algos.triton_bits.mean_of_levels`)."""

    def levels(self) -> int:
        raise NotImplementedError

    def chunk(self, n: int) -> int:
        """Elements per scale."""
        return max(1, n)

    def scales(self, g: Tensor) -> tuple[Tensor, Tensor | None]:
        """The per-chunk scales of ``g`` and the clipping bound (0-d) or None."""
        raise NotImplementedError

    def bits(self) -> int:
        return bits_for(2 * self.levels() + 1)

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        s, chunk = self.levels(), self.chunk(flat.numel())
        scales, bound = self.scales(flat.float())
        if triton_bits.usable(flat):
            return [scales, triton_bits.level_codes(flat, scales, chunk, s, self.bits(), self.seed_for(bucket, shared=False), bound)]
        g = flat.float() if bound is None else flat.float().clamp(-bound, bound)
        scaled = self._chunked(g.abs(), chunk) * s / scales.view(-1, 1).clamp_min(torch.finfo(torch.float32).tiny)
        uniform = self._uniform(scaled.shape, bucket, flat.device)
        levels = (scaled.floor() + (uniform < scaled - scaled.floor())).clamp_max(s).view(-1)[: flat.numel()] * g.sign()
        return [scales, pack_bits((levels + s).to(torch.uint8), self.bits())]

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        scales, packed = payload
        s, chunk = self.levels(), self.chunk(bucket.numel)
        codes = self._chunked(unpack_bits(packed, self.bits(), bucket.numel).float() - s, chunk)
        return (codes * scales.view(-1, 1) / s).view(-1)[: bucket.numel]

    def aggregate(self, gathered: list[Payload], bucket: Bucket, out: Tensor | None = None) -> Tensor:
        if not triton_bits.usable(gathered[0][-1]):
            return super().aggregate(gathered, bucket, out=out)
        scales, codes = (torch.stack([payload[k] for payload in gathered]) for k in (0, 1))
        return written(triton_bits.mean_of_levels(codes, scales, self.chunk(bucket.numel), self.levels(), self.bits(),
                                                  bucket.numel, out), out)

    @staticmethod
    def _chunked(flat: Tensor, chunk: int) -> Tensor:
        return torch.nn.functional.pad(flat, (0, (-flat.numel()) % chunk)).view(-1, chunk)


@COMPRESSORS.register("qsgd")
class QSGD(_LevelQuantizer):
    """QSGD (Alistarh et al., NeurIPS 2017): with ``s`` levels and ``‖g‖₂`` per chunk,
    ``q_i = sign(g_i) · (⌊s|g_i|/‖g‖⌋ + Bernoulli(frac))`` (unbiased: ``E[‖g‖ q / s] = g``).
    Codes ``q + s`` in ``[0, 2s]`` are packed in the fewest bits holding ``2s+1`` values (2 bits for
    s = 1, 4 for s ≤ 7, 8 for s ≤ 127), plus one fp32 norm per chunk of ``chunk`` elements
    (``chunk = 0``: one norm for the whole bucket)."""

    OPTIONS = {
        "levels": Option(127, int, low=1, high=127, help="s"),
        "chunk": Option(0, int, low=0, help="elements per norm (0: the whole bucket)"),
        "seed": SEED,
    }

    def levels(self) -> int:
        return self.options["levels"]

    def chunk(self, n: int) -> int:
        return self.options["chunk"] or max(1, n)

    def scales(self, g: Tensor) -> tuple[Tensor, Tensor | None]:
        return self._chunked(g, self.chunk(g.numel())).norm(dim=1), None


@COMPRESSORS.register("terngrad")
class TernGrad(_LevelQuantizer):
    """TernGrad (Wen et al., NeurIPS 2017): optionally clip ``g`` to ``±clip_sigma·σ``, then
    ``s = max|g|`` and ``t_i = sign(g_i) · Bernoulli(|g_i|/s)`` ∈ {-1, 0, 1}, 2 bits per element
    plus ``s``; decode ``s·t`` (unbiased for the clipped gradient; ``clip_sigma = 0`` disables
    clipping, the paper uses 2.5). It is the one-level case of the level quantiser: codes ``t + 1``."""

    OPTIONS = {"clip_sigma": Option(2.5, float, low=0.0), "seed": SEED}

    def levels(self) -> int:
        return 1

    def scales(self, g: Tensor) -> tuple[Tensor, Tensor | None]:
        c = self.options["clip_sigma"]
        top = g.abs().max().reshape(1)
        if c > 0 and g.numel() > 1:
            bound = c * g.std()
            return torch.minimum(top, bound), bound  # max |clip(g)| without the clipped copy
        return top, None


@COMPRESSORS.register("natural")
class Natural(_Quantizer):
    """Natural compression (Horváth et al., 2019, "Natural Compression for Distributed Deep
    Learning"): each value is rounded stochastically to one of the two nearest signed powers of two,
    ``2^e ≤ |g| < 2^(e+1)`` → ``2^(e+1)`` with probability ``(|g| - 2^e) / 2^e``, else ``2^e``
    (unbiased). One byte per element: the sign bit and the exponent as an offset ``d ∈ [0, 126]``
    below the bucket's top exponent ``E`` (sent as one int32); code 127 is zero. The paper's format
    keeps fp32's full 8-bit exponent (9 bits); offsets relative to ``E`` fit one byte, and values below
    ``2^(E-126)`` (over 10^37 times smaller than the largest) are rounded stochastically to 0 or
    ``2^(E-126)``, still unbiased."""

    OPTIONS = {"seed": SEED}
    ZERO = 127

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        g = flat.float()
        a = g.abs()
        top = torch.frexp(a.max()).exponent.to(torch.int32)  # a.max() < 2^top
        floor_exp = torch.frexp(a).exponent - 1  # 2^floor_exp <= a < 2^(floor_exp + 1) for a > 0
        low = torch.ldexp(torch.ones_like(a), floor_exp)
        uniform = self._uniform((2, a.numel()), bucket, a.device)
        exponent = floor_exp + (uniform[0] < (a - low) / low)
        smallest = top - 126
        tiny_kept = uniform[1] < a / torch.ldexp(torch.ones_like(a), smallest.expand_as(floor_exp))
        offset = torch.where(exponent < smallest, torch.where(tiny_kept, 126, self.ZERO), top - exponent)
        offset = torch.where(a == 0, self.ZERO, offset)
        codes = offset.to(torch.uint8) | ((g < 0).to(torch.uint8) << 7)
        return [top.reshape(1), codes]

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        top, codes = payload
        offset = (codes & 127).to(torch.int32)
        magnitude = torch.ldexp(torch.ones(codes.shape, device=codes.device), top - offset)
        magnitude = torch.where(offset == self.ZERO, 0.0, magnitude)
        return torch.where((codes >> 7).bool(), -magnitude, magnitude)
