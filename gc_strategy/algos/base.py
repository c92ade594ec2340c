"""The Compressor and Memory roles (docs/algorithms.md §1) and their name registries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor

from ..bucket import Bucket, BucketState, all_finite
from ..comm import Communicator, Exchange, Payload
from ..registry import Option, Registry

COMPRESSORS: Registry[Compressor] = Registry("compressor")
MEMORIES: Registry[Memory] = Registry("memory")

#: what error feedback needs of a rank's own payload (:attr:`Memory.local_form`): its decode
#: (``"estimate"``), the positions where that decode may be nonzero (``"positions"``: int64
#: indices, or a bool mask over the bucket; see :func:`zero_at`), or nothing
LocalForm = Literal["estimate", "positions"] | None


class Compressor(BucketState):
    """Turns one bucket's flat gradient ``g`` into a payload and back.

    ``encode(g)`` gives what goes on the wire; ``decode(payload)`` gives a dense estimate of the
    *local* ``g`` (what error feedback subtracts). A compressor whose payloads can be summed
    element-wise across ranks sets ``summable``; the result is then ``average(Σ payloads)``.
    Otherwise every rank's payload is gathered and ``aggregate`` combines them (by default the mean
    of the decodes). ``variable_size`` declares that payload lengths may differ between ranks.
    Per-element state lives in :class:`BucketState` buffers, which the engine checkpoints.
    The engine sets ``world_size`` and ``rank`` when it binds to a process group, and ``step`` (the
    number of synchronised steps so far, the same on every rank) before each step.
    """

    OPTIONS: ClassVar[dict[str, Option]] = {}
    name: ClassVar[str]
    summable: ClassVar[bool]
    variable_size: ClassVar[bool] = False
    #: applies its own momentum (the optimizer's should then be off)
    applies_momentum: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options
        self.world_size = 1
        self.rank = 0
        self.step = 0

    def seed_for(self, bucket: Bucket, shared: bool) -> int:
        """A seed mixed from (option ``seed``, step, bucket) and, unless ``shared``, the rank: the
        same draws on every rank when ``shared``, independent draws otherwise. Mixing in the step
        makes a resumed run draw what the uninterrupted run would have drawn."""
        seed = self.options.get("seed", 0)
        mixed = ((seed * 1_000_003 + self.step) * 1_000_033 + bucket.index) * 1_000_037
        if not shared:
            mixed += self.rank + 1
        return mixed % (2**63 - 1)

    def generator(self, bucket: Bucket, device: torch.device, shared: bool) -> torch.Generator:
        """A torch generator seeded by :meth:`seed_for`."""
        return torch.Generator(device=device).manual_seed(self.seed_for(bucket, shared))

    def keeps_error_feedback(self) -> bool:
        """Whether this compressor keeps its own error feedback (PowerSGD's ``e``): an error-feedback
        memory on top of it would be a second loop, and is refused."""
        return False

    def pop_metrics(self) -> dict[str, float]:
        """Method-specific telemetry accumulated since the last call (e.g. achieved density)."""
        return {}

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        raise NotImplementedError

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        raise NotImplementedError

    def magnitudes(self, flat: Tensor, bucket: Bucket) -> Tensor:
        """``|flat|`` in fp32, written into this compressor's workspace for the bucket (which the
        caller may go on to modify in place)."""
        scratch = self.workspace("magnitudes", bucket)
        return torch.abs(flat, out=scratch) if flat.dtype == scratch.dtype else scratch.copy_(flat).abs_()

    def decode_into(self, payload: Payload, bucket: Bucket, scratch: Tensor) -> Tensor:
        """``decode(payload)``, which a subclass may write into ``scratch`` (a bucket-sized fp32
        tensor it may overwrite) instead of a new tensor: what :meth:`aggregate` calls per rank."""
        return self.decode(payload, bucket)

    def local_estimate(self, payload: Payload, bucket: Bucket) -> Tensor:
        """``decode(payload)`` of this rank's own payload, for error feedback: read only until this
        step's memory update, so it may be decoded into a workspace (:meth:`decode_into`)."""
        return self.decode_into(payload, bucket, self.workspace("local estimate", bucket))

    def sent_positions(self, payload: Payload, bucket: Bucket) -> Tensor:
        """The positions where the decode of this rank's own payload may be nonzero, for a memory
        that masks what was sent (int64 indices or a bool mask, as :func:`zero_at` takes them): by
        default where :meth:`local_estimate` is nonzero; a sparsifier reads its indices from its
        payload without a dense decode."""
        return nonzero_positions(self.local_estimate(payload, bucket))

    def local(self, payload: Payload, bucket: Bucket, form: LocalForm) -> Tensor | None:
        """What error feedback needs of this rank's own payload, in the ``form`` its memory asks
        for, taken before the collective (which may sum the payload in place)."""
        if form == "positions":
            return self.sent_positions(payload, bucket)
        return copy_if_shared(self.local_estimate(payload, bucket), payload) if form == "estimate" else None

    def average(self, summed: Payload, bucket: Bucket, world_size: int, out: Tensor | None = None) -> Tensor:
        """Average from the element-wise sum of all ranks' payloads (summable compressors), written
        into ``out`` when given (as for :meth:`combine`)."""
        decoded = self.decode(summed, bucket)
        return decoded.div_(world_size) if out is None else torch.div(decoded, world_size, out=out)

    def aggregate(self, gathered: list[Payload], bucket: Bucket, out: Tensor | None = None) -> Tensor:
        """Average from every rank's payload (gathered compressors): mean of the decodes, written
        into ``out`` when given (as for :meth:`combine`)."""
        return self.sum_of_decodes(gathered, bucket, out).div_(len(gathered))

    def sum_of_decodes(self, gathered: list[Payload], bucket: Bucket, out: Tensor | None = None) -> Tensor:
        """``Σ_r decode(payload_r)``, written into ``out`` when given; each rank's decode goes into
        one workspace (:meth:`decode_into`), not a new tensor."""
        scratch = self.workspace("decoded", bucket)
        first = self.decode_into(
            gathered[0], bucket, out if out is not None and out.dtype == scratch.dtype else scratch
        )
        total = first.clone() if out is None else stored_in(first, out)
        for payload in gathered[1:]:
            total.add_(self.decode_into(payload, bucket, scratch))
        return total

    def exchange(
        self, flat: Tensor, bucket: Bucket, comm: Communicator, local_form: LocalForm, out: Tensor | None = None
    ) -> Exchange:
        """Encode, communicate, combine. Returns ``(average, local)``, ``local`` in the form the
        memory asks for (:meth:`local`); the average is written into ``out`` when given (the
        bucket's gradient buffer: see :meth:`combine`).

        Multi-round methods override this and ``yield from`` several communicator exchanges.
        """
        payload = self.encode(flat, bucket)
        if flat is not out:  # not the exchange's buffer (e.g. memory state): the collective must not overwrite it
            payload = [copy_if_shared(tensor, [flat]) for tensor in payload]
        local = self.local(payload, bucket, local_form)
        received = yield from comm.exchange(payload, self.variable_size)
        return self.combine(received, bucket, comm, out=out), local

    def combine(self, received: Any, bucket: Bucket, comm: Communicator, out: Tensor | None = None) -> Tensor:
        """The average from what the communicator returned: :meth:`average` of the sum or
        :meth:`aggregate` of the gathered payloads. With ``out`` (the bucket's gradient buffer, free
        once it is encoded) the average is written there instead of into a new tensor: on the CPU a
        fresh bucket-sized tensor costs its page faults every step, about 4x a pass over it."""
        if comm.sums:
            return self.average(received, bucket, comm.world_size, out=out)
        return self.aggregate(received, bucket, out=out)

    def fused_exchange(
        self, grad: Tensor, residual: Tensor, finite: Tensor, bucket: Bucket, comm: Communicator
    ) -> Exchange | None:
        """Residual error feedback fused into the encode: the exchange of ``x = grad + residual`` that
        also sets ``residual ← x − decode(payload)`` (unchanged where the 0-d ``finite`` is False) in
        its own passes, returning ``(average, None)``; or None where this compressor has no such path
        for these tensors (the engine then runs compensate, :meth:`exchange` and the memory's update)."""
        return None

    def extra_state(self) -> dict[str, Any]:
        """Non-per-element state to checkpoint (step counters, seeds); saved per rank."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass


def copy_if_shared(tensor: Tensor, others: Payload) -> Tensor:
    """``tensor``, or a copy of it where it shares memory with any of ``others``: what the collective
    may overwrite in place (e.g. ``none``'s payload is its input, and its decode the payload)."""
    shared = {other.untyped_storage().data_ptr() for other in others}
    return tensor.clone() if tensor.untyped_storage().data_ptr() in shared else tensor


def nonzero_positions(dense: Tensor) -> Tensor:
    """The nonzero (or NaN) elements of a 1-d tensor: on the CPU their int64 positions, through
    numpy's comparison and ``flatnonzero`` of its bool result, faster there than ``torch.nonzero``
    (docs/benchmarks/cpu_paths_cpu.md); elsewhere a bool mask, since counting the positions would
    make the host wait for the device."""
    if dense.device.type != "cpu":
        return dense != 0
    if dense.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.flatnonzero(np.not_equal(dense.numpy(), 0)))
    return torch.nonzero(dense).flatten()


