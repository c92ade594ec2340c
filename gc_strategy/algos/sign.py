"""Sign methods (docs/algorithms.md §4): ``onebit``, ``signsgd``, ``signum``, ``efsignsgd``.

All send one bit per element, packed (``ceil(n/8)`` bytes): bit = ``g_i ≥ 0``, plus the method's
scalars. ``signsgd`` and ``signum`` aggregate by majority vote, ``sign(Σ_r sign_r)`` (0 on a tie);
``onebit`` and ``efsignsgd`` average the scaled decodes.

The scalars of ``onebit`` and ``efsignsgd`` are computed **per tensor** inside a fused bucket (the
papers compress layer by layer): one scale shared by a whole bucket would give every layer the mean
magnitude of all of them, so fusion would change the algorithm. With per-tensor scalars a fused
bucket decodes exactly as its tensors compressed one by one, for a few fp32 scalars per tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..bucket import Bucket, all_finite, assign_if_finite, finite_on_host
from ..communicators import Payload
from ..kernels import triton_bits
from ..registry import Option
from .base import COMPRESSORS, Compressor, stored_in


class _SignBits(Compressor):
    """Payload ``[packed sign bits]`` or ``[per-tensor levels, packed sign bits]``."""

    summable = False

    def levels(self, g: Tensor, bucket: Bucket) -> Tensor | None:
        """The fp32 per-tensor scalars sent with the bits, or None for plain ±1."""
        return None

    def level_pair(self, levels: Tensor) -> tuple[Tensor, Tensor]:
        """Per tensor, the decoded value of a set bit and of a clear bit."""
        raise NotImplementedError

    def signed_input(self, flat: Tensor, bucket: Bucket) -> Tensor:
        """What to take the sign of (signum: the momentum)."""
        return flat

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        g = self.signed_input(flat, bucket).float()
        bits = kernels.pack_signs(g)
        levels = self.levels(g, bucket)
        return [bits] if levels is None else [levels, bits]

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        return self.decode_into(payload, bucket, torch.empty(bucket.numel, device=payload[-1].device))

    def decode_into(self, payload: Payload, bucket: Bucket, scratch: Tensor) -> Tensor:
        bits = kernels.unpack_bits(payload[-1], 1, bucket.numel)  # 0/1 codes
        if len(payload) == 1:
            return scratch.copy_(bits).mul_(2).sub_(1)
        return bucket.select_per_tensor(bits, *self.level_pair(payload[0]), out=scratch)


class _ScaledSigns(_SignBits):
    """Averages the scaled decodes of all ranks. The per-tensor levels come from per-tensor sums of
    the input. On CUDA with Triton: with residual error feedback, the encode and the residual
    update run in two passes over ``g`` and ``e`` (:meth:`encode_with_residual`), and the aggregate in one
    pass over the gathered bits (:func:`~gc_strategy.kernels.triton_bits.mean_of_signs`)."""

    #: the sums the levels come from: ``Σ|x|`` (False) or ``Σ x·[x≥0], #[x≥0], Σ x·[x<0]`` (True)
    split_sums: bool

    def sums(self, g: Tensor, bucket: Bucket) -> Tensor:
        """The per-tensor sums, one row per term. Split: in host memory each term in turn in one
        workspace (no new bucket-sized tensors, whose page faults cost more than a pass); on an
        accelerator the three side by side, summed by one segmented reduction."""
        if not self.split_sums:
            return bucket.sum_per_tensor(g, magnitudes=True)
        if not kernels.in_host_memory(g):
            terms = torch.stack([g.clamp(min=0), g.ge(0), g.clamp(max=0)], dim=1)  # the bools promoted
            return bucket.sum_per_tensor(terms).t()
        scratch = self.workspace("split", bucket)
        positive = bucket.sum_per_tensor(torch.clamp(g, min=0, out=scratch))
        count = bucket.sum_per_tensor(torch.ge(g, 0, out=scratch))
        negative = bucket.sum_per_tensor(torch.clamp(g, max=0, out=scratch))
        return torch.stack([positive, count, negative])

    def levels_from_sums(self, sums: Tensor, bucket: Bucket) -> Tensor:
        raise NotImplementedError

    def levels(self, g: Tensor, bucket: Bucket) -> Tensor:
        return self.levels_from_sums(self.sums(g, bucket), bucket)

    def encode_with_residual(
        self, grad: Tensor, residual: Tensor, finite: Tensor, bucket: Bucket, into: Tensor | None = None
    ) -> Payload | None:
        if not kernels.uses_triton(grad):
            return None
        if into is not None and into is not residual:  # the kernels update the residual in place
            residual = into.copy_(residual)
        boundaries = bucket.boundaries(grad.device)
        levels = self.levels_from_sums(triton_bits.sign_sums(grad, residual, boundaries, self.split_sums), bucket)
        return [levels, triton_bits.sign_encode(grad, residual, finite, *self.level_pair(levels), boundaries)]

    def aggregate(self, gathered: list[Payload], bucket: Bucket, out: Tensor | None = None) -> Tensor:
        if not kernels.uses_triton(gathered[0][-1]):
            return super().aggregate(gathered, bucket, out=out)
        bits = torch.stack([payload[-1] for payload in gathered])
        pairs = [self.level_pair(payload[0]) for payload in gathered]
        positive, negative = (torch.stack([pair[k] for pair in pairs]) for k in (0, 1))
        return stored_in(
            triton_bits.mean_of_signs(bits, positive, negative, bucket.boundaries(bits.device), bucket.numel, out),
            out,
        )


class _MajorityVote(_SignBits):
    def aggregate(self, gathered: list[Payload], bucket: Bucket, out: Tensor | None = None) -> Tensor:
        return self.sum_of_decodes(gathered, bucket, out).sign_()


@COMPRESSORS.register("signsgd")
class SignSGD(_MajorityVote):
    """signSGD with majority vote (Bernstein et al., ICML 2018): each rank sends ``sign(g)``
    (1 bit per element, no scalar); the result is ``sign(Σ_r sign(g_r))``, ±1 (0 on a tie): the
    learning rate carries the scale."""


@COMPRESSORS.register("signum")
class Signum(_MajorityVote):
    """Signum (Bernstein et al., ICML 2018): each rank keeps a momentum ``m = β m + (1-β) g``
    and sends ``sign(m)``; majority vote as signSGD. The momentum is not updated from a bucket
    holding inf/NaN. Use it with the optimizer's own momentum off."""

    OPTIONS = {"momentum": Option(0.9, float, low=0.0, high=1.0, high_open=True, help="β")}
    applies_momentum = True

    def signed_input(self, flat: Tensor, bucket: Bucket) -> Tensor:
        """``m ← m + (1 − β)(g − m)`` (one pass), in ``m`` itself where the bucket is known on the
        host to be finite (the CPU: no new bucket-sized tensors), else into a new tensor that
        replaces ``m`` only if finite."""
        momentum = self.buffer("momentum", bucket)
        weight = 1 - self.options["momentum"]
        finite = all_finite(flat)
        if finite_on_host(finite):
            return momentum.lerp_(flat.float(), weight)
        updated = torch.lerp(momentum, flat.float(), weight)
        assign_if_finite(momentum, updated, finite)
        return updated


