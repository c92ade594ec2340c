"""Sign methods (ALGORITHMS.md §4): ``onebit``, ``signsgd``, ``signum``, ``efsignsgd``.

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

from ..bucket import Bucket, all_finite
from ..comm import Payload
from ..registry import Option
from .base import COMPRESSORS, Compressor
from . import triton_bits
from .packing import pack_signs, unpack_bits


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
        bits = pack_signs(g)
        levels = self.levels(g, bucket)
        return [bits] if levels is None else [levels, bits]

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        bits = unpack_bits(payload[-1], 1, bucket.numel).bool()
        if len(payload) == 1:
            return bits.float() * 2 - 1
        return bucket.select_per_tensor(bits, *self.level_pair(payload[0]))


class _ScaledSigns(_SignBits):
    """Averages the scaled decodes of all ranks; on CUDA with Triton in one pass over the gathered
    bits (:func:`~gc_strategy.algos.triton_bits.mean_of_signs`, equal to the decodes' mean)."""

    def aggregate(self, gathered: list[Payload], bucket: Bucket) -> Tensor:
        if not triton_bits.usable(gathered[0][-1]):
            return super().aggregate(gathered, bucket)
        bits = torch.stack([payload[-1] for payload in gathered])
        pairs = [self.level_pair(payload[0]) for payload in gathered]
        positive, negative = (torch.stack([pair[k] for pair in pairs]) for k in (0, 1))
        return triton_bits.mean_of_signs(bits, positive, negative, bucket.tensor_ids(bits.device), bucket.numel)


class _MajorityVote(_SignBits):
    def aggregate(self, gathered: list[Payload], bucket: Bucket) -> Tensor:
        votes = self.decode(gathered[0], bucket)
        for payload in gathered[1:]:
            votes += self.decode(payload, bucket)
        return votes.sign_()


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
        momentum = self.buffer("momentum", bucket)
        beta = self.options["momentum"]
        updated = torch.add(momentum * beta, flat.float(), alpha=1 - beta)
        momentum.copy_(torch.where(all_finite(flat), updated, momentum))
        return updated


@COMPRESSORS.register("onebit")
class OneBit(_ScaledSigns):
    """1-bit SGD (Seide et al., Interspeech 2014): the bit says which side of zero ``g_i`` is on;
    decode gives the mean of the tensor's non-negative entries or the mean of its negative entries
    (2 fp32 scalars per tensor). Pair it with ``memory='residual'`` (the paper's error feedback)."""

    def levels(self, g: Tensor, bucket: Bucket) -> Tensor:
        positive = (g >= 0).float()
        count = bucket.sum_per_tensor(positive)
        pos_mean = bucket.sum_per_tensor(g * positive) / count.clamp_min(1)
        neg_mean = bucket.sum_per_tensor(g * (1 - positive)) / (bucket.sum_per_tensor(1 - positive)).clamp_min(1)
        return torch.stack([pos_mean, neg_mean]).flatten()

    def level_pair(self, levels: Tensor) -> tuple[Tensor, Tensor]:
        positive, negative = levels.view(2, -1)
        return positive, negative


@COMPRESSORS.register("efsignsgd")
class EFSignSGD(_ScaledSigns):
    """EF-SignSGD (Karimireddy et al., ICML 2019): the compressed value of each tensor is
    ``(‖p‖₁/n) · sign(p)`` for its error-compensated ``p = g + e`` (1 fp32 scalar per tensor); pair
    it with ``memory='residual'``, which supplies ``p`` and keeps ``e = p - decode``. The paper folds
    the learning rate into ``p``; here the optimizer keeps it."""

    def levels(self, g: Tensor, bucket: Bucket) -> Tensor:
        return bucket.mean_per_tensor(g.abs())

    def level_pair(self, levels: Tensor) -> tuple[Tensor, Tensor]:
        return levels, -levels