def zero_at(tensor: Tensor, positions: Tensor) -> Tensor:
    """``tensor`` zeroed in place at ``positions``: int64 indices or a bool mask of its length."""
    if positions.dtype == torch.bool:
        return tensor.masked_fill_(positions, 0)
    return tensor.index_fill_(0, positions, 0)


def local_in_form(estimate: Tensor, form: LocalForm) -> Tensor | None:
    """A dense local estimate (of an exchange that forms one anyway) in the ``form`` the memory
    asks for (:meth:`Compressor.local`)."""
    if form == "positions":
        return nonzero_positions(estimate)
    return estimate if form == "estimate" else None


def stored_in(result: Tensor, out: Tensor | None) -> Tensor:
    """``result``, or ``out`` holding it (for averages computed into a tensor of their own)."""
    return result if out is None or result is out else out.copy_(result)


class Memory(BucketState):
    """Error feedback (docs/algorithms.md §6): ``compensate`` before encoding, ``update`` after.

    ``update`` receives this rank's own payload in the form ``local_form`` names (its decode, or
    the positions where that may be nonzero), and ``finite``, a 0-d bool tensor that is False when
    the bucket's gradient held an inf or NaN; the memory must then keep its previous state (no host
    synchronisation needed).
    """

    OPTIONS: ClassVar[dict[str, Option]] = {}
    name: ClassVar[str]
    #: what ``update`` needs of this rank's own payload; None: the memory keeps no state
    local_form: ClassVar[LocalForm] = "estimate"
    #: applies its own momentum (the optimizer's should then be off)
    applies_momentum: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def compensate(self, grad: Tensor, bucket: Bucket, finite: Tensor | None = None) -> Tensor:
        """The compressor's input from the gradient; ``finite`` (from :func:`all_finite`, None when
        the memory keeps no state) lets a memory form it in its own state where that is safe."""
        raise NotImplementedError

    def update(self, compensated: Tensor, local: Tensor, bucket: Bucket, finite: Tensor) -> None:
        raise NotImplementedError

    def fusable_residual(self, bucket: Bucket) -> Tensor | None:
        """The buffer ``e`` when this memory is plain residual feedback (``x = g + e``,
        ``e ← x − decode``), which a compressor may update inside its encode
        (:meth:`Compressor.fused_exchange`); None otherwise."""
        return None


