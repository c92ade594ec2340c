"""Error-feedback memories (ALGORITHMS.md §6): ``none`` and ``residual``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..bucket import Bucket
from ..registry import Option
from .base import MEMORIES, Memory


@MEMORIES.register("none")
class NoMemory(Memory):
    """No error feedback: the compressor sees the raw gradient."""

    needs_local_estimate = False

    def compensate(self, grad: Tensor, bucket: Bucket) -> Tensor:
        return grad

    def update(self, compensated: Tensor, local_estimate: Tensor, bucket: Bucket, finite: Tensor) -> None:
        pass


@MEMORIES.register("residual")
class ResidualMemory(Memory):
    """Residual error feedback, as in GRACE (Xu et al., ICDCS 2021) and EF-SGD (Karimireddy et al.,
    ICML 2019): ``g' = β e + γ g`` is compressed, and ``e = g' - ĝ_local`` keeps what the compressor
    dropped, so over many steps the transmitted sum tracks the true sum of gradients.

    A bucket whose gradient is not finite leaves ``e`` unchanged.
    """

    OPTIONS = {
        "beta": Option(1.0, float, low=0.0, high=1.0, help="weight of the residual e"),
        "gamma": Option(1.0, float, low=0.0, low_open=True, help="weight of the new gradient g"),
    }

    def __init__(self, beta: float, gamma: float) -> None:
        super().__init__(beta=beta, gamma=gamma)
        self.beta = beta
        self.gamma = gamma

    def compensate(self, grad: Tensor, bucket: Bucket) -> Tensor:
        residual = self.buffer("residual", bucket)
        return torch.add(residual * self.beta, grad.float(), alpha=self.gamma)

    def update(self, compensated: Tensor, local_estimate: Tensor, bucket: Bucket, finite: Tensor) -> None:
        residual = self.buffer("residual", bucket)
        residual.copy_(torch.where(finite, compensated - local_estimate.float(), residual))
