"""Error-feedback memories (ALGORITHMS.md §6): ``none`` and ``residual``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..bucket import Bucket, assign_if_finite, finite_on_host
from ..registry import Option
from .base import MEMORIES, Memory


@MEMORIES.register("none")
class NoMemory(Memory):
    """No error feedback: the compressor sees the raw gradient."""

    needs_local_estimate = False

    def compensate(self, grad: Tensor, bucket: Bucket, finite: Tensor | None = None) -> Tensor:
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

    def compensate(self, grad: Tensor, bucket: Bucket, finite: Tensor | None = None) -> Tensor:
        """``g' = β e + γ g``: in ``e`` itself where ``finite`` is known on the host to be True (the
        CPU; :meth:`update` then subtracts in place), else a new tensor."""
        residual = self.buffer("residual", bucket)
        if finite is not None and finite_on_host(finite):
            return (residual if self.beta == 1 else residual.mul_(self.beta)).add_(grad, alpha=self.gamma)
        weighted = residual if self.beta == 1 else residual * self.beta  # no copy for the usual β = 1
        return torch.add(weighted, grad.float(), alpha=self.gamma)

    def update(self, compensated: Tensor, local_estimate: Tensor, bucket: Bucket, finite: Tensor) -> None:
        residual = self.buffer("residual", bucket)
        if compensated is residual:  # formed in place by compensate
            residual.sub_(local_estimate)
        else:
            assign_if_finite(residual, compensated - local_estimate.float(), finite)

    def fusable_residual(self, bucket: Bucket) -> Tensor | None:
        return self.buffer("residual", bucket) if self.beta == 1 and self.gamma == 1 else None


@MEMORIES.register("dgc")
class DGCMemory(Memory):
    """Deep Gradient Compression's memory (Lin et al., ICLR 2018), per rank and element:

    - optional local clipping: ``g ← g · min(1, clip_norm / ‖g‖)`` (the bucket's norm; 0: off),
    - momentum correction ``u = m·u + g`` and accumulation ``v = v + u``; ``v`` is compressed,
    - masking: after sending, ``u`` and ``v`` are zeroed where the compressor transmitted.

    The optimizer's own momentum must then be 0 for these parameters (the strategy warns otherwise).
    A bucket holding inf/NaN leaves ``u`` and ``v`` unchanged.
    """

    OPTIONS = {
        "momentum": Option(0.9, float, low=0.0, high=1.0, high_open=True, help="m"),
        "clip_norm": Option(0.0, float, low=0.0, help="local gradient clipping norm (0: off)"),
    }
    applies_momentum = True

    def __init__(self, momentum: float, clip_norm: float) -> None:
        super().__init__(momentum=momentum, clip_norm=clip_norm)
        self.momentum = momentum
        self.clip_norm = clip_norm
        self._pending_u: dict[int, Tensor] = {}

    def compensate(self, grad: Tensor, bucket: Bucket, finite: Tensor | None = None) -> Tensor:
        g = grad.float()
        if self.clip_norm > 0:
            g = g * (self.clip_norm / g.norm().clamp_min(1e-12)).clamp(max=1.0)
        u = torch.add(self.buffer("u", bucket) * self.momentum, g)
        self._pending_u[bucket.index] = u
        return self.buffer("v", bucket) + u

    def update(self, compensated: Tensor, local_estimate: Tensor, bucket: Bucket, finite: Tensor) -> None:
        u, v = self.buffer("u", bucket), self.buffer("v", bucket)
        unsent = local_estimate == 0
        new_u = self._pending_u.pop(bucket.index) * unsent
        assign_if_finite(u, new_u, finite)
        assign_if_finite(v, compensated * unsent, finite)
