"""Which variant of a kernel runs for a tensor, and the override that forces one.

- ``"triton"``: one-pass Triton kernels, on CUDA where Triton is installed (or on the CPU under
  Triton's interpreter, ``TRITON_INTERPRET=1``);
- ``"cupy"``: CuPy's kernels on CUDA where CuPy is installed, for the operations where they were
  the fastest measured (where an operation has both, it takes this one before Triton's); forced on
  the CPU, the same code through numpy;
- ``"numpy"``: the CPU's fast paths through numpy, for a tensor in host memory;
- ``"torch"``: plain torch, which runs on every device: what accelerators run without Triton, and
  the reference that every other variant is tested against.

:func:`forced` makes every kernel take one variant: with ``"torch"`` on the CPU the code that
accelerators run is exercised on every commit, although CI has no GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import Tensor

from . import cupy_ops, triton_bits

Variant = Literal["triton", "cupy", "numpy", "torch"]
VARIANTS: tuple[Variant, ...] = ("triton", "cupy", "numpy", "torch")
_forced: Variant | None = None


@contextmanager
def forced(variant: Variant) -> Iterator[None]:
    """Inside this context every kernel runs its ``variant`` where it has one (``"torch"`` always
    exists); ``"triton"`` needs a tensor Triton can run on, ``"cupy"`` one in host memory or on
    CUDA with CuPy installed."""
    global _forced
    if variant not in VARIANTS:
        raise ValueError(f"kernel variant {variant!r} is invalid; allowed: {', '.join(VARIANTS)}")
    previous, _forced = _forced, variant
    try:
        yield
    finally:
        _forced = previous


def variant_for(tensor: Tensor, triton: bool = False, cupy: bool = False) -> Variant:
    """The variant a kernel runs for ``tensor``; ``triton`` / ``cupy``: the kernel has a Triton /
    CuPy variant."""
    if _forced == "triton":
        return "triton" if triton and triton_bits.usable(tensor) else "torch"
    if _forced == "cupy":
        return "cupy" if cupy and cupy_ops.usable(tensor) else "torch"
    if _forced is not None:
        return _forced
    if cupy and tensor.is_cuda and cupy_ops.usable(tensor):
        return "cupy"
    if triton and triton_bits.usable(tensor):
        return "triton"
    return "numpy" if tensor.device.type == "cpu" else "torch"


def uses_triton(tensor: Tensor) -> bool:
    """Whether an algorithm's fused Triton path runs for ``tensor``."""
    return variant_for(tensor, triton=True) == "triton"


def in_host_memory(where: Tensor | torch.device) -> bool:
    """Whether a tensor (or any tensor on a device) takes the host's paths: a value read from it
    costs no device wait, and the numpy variants apply (False under ``forced("torch")``)."""
    device = where if isinstance(where, torch.device) else where.device
    return _forced == "numpy" if _forced is not None else device.type == "cpu"
