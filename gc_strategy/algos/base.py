"""The Compressor and Memory roles (docs/algorithms.md §1) and their name registries."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from .. import kernels
from ..bucket import Bucket, BucketState, all_finite
from ..communicators import Communicator, Exchange, Payload
from ..registry import Option, Registry

COMPRESSORS: Registry[Compressor] = Registry("compressor")
MEMORIES: Registry[Memory] = Registry("memory")

#: what error feedback needs of a rank's own payload (:attr:`Memory.local_form`): its decode
#: (``"estimate"``), the positions where that decode may be nonzero (``"positions"``: int64
#: indices, a bool mask over the bucket, or indices with a bool flag each; see :func:`zero_at`),
#: or nothing
LocalForm = Literal["estimate", "positions"] | None


class Compressor(BucketState):
    """Turns one bucket's flat gradient ``g`` into a payload and back (docs/algorithms.md §1,
    docs/extending.md).

    **Required** of a compressor: :meth:`encode` (``g`` -> the payload, a list of tensors that goes
    on the wire), :meth:`decode` (a payload -> a dense estimate of the *local* ``g``, what error
    feedback subtracts), the flag ``summable`` (payloads can be summed element-wise across ranks:
    the result is then :meth:`average` of the sum; otherwise every rank's payload is gathered and
    :meth:`aggregate` combines them) and its ``OPTIONS`` (read as ``self.options[name]``).

    **Optional hooks**, by purpose; each has a default built on encode and decode:

    - *aggregation*: :meth:`average` (from the sum), :meth:`aggregate` (from the gathered payloads),
      :meth:`decode_into` (a decode written into a workspace);
    - *error-feedback fast paths*: :meth:`local_estimate`, :meth:`sent_positions` (what a memory
      needs of this rank's own payload), :meth:`encode_with_residual` (the kernel of residual
      feedback fused into the encode; :meth:`~gc_strategy.algos.memory.ResidualMemory.exchange` calls it);
    - *multi-round*: :meth:`exchange` (several collectives per step, ``yield from`` each);
    - *start-up*: :meth:`check_group` (refuse ranks that cannot work together);
    - *state and telemetry*: :meth:`extra_state` / :meth:`load_extra_state`, :meth:`pop_metrics`.

    **Flags** (class attributes): ``summable``, ``variable_size`` (payload lengths may differ
    between ranks), ``allreduce_only`` (its own rounds need a summing communicator),
    ``applies_momentum`` (the optimizer's should be off), ``per_step_schedule`` (its payloads
    alternate from step to step, so it needs consecutive steps' gradients), ``keeps_error_feedback``
    (it keeps its own, so an error-feedback memory on top of it is refused), ``works_on_matrices``
    (it compresses each tensor of two or more dimensions as a matrix: a flat shard gives it none).

    **Binding**: the synchroniser calls :meth:`bind` with its process group's size and this rank
    when it is built, and again (with :meth:`check_group`) whenever the group changes (fault
    tolerance's new quorum), and :meth:`begin_step` before each synchronised step with the number of
    steps so far (the same on every rank). Per-element state lives in :class:`BucketState` buffers,
    which the synchroniser checkpoints.
    """

    OPTIONS: ClassVar[dict[str, Option]] = {}
    name: ClassVar[str]
    summable: ClassVar[bool]
    variable_size: ClassVar[bool] = False
    allreduce_only: ClassVar[bool] = False
    applies_momentum: ClassVar[bool] = False
    per_step_schedule: ClassVar[bool] = False
    works_on_matrices: ClassVar[bool] = False
    keeps_error_feedback: bool = False

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options
        self.world_size = 1
        self.rank = 0
        self.step = 0

    def bind(self, world_size: int, rank: int) -> None:
        """The process group this compressor's payloads travel in: its size and this rank."""
        self.world_size, self.rank = world_size, rank

    def begin_step(self, step: int) -> None:
        """Before synchronised step ``step`` (0-based, the same on every rank)."""
        self.step = step

    def check_group(self, group: Any, buckets: list[Bucket]) -> None:
        """Before the first step, and again where the group changes (fault tolerance's new quorum),
        on every rank of ``group`` (the process group its payloads travel in), with the current
        buckets: refuse ranks that cannot work together, such as ranks whose random draws differ. It
        may run collectives over ``group`` (under fault tolerance a peer dying in one fails the round)."""

    # ------------------------------------------------------------------ required
    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        raise NotImplementedError

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ aggregation
    def average(self, summed: Payload, bucket: Bucket, world_size: int, out: Tensor | None = None) -> Tensor:
        """Average from the element-wise sum of all ranks' payloads (summable compressors), written
        into ``out`` when given (as for :meth:`combine`)."""
        decoded = self.decode(summed, bucket)
        return decoded.div_(world_size) if out is None else torch.div(decoded, world_size, out=out)

    def aggregate(self, gathered: list[Payload], bucket: Bucket, out: Tensor | None = None) -> Tensor:
        """Average from every rank's payload (gathered compressors): mean of the decodes, written
        into ``out`` when given (as for :meth:`combine`)."""
        return self.sum_of_decodes(gathered, bucket, out).div_(len(gathered))

    def decode_into(self, payload: Payload, bucket: Bucket, scratch: Tensor) -> Tensor:
        """``decode(payload)``, which a subclass may write into ``scratch`` (a bucket-sized fp32
        tensor it may overwrite) instead of a new tensor: what :meth:`aggregate` calls per rank."""
        return self.decode(payload, bucket)

    # ------------------------------------------------------------------ error-feedback fast paths
    def local_estimate(self, payload: Payload, bucket: Bucket) -> Tensor:
        """``decode(payload)`` of this rank's own payload, for error feedback: read only until this
        step's memory update, so it may be decoded into a workspace (:meth:`decode_into`)."""
        return self.decode_into(payload, bucket, self.workspace("local estimate", bucket))

    def sent_positions(self, payload: Payload, bucket: Bucket) -> Tensor:
        """The positions where the decode of this rank's own payload may be nonzero, for a memory
        that masks what was sent (in a form :func:`zero_at` takes): by
        default where :meth:`local_estimate` is nonzero; a sparsifier reads its indices from its
        payload without a dense decode."""
        return kernels.nonzero_positions(self.local_estimate(payload, bucket))

    def encode_with_residual(
        self, grad: Tensor, residual: Tensor, finite: Tensor, bucket: Bucket, into: Tensor | None = None
    ) -> Payload | None:
        """The kernel of residual error feedback fused into the encode: the payload of ``x = grad +
        residual``, having set ``into ← x − decode(payload)`` (``residual`` where the 0-d ``finite`` is
        False) in its own passes; ``into`` is ``residual`` itself unless given (a second vector,
        :meth:`~gc_strategy.bucket.BucketState.rewritten`; ``residual`` is then left as it is);
        ``grad`` (the bucket's gradient buffer) may be overwritten. None where this compressor has no
        such kernel for these tensors, ``into`` untouched: the memory then compensates, exchanges and
        updates in separate passes."""
        return None

    # ------------------------------------------------------------------ multi-round
    def exchange(
        self, flat: Tensor, bucket: Bucket, communicator: Communicator, local_form: LocalForm, out: Tensor | None = None
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
        received = yield from communicator.exchange(payload, self.variable_size)
        return self.combine(received, bucket, communicator, out=out), local

    # ------------------------------------------------------------------ state and telemetry
    def extra_state(self) -> dict[str, Any]:
        """Non-per-element state to checkpoint (step counters, seeds); saved per rank."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def pop_metrics(self) -> dict[str, float]:
        """Method-specific telemetry accumulated since the last call (e.g. achieved density)."""
        return {}

    # ------------------------------------------------------------------ helpers for subclasses
    def seed_for(self, bucket: Bucket, shared: bool) -> int:
        """A seed mixed from (option ``seed``, step, bucket) and, unless ``shared``, the rank: the
        same draws on every rank when ``shared``, independent draws otherwise. Mixing in the step
        makes a resumed run draw what the uninterrupted run would have drawn."""
        mixed = ((self.options["seed"] * 1_000_003 + self.step) * 1_000_033 + bucket.index) * 1_000_037
        if not shared:
            mixed += self.rank + 1
        return mixed % (2**63 - 1)

    def generator(self, bucket: Bucket, device: torch.device, shared: bool) -> torch.Generator:
        """A torch generator seeded by :meth:`seed_for`."""
        return torch.Generator(device=device).manual_seed(self.seed_for(bucket, shared))

    def magnitudes(self, flat: Tensor, bucket: Bucket) -> Tensor:
        """``|flat|`` in fp32, written into this compressor's workspace for the bucket (which the
        caller may go on to modify in place)."""
        scratch = self.workspace("magnitudes", bucket)
        return torch.abs(flat, out=scratch) if flat.dtype == scratch.dtype else scratch.copy_(flat).abs_()

    def local(self, payload: Payload, bucket: Bucket, form: LocalForm) -> Tensor | None:
        """What error feedback needs of this rank's own payload, in the ``form`` its memory asks
        for, taken before the collective (which may sum the payload in place)."""
        if form == "positions":
            return self.sent_positions(payload, bucket)
        return copy_if_shared(self.local_estimate(payload, bucket), payload) if form == "estimate" else None

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

    def combine(self, received: Any, bucket: Bucket, communicator: Communicator, out: Tensor | None = None) -> Tensor:
        """The average from what the communicator returned: :meth:`average` of the sum or
        :meth:`aggregate` of the gathered payloads. With ``out`` (the bucket's gradient buffer, free
        once it is encoded) the average is written there instead of into a new tensor: on the CPU a
        fresh bucket-sized tensor costs its page faults every step, about 4x a pass over it."""
        if communicator.sums:
            return self.average(received, bucket, communicator.world_size, out=out)
        return self.aggregate(received, bucket, out=out)


def copy_if_shared(tensor: Tensor, others: Payload) -> Tensor:
    """``tensor``, or a copy of it where it shares memory with any of ``others``: what the collective
    may overwrite in place (e.g. ``none``'s payload is its input, and its decode the payload)."""
    shared = {other.untyped_storage().data_ptr() for other in others}
    return tensor.clone() if tensor.untyped_storage().data_ptr() in shared else tensor


def zero_at(tensor: Tensor, positions: Tensor | tuple[Tensor, Tensor]) -> Tensor:
    """``tensor`` zeroed in place at ``positions`` of its last dimension (each row of a 2-D one):
    integer indices, a bool mask of its length, or ``(indices, flags)``: the integer ``indices``
    whose bool flag is set (a gather and a scatter of the indices alone, where a mask would take
    passes over the whole tensor). Flagged indices are distinct; unflagged ones may repeat any
    index, so each flagged entry is subtracted from itself (``x − x = 0`` for finite ``x``) and
    the unflagged add 0."""
    if isinstance(positions, tuple):
        indices, flags = positions
        return tensor.index_add_(-1, indices, tensor.index_select(-1, indices) * flags, alpha=-1)
    if positions.dtype == torch.bool:
        return tensor.masked_fill_(positions, 0)
    return tensor.index_fill_(-1, positions.long(), 0)


def local_in_form(estimate: Tensor, form: LocalForm) -> Tensor | None:
    """A dense local estimate (of an exchange that forms one anyway) in the ``form`` the memory
    asks for (:meth:`Compressor.local`)."""
    if form == "positions":
        return kernels.nonzero_positions(estimate)
    return estimate if form == "estimate" else None


def stored_in(result: Tensor, out: Tensor | None) -> Tensor:
    """``result``, or ``out`` holding it (for averages computed into a tensor of their own)."""
    return result if out is None or result is out else out.copy_(result)


class Memory(BucketState):
    """Error feedback (docs/algorithms.md §6), the one owner of its loop: :meth:`exchange` runs
    ``compensate`` before the compressor's exchange and ``update`` after it.

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

    def exchange(self, grad: Tensor, bucket: Bucket, compressor: Compressor, communicator: Communicator) -> Exchange:
        """One bucket's exchange with this error feedback, through ``compressor`` and
        ``communicator`` (the roles one layer down, in the order they are called); returns
        ``(average, finite)``, ``finite`` None when the memory keeps no state. ``grad`` is the
        bucket's gradient buffer and belongs to the exchange: it may be overwritten, and may come
        back as the average."""
        finite = all_finite(grad) if self.local_form is not None else None
        return (yield from self.compensated_exchange(compressor, grad, bucket, communicator, finite))

    def compensated_exchange(
        self, compressor: Compressor, grad: Tensor, bucket: Bucket, communicator: Communicator, finite: Tensor | None
    ) -> Exchange:
        """``compensate -> compressor.exchange -> update`` (the update skipped without state)."""
        compensated = self.compensate(grad, bucket, finite)
        average, local = yield from compressor.exchange(compensated, bucket, communicator, self.local_form, out=grad)
        if finite is not None:
            self.update(compensated, local, bucket, finite)
        return average, finite
