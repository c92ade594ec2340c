"""Stochastic quantizers (docs/algorithms.md §4): ``qsgd``, ``terngrad``, ``natural``.

Each rank quantizes with its own scale and independent randomness, so payloads are gathered and
the decodes averaged. Codes are bit-packed (:func:`gc_strategy.kernels.pack_bits`): the wire
carries what the method claims.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .. import kernels
from ..bucket import Bucket
from ..communicators import Payload
from ..kernels import triton_bits
from ..registry import Option
from .base import COMPRESSORS, Compressor, stored_in
from .packing import bits_for
from .sparse import SEED


class _Quantizer(Compressor):
    summable = False

    def _uniform(self, out: Tensor, bucket: Bucket) -> Tensor:
        """``out`` (fp32) filled with U[0, 1) draws, independent across ranks, reproducible from
        (seed, step, bucket, rank)."""
        return kernels.uniform_(out, self.seed_for(bucket, shared=False))


class _LevelQuantizer(_Quantizer):
    """Stochastic rounding of ``|x| · s / scale`` to a neighbouring integer level in ``[0, s]``, with
    the sign of ``x`` and one scale per chunk: payload ``[scales, codes q + s packed]``, decode
    ``(code − s) · scale / s``. On CUDA with Triton the encode is one kernel drawing its own Philox
    uniforms (the same distribution as the torch code's draws, not the same numbers) and the
    aggregate one pass over all ranks' codes (:func:`~gc_strategy.kernels.triton_bits.level_codes`,
    :func:`~gc_strategy.kernels.triton_bits.mean_of_levels`)."""

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
        if kernels.uses_triton(flat):
            return [
                scales,
                triton_bits.level_codes(
                    flat, scales, chunk, s, self.bits(), self.seed_for(bucket, shared=False), bound
                ),
            ]
        # in place in workspaces (no new bucket-sized tensors): x = |clip(g)| s / scale, then
        # level = ⌊x⌋ + [u < x − ⌊x⌋], the test as ⌊u − frac⌋ = −1 (a rounded difference keeps its sign)
        x = self.magnitudes(flat, bucket)
        if bound is not None:
            x.clamp_max_(bound)
        _scale_chunks_(x, s / scales.clamp_min(torch.finfo(torch.float32).tiny), chunk)
        level = torch.floor(x, out=self.workspace("level", bucket))
        uniform = self._uniform(self.workspace("uniform", bucket), bucket)
        level.sub_(uniform.sub_(x.sub_(level)).floor_()).clamp_max_(s)
        codes = level.copysign_(flat).add_(s).to(torch.uint8)  # q + s in [0, 2s]; the payload is a new tensor
        return [scales, kernels.pack_bits(codes, self.bits())]

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        return self.decode_into(payload, bucket, torch.empty(bucket.numel, device=payload[1].device))

    def decode_into(self, payload: Payload, bucket: Bucket, scratch: Tensor) -> Tensor:
        scales, packed = payload
        s = self.levels()
        codes = scratch.copy_(kernels.unpack_bits(packed, self.bits(), bucket.numel)).sub_(s)
        return _scale_chunks_(codes, scales / s, self.chunk(bucket.numel))

    def aggregate(self, gathered: list[Payload], bucket: Bucket, out: Tensor | None = None) -> Tensor:
        if not kernels.uses_triton(gathered[0][-1]):
            return super().aggregate(gathered, bucket, out=out)
        scales, codes = (torch.stack([payload[k] for payload in gathered]) for k in (0, 1))
        return stored_in(
            triton_bits.mean_of_levels(
                codes, scales, self.chunk(bucket.numel), self.levels(), self.bits(), bucket.numel, out
            ),
            out,
        )


def _scale_chunks_(flat: Tensor, factors: Tensor, chunk: int) -> Tensor:
    """``flat[j] *= factors[j // chunk]`` in place (the last chunk may be short)."""
    whole = flat.numel() // chunk * chunk
    flat[:whole].view(-1, chunk).mul_(factors[: whole // chunk].view(-1, 1))
    if whole < flat.numel():
        flat[whole:].mul_(factors[-1])
    return flat


#: elements per scale by default. A scale taken over a whole fused bucket makes the estimator's
#: variance grow with the bucket (QSGD's bound, Alistarh et al. Lemma 3.1: E‖Q(g) − g‖² ≤
#: min(d/s², √d/s)·‖g‖² for d elements per norm), so fusing buckets would change the method's
#: statistics; with a fixed chunk they do not depend on the fusion plan.
#: docs/benchmarks/quantizer_variance_cpu.md measures it on ResNet-18's gradients.
DEFAULT_CHUNK = 512


def _chunk_norms(flat: Tensor, chunk: int) -> Tensor:
    """The 2-norm of each ``chunk`` elements of ``flat`` (the last chunk may be short)."""
    whole = flat.numel() // chunk * chunk
    norms = flat[:whole].view(-1, chunk).norm(dim=1)
    return torch.cat([norms, flat[whole:].norm().reshape(1)]) if whole < flat.numel() else norms


@COMPRESSORS.register("qsgd")
class QSGD(_LevelQuantizer):
    """QSGD (Alistarh et al., NeurIPS 2017): with ``s`` levels and ``‖g‖₂`` per chunk,
    ``q_i = sign(g_i) · (⌊s|g_i|/‖g‖⌋ + Bernoulli(frac))`` (unbiased: ``E[‖g‖ q / s] = g``).
    Codes ``q + s`` in ``[0, 2s]`` are packed in the fewest bits holding ``2s+1`` values (2 bits for
    s = 1, 4 for s ≤ 7, 8 for s ≤ 127), plus one fp32 norm per chunk of ``chunk`` elements
    (``chunk = 0``: one norm for the whole bucket, whose variance grows with the bucket: see
    :data:`DEFAULT_CHUNK`)."""

    OPTIONS = {
        "levels": Option(127, int, low=1, high=127, help="s"),
        "chunk": Option(DEFAULT_CHUNK, int, low=0, help="elements per norm (0: the whole bucket)"),
        "seed": SEED,
    }

    def levels(self) -> int:
        return self.options["levels"]

    def chunk(self, n: int) -> int:
        return self.options["chunk"] or max(1, n)

    def scales(self, g: Tensor) -> tuple[Tensor, Tensor | None]:
        return _chunk_norms(g, self.chunk(g.numel())), None


@COMPRESSORS.register("terngrad")
class TernGrad(_LevelQuantizer):
    """TernGrad (Wen et al., NeurIPS 2017): optionally clip ``g`` to ``±clip_sigma·σ``, then per
    chunk of ``chunk`` elements ``s = max|g|`` and ``t_i = sign(g_i) · Bernoulli(|g_i|/s)`` ∈
    {-1, 0, 1}, 2 bits per element plus one fp32 ``s`` per chunk; decode ``s·t`` (unbiased for the
    clipped gradient; ``clip_sigma = 0`` disables clipping, the paper uses 2.5). It is the one-level
    case of the level quantiser: codes ``t + 1``. The paper scales per layer; a fixed chunk keeps
    the variance independent of the fusion plan (:data:`DEFAULT_CHUNK`; ``chunk = 0``: one scale
    per bucket). σ is the bucket's sample standard deviation (with ``n − 1``)."""

    OPTIONS = {
        "clip_sigma": Option(2.5, float, low=0.0),
        "chunk": Option(DEFAULT_CHUNK, int, low=0, help="elements per scale (0: the whole bucket)"),
        "seed": SEED,
    }

    def levels(self) -> int:
        return 1

    def chunk(self, n: int) -> int:
        return self.options["chunk"] or max(1, n)

    def scales(self, g: Tensor) -> tuple[Tensor, Tensor | None]:
        c = self.options["clip_sigma"]
        top = _chunk_max_magnitudes(g, self.chunk(g.numel()))
        if c > 0 and g.numel() > 1:
            bound = c * g.std()
            return torch.minimum(top, bound), bound  # max |clip(g)| without the clipped copy
        return top, None


def _chunk_max_magnitudes(flat: Tensor, chunk: int) -> Tensor:
    """``max |x|`` of each ``chunk`` elements of ``flat`` (the last chunk may be short), without a
    bucket-sized ``|flat|``."""
    whole = flat.numel() // chunk * chunk
    pieces = [flat[:whole].view(-1, chunk)] if whole else []
    if whole < flat.numel():
        pieces.append(flat[whole:].view(1, -1))
    tops = torch.empty(sum(len(piece) for piece in pieces), dtype=flat.dtype, device=flat.device)
    for piece, out in zip(pieces, tops.split([len(piece) for piece in pieces])):
        kernels.row_max_magnitudes(piece, out=out)
    return tops


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
        a = self.magnitudes(flat, bucket)
        top = torch.frexp(a.max()).exponent  # a.max() < 2^top
        # a = m 2^x with m in [0.5, 1): 2^(x-1) <= a < 2^x, rounded up to 2^x with probability
        # (a - 2^(x-1)) / 2^(x-1) = 2m - 1; offset d = top - exponent = top + 1 - x - [up]
        mantissa, offset = kernels.frexp_into(
            a, self.workspace("mantissa", bucket), self.workspace("exponent", bucket, torch.int32)
        )
        uniform = self._uniform(self.workspace("uniform", bucket), bucket)
        up = torch.lt(uniform, mantissa.mul_(2).sub_(1), out=self.workspace("up", bucket, torch.int32))
        offset.neg_().add_(top + 1).sub_(up)
        # below 2^(top-126) (d > 126): 2^(top-126) with probability a / 2^(top-126), else 0 (code 127);
        # the element's one draw decides (its rounding draw is not used there)
        tiny = offset.clamp_max_(self.ZERO) == self.ZERO
        # x86 divides by a subnormal ~100x slower: on the host only when needed
        if not kernels.in_host_memory(a) or bool(tiny.any()):
            one = _code_table(a.device)[2][0]
            smallest = torch.ldexp(one, top - 126)  # may be subnormal: still exact
            offset.masked_fill_(tiny & (uniform < torch.div(a, smallest, out=mantissa)), self.ZERO - 1)
        kernels.fill_where_zero(offset, a, self.ZERO)
        negative = torch.lt(flat, 0, out=self.workspace("negative", bucket, torch.bool))
        codes = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)  # the payload is a new tensor
        return [top.to(torch.int32).reshape(1), torch.add(offset, negative, alpha=128, out=codes)]

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        return self.decode_into(payload, bucket, torch.empty(bucket.numel, device=payload[1].device))

    def decode_into(self, payload: Payload, bucket: Bucket, scratch: Tensor) -> Tensor:
        """A gather from the 256 values a code byte can stand for, ``±2^(top − d)`` and 0 for
        ``d = 127``: one indexed read per element instead of ``ldexp`` and ``where``; the table is
        ``2^(top − d) · sign`` from offsets and signs made once per device."""
        top, codes = payload
        offsets, signs, ones = _code_table(codes.device)
        values = torch.ldexp(ones, top - offsets).mul_(signs)
        return torch.index_select(values, 0, codes.int(), out=scratch)


@functools.cache
def _code_table(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Per code byte of :class:`Natural`: its offset ``d`` (the low 7 bits), its sign (−1 where the
    high bit is set, 0 for ``d = 127``, else 1), and ones to scale."""
    byte = torch.arange(256, device=device)
    offsets = byte & 127
    signs = torch.where(byte >= 128, -1.0, 1.0).masked_fill_(offsets == Natural.ZERO, 0.0)
    return offsets, signs, torch.ones(256, device=device)