@dataclass
class StartedExchange:
    """One bucket's exchange under way, with what its error feedback needs at the end."""

    exchange: Exchange
    #: 0-d bool, False when the bucket's gradient holds inf/NaN (None: the memory keeps no state)
    finite: Tensor | None
    #: the memory's compensated input, for ``memory.update``; None when there is nothing to update
    #: (no state, or the compressor's fused exchange updated the memory itself)
    compensated: Tensor | None


def start_exchange(
    compressor: Compressor, memory: Memory, flat: Tensor, bucket: Bucket, comm: Communicator
) -> StartedExchange:
    """``memory.compensate -> compressor.exchange`` for one bucket, or the compressor's fused exchange
    (:meth:`Compressor.fused_exchange`) where the memory is plain residual feedback and the
    compressor has one for these tensors. After the exchange, call ``memory.update(compensated,
    local, bucket, finite)`` when ``compensated`` is not None. ``flat`` is the bucket's gradient
    buffer and belongs to the exchange: it may be overwritten, and may come back as the average."""
    stateful = memory.local_form is not None
    finite = all_finite(flat) if stateful else None
    residual = memory.fusable_residual(bucket) if stateful else None
    fused = compressor.fused_exchange(flat, residual, finite, bucket, comm) if residual is not None else None
    if fused is not None:
        return StartedExchange(fused, finite, None)
    compensated = memory.compensate(flat, bucket, finite)
    return StartedExchange(
        compressor.exchange(compensated, bucket, comm, memory.local_form, out=flat),
        finite,
        compensated if stateful else None,
    )