@COMPRESSORS.register("onebit")
class OneBit(_ScaledSigns):
    """1-bit SGD (Seide et al., Interspeech 2014): the bit says which side of zero ``g_i`` is on;
    decode gives the mean of the tensor's non-negative entries or the mean of its negative entries
    (2 fp32 scalars per tensor). Pair it with ``memory='residual'`` (the paper's error feedback)."""

    split_sums = True

    def levels_from_sums(self, sums: Tensor, bucket: Bucket) -> Tensor:
        positive_sum, count, negative_sum = sums
        counts = torch.stack([count, bucket.lengths(sums.device) - count]).clamp_min_(1)
        return (torch.stack([positive_sum, negative_sum]) / counts).flatten()

    def level_pair(self, levels: Tensor) -> tuple[Tensor, Tensor]:
        positive, negative = levels.view(2, -1)
        return positive, negative


@COMPRESSORS.register("efsignsgd")
class EFSignSGD(_ScaledSigns):
    """EF-SignSGD (Karimireddy et al., ICML 2019): the compressed value of each tensor is
    ``(‖p‖₁/n) · sign(p)`` for its error-compensated ``p = g + e`` (1 fp32 scalar per tensor); pair
    it with ``memory='residual'``, which supplies ``p`` and keeps ``e = p - decode``. The paper folds
    the learning rate into ``p``; here the optimizer keeps it."""

    split_sums = False

    def levels_from_sums(self, sums: Tensor, bucket: Bucket) -> Tensor:
        return sums / bucket.lengths(sums.device)

    def level_pair(self, levels: Tensor) -> tuple[Tensor, Tensor]:
        return levels, -levels
