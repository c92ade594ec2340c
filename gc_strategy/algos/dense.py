"""Dense casts (docs/algorithms.md §2): ``none`` (fp32 reference), ``fp16`` and ``bf16``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..bucket import Bucket
from ..communicators import Payload
from .base import COMPRESSORS, Compressor, stored_in


@COMPRESSORS.register("none")
class NoCompression(Compressor):
    """Sends the gradient as it is: the bit-exact reference that must match plain DDP."""

    summable = True

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        return [flat]

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        return payload[0]


class _Cast(Compressor):
    """Sends ``g / W`` in a 16-bit float type (divided before the cast, so that the sum cannot
    overflow where ``g`` alone would not); the sum of the payloads is already the average.

    The division writes the 16-bit payload directly (one pass, no fp32 temporary), and the average
    stays in the wire type: the synchroniser's copy into ``param.grad`` converts it on the way.
    """

    summable = True
    wire_dtype: torch.dtype

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        wire = torch.empty(flat.numel(), dtype=self.wire_dtype, device=flat.device)
        return [torch.div(flat, self.world_size, out=wire)]

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        return payload[0].to(bucket.dtype).mul_(self.world_size)

    def decode_into(self, payload: Payload, bucket: Bucket, scratch: Tensor) -> Tensor:
        return scratch.copy_(payload[0]).mul_(self.world_size)

    def average(self, summed: Payload, bucket: Bucket, world_size: int, out: Tensor | None = None) -> Tensor:
        return stored_in(summed[0], out)


@COMPRESSORS.register("fp16")
class FP16(_Cast):
    """IEEE half precision (5-bit exponent): 2 bytes per element, ~3 significant digits."""

    wire_dtype = torch.float16


@COMPRESSORS.register("bf16")
class BF16(_Cast):
    """bfloat16 (8-bit exponent, fp32's range): 2 bytes per element, ~2 significant digits."""

    wire_dtype = torch.bfloat16
