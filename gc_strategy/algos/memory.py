"""Error-feedback memories (docs/algorithms.md §6): ``none``, ``residual`` and DGC's ``dgc``."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..bucket import Bucket, all_finite, assign_if_finite, finite_on_host
from ..communicators import Communicator, Exchange
from ..kernels import triton_memory
from ..registry import Option
from .base import MEMORIES, Compressor, Memory, zero_at


def compensated_from(
    error: Tensor,
    grad: Tensor,
    finite: Tensor | None,
    beta: float = 1.0,
    gamma: float = 1.0,
    into: Tensor | None = None,
) -> Tensor:
    """``β e + γ g`` for error-feedback state ``e``: formed in ``into`` where the bucket is known on
    the host to be finite (the CPU: no new bucket-sized tensor, whose page faults cost more than a
    pass over it), else in a new tensor. ``into`` is ``e`` itself, or under a rollback point the
    vector that takes its place (:meth:`~gc_strategy.bucket.BucketState.rewritten`: ``e`` is read
    there, not copied first); where the sum is not formed in it, it is given ``e``'s values. Pass
    the result to :func:`keep_difference` with ``into``."""
    into = error if into is None else into
    if finite is not None and finite_on_host(finite):
        if beta == 1:
            return torch.add(error, grad, alpha=gamma, out=into)
        return torch.mul(error, beta, out=into).add_(grad, alpha=gamma)
    if into is not error:
        into.copy_(error)
    weighted = error if beta == 1 else error * beta  # no copy for the usual β = 1
    return torch.add(weighted, grad.float(), alpha=gamma)


def keep_difference(error: Tensor, compensated: Tensor, estimate: Tensor, finite: Tensor) -> None:
    """``e ← compensated − estimate``, unless the bucket is not finite (``e`` then stays as it
    was); in place where :func:`compensated_from` formed ``compensated`` in ``e`` (it does so only
    for a finite bucket)."""
    if compensated is error:
        error.sub_(estimate)
    else:
        assign_if_finite(error, compensated - estimate.float(), finite)


@MEMORIES.register("none")
class NoMemory(Memory):
    """No error feedback: the compressor sees the raw gradient."""

    local_form = None

    def compensate(self, grad: Tensor, bucket: Bucket, finite: Tensor | None = None) -> Tensor:
        return grad

    def update(self, compensated: Tensor, local: Tensor, bucket: Bucket, finite: Tensor) -> None:
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

    def compensate(self, grad: Tensor, bucket: Bucket, finite: Tensor | None = None) -> Tensor:
        beta, gamma = self.options["beta"], self.options["gamma"]
        residual, into = self.rewritten("residual", bucket)
        return compensated_from(residual, grad, finite, beta, gamma, into=into)

    def update(self, compensated: Tensor, local: Tensor, bucket: Bucket, finite: Tensor) -> None:
        keep_difference(self.buffer("residual", bucket), compensated, local, finite)

    def exchange(self, grad: Tensor, bucket: Bucket, compressor: Compressor, communicator: Communicator) -> Exchange:
        """With ``β = γ = 1`` (``x = g + e``, ``e ← x − decode``) the compressor's fused kernel
        (:meth:`~gc_strategy.algos.base.Compressor.encode_with_residual`) forms the payload and
        updates ``e`` in its own passes, where it has one (under a rollback point into a second
        vector: no copy); otherwise compensate, exchange, update."""
        finite = all_finite(grad)
        payload = None
        if self.options["beta"] == 1 and self.options["gamma"] == 1:
            residual, into = self.rewritten("residual", bucket)
            payload = compressor.encode_with_residual(grad, residual, finite, bucket, into=into)
            if payload is None:  # no kernel: the separate passes rewrite it
                self.undo_rewrite("residual", bucket)
        if payload is None:
            return (yield from self.compensated_exchange(compressor, grad, bucket, communicator, finite))
        received = yield from communicator.exchange(payload, compressor.variable_size)
        return compressor.combine(received, bucket, communicator, out=grad), finite


@MEMORIES.register("dgc")
class DGCMemory(Memory):
    """Deep Gradient Compression's memory (Lin et al., ICLR 2018), per rank and element:

    - optional local clipping: ``g ← g · min(1, clip_norm / ‖g‖)`` (the bucket's norm; 0: off),
    - momentum correction ``u = m·u + g`` and accumulation ``v = v + u``; ``v`` is compressed,
    - masking: after sending, ``u`` and ``v`` are zeroed at the positions the compressor
      transmitted (a sparsifier's selected positions, whatever their values; for other compressors
      wherever the local decode is nonzero).

    The optimizer's own momentum must then be 0 for these parameters (the strategy warns otherwise).
    A bucket holding inf/NaN leaves ``u`` and ``v`` unchanged.
    """

    OPTIONS = {
        "momentum": Option(0.9, float, low=0.0, high=1.0, high_open=True, help="m"),
        "clip_norm": Option(0.0, float, low=0.0, help="local gradient clipping norm (0: off)"),
    }
    applies_momentum = True
    local_form = "positions"

    def __init__(self, **options: float) -> None:
        super().__init__(**options)
        self._pending: dict[int, Tensor] = {}

    def compensate(self, grad: Tensor, bucket: Bucket, finite: Tensor | None = None) -> Tensor:
        """``v + u`` for the updated ``u``: formed in ``u`` and ``v`` themselves where the bucket is
        known on the host to be finite (the CPU: no new bucket-sized tensors); with Triton, in one
        pass that updates ``u`` and ``v`` where the device finds the bucket finite and returns the sum
        in a new tensor (:func:`~gc_strategy.kernels.triton_memory.momentum_step`); else in the two
        rows of a new ``[2, n]`` tensor, so that one gather and one scatter mask both."""
        g, clip_norm, momentum = grad, self.options["clip_norm"], self.options["momentum"]
        if clip_norm > 0:
            g = grad.float()
            g = g * (clip_norm / g.norm().clamp_min(1e-12)).clamp(max=1.0)
        (u_was, u), (v_was, v) = self.rewritten("u", bucket), self.rewritten("v", bucket)
        triton = finite is not None and kernels.uses_triton(u)  # the kernel reads g in any float dtype
        if not triton and finite is not None and finite_on_host(finite):  # into u and v: no copy when held
            torch.add(g.float(), u_was, alpha=momentum, out=u)  # g + m·u in one pass
            return torch.add(v_was, u, out=v)
        for was, vector in ((u_was, u), (v_was, v)):  # the other paths update u and v in place, or keep them
            if vector is not was:
                vector.copy_(was)
        if triton:
            return triton_memory.momentum_step(g, u, v, momentum, finite)
        new = self._pending[bucket.index] = u.new_empty(2, u.numel())
        torch.add(g.float(), u, alpha=momentum, out=new[0])
        return torch.add(v, new[0], out=new[1])

    def update(self, compensated: Tensor, local: Tensor, bucket: Bucket, finite: Tensor) -> None:
        """``local``: the positions sent (``local_form``)."""
        u, v = self.buffer("u", bucket), self.buffer("v", bucket)
        if compensated is v:  # formed in place (finite, on the CPU)
            zero_at(u, local)
            zero_at(v, local)
        elif bucket.index in self._pending:
            new = zero_at(self._pending.pop(bucket.index), local)
            assign_if_finite(u, new[0], finite)
            assign_if_finite(v, new[1], finite)
        else:  # formed by the Triton kernel
            triton_memory.zero_sent(u, v, local, finite)
