"""Record the ops a piece of code runs: the aten ops that launch kernels, and those that make an
accelerator's host wait for the device.

On a GPU the host queues kernels and runs ahead. An op whose result the host must read (a scalar
read back, a data-dependent output size, a copy to host memory) makes it wait for everything queued
before it, and the backward pass that feeds the synchroniser stalls behind it. Run on the CPU with
the kernels forced to their accelerator variants (``gc_strategy.kernels.forced("torch")``), the same
code path runs the same ops, so :class:`OpRecorder` finds every such wait without a GPU:

- aten ops whose output size depends on the data (``nonzero``, ``masked_select``, ``unique``,
  indexing by a boolean mask, ``repeat_interleave`` without ``output_size``);
- scalar reads (``_local_scalar_dense``: ``item()``, ``float(t)``, ``bool(t)``) and ``equal``;
- reads of whole tensors into Python or host memory (``tolist``, ``numpy``, ``cpu``);
- tensors built from Python data (``lift_fresh``: ``torch.tensor([...])``), which an accelerator
  receives by a copy from pageable host memory.

It also counts the kernel-launching aten ops (views, metadata and allocations left out), for
``benchmarks/op_census.py``.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that make the host wait for the device whatever their arguments
WAITING_OPS = {
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "_local_scalar_dense",
    "equal",
    "lift_fresh",
    "lift_fresh_copy",
}
#: Tensor methods that read a tensor into Python or host memory
WAITING_METHODS = {"tolist", "numpy", "cpu"}
#: aten ops that launch no kernel: views, metadata, allocations, and ops handled by the recorder
NO_KERNEL = {
    "view",
    "_unsafe_view",
    "reshape",
    "as_strided",
    "slice",
    "select",
    "narrow",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "t",
    "transpose",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "flatten",
    "alias",
    "detach",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "set_",
    "lift_fresh",
    "_local_scalar_dense",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "record_stream",
}


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _Methods(TorchFunctionMode):
    def __init__(self, recorder: OpRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in WAITING_METHODS or (name == "to" and _to_host(args, kwargs or {})):
            self.recorder.wait(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


def _to_host(args: tuple, kwargs: dict) -> bool:
    device = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


class _Aten(TorchDispatchMode):
    def __init__(self, recorder: OpRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        namespace = func.namespace
        name = func._opname
        if namespace == "aten":
            waits = (
                name in WAITING_OPS
                or (name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args))
                or (name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4)
            )
            if waits:
                self.recorder.wait(name)
            if name not in NO_KERNEL:
                self.recorder.launches[name] += 1
        return func(*args, **kwargs)


class OpRecorder:
    """``with OpRecorder() as ops: ...``: ``ops.waits`` counts what would make an accelerator's host
    wait, by op, and ``ops.sites`` says where (the innermost line of ``package``'s code that ran
    it); ``ops.launches`` counts kernel-launching aten ops, by op."""

    def __init__(self, package: str = "gc_strategy") -> None:
        self.package = f"/{package}/"
        self.waits: Counter[str] = Counter()
        self.sites: dict[str, set[str]] = {}
        self.launches: Counter[str] = Counter()
        self._modes = (_Methods(self), _Aten(self))

    def wait(self, op: str) -> None:
        self.waits[op] += 1
        ours = [frame for frame in traceback.extract_stack() if self.package in frame.filename]
        site = f"{ours[-1].filename.rsplit(self.package, 1)[1]}:{ours[-1].lineno}" if ours else "outside the package"
        self.sites.setdefault(op, set()).add(site)

    def __enter__(self) -> OpRecorder:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
