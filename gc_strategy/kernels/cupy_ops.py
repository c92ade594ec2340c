"""The CuPy variant: operations whose CuPy form (its CUDA kernels, reached zero-copy through
DLPack) was the fastest measured on a GPU, where it beat the torch and Triton variants
(``benchmarks/kernel_variants.py``; docs/design.md says which won and by how much).

The code is written against the array API that CuPy shares with numpy, and takes its module from
the tensor: CuPy for a CUDA tensor, numpy for one in host memory. Under ``forced("cupy")`` on the
CPU the same lines run through numpy, which is how CI checks them (the DLPack exchange, the dtypes,
the bit order); on a GPU ``tests/kernels/test_cuda.py`` checks CuPy's kernels against the torch variant.
CuPy is an optional extra (``pip install "gc_strategy[cupy]"``). Its kernels run on torch's
current stream, so they keep the stream order of the torch work around them and the host never
waits for them, and what they allocate comes from torch's caching allocator on that stream (CuPy's
own pool would hold memory torch cannot reuse, and knows nothing of the streams torch's
collectives read a payload on).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import numpy as np
import torch
from torch import Tensor


@functools.cache
def cupy() -> ModuleType | None:
    """CuPy, or None where it is not installed or finds no GPU."""
    try:
        import cupy as cp

        cp.cuda.runtime.getDeviceCount()  # raises without a driver or a device
        return cp
    except Exception:  # ImportError, or CuPy's CUDA runtime errors
        return None


def usable(tensor: Tensor) -> bool:
    """Whether this variant runs on ``tensor``: through CuPy on CUDA where CuPy is installed,
    through numpy in host memory."""
    return tensor.device.type == "cpu" or (tensor.is_cuda and cupy() is not None)


def _array_module(tensor: Tensor) -> ModuleType:
    return np if tensor.device.type == "cpu" else cupy()


@contextmanager
def _on_torch(tensor: Tensor) -> Iterator[None]:
    """CuPy launching on torch's current stream of the tensor's device and allocating from torch's
    caching allocator (each CuPy buffer holds the torch tensor it lives in); nothing on the CPU."""
    if tensor.device.type == "cpu":
        yield
        return
    cp, device = cupy(), tensor.device

    def allocate(size: int):
        block = torch.empty(size, dtype=torch.uint8, device=device)
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(block.data_ptr(), size, block, device.index), 0)

    current = torch.cuda.current_stream(device)
    if hasattr(cp.cuda.Stream, "from_external") and hasattr(current, "__cuda_stream__"):  # the CUDA stream protocol
        stream = cp.cuda.Stream.from_external(current)
    else:
        stream = cp.cuda.ExternalStream(current.cuda_stream, device.index)
    with stream, cp.cuda.using_allocator(allocate):
        yield


def pack_signs(values: Tensor) -> Tensor:
    """``packbits`` of ``values >= 0`` in the wire's bit order (the first element in the lowest
    bit): torch's comparison, then one CuPy kernel that reads a byte's eight flags and writes it."""
    xp = _array_module(values)
    with _on_torch(values):
        return torch.from_dlpack(xp.packbits(xp.from_dlpack(values.reshape(-1) >= 0), bitorder="little"))
