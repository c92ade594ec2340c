"""The Compressor and Memory roles (ALGORITHMS.md §1) and their name registries."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ..bucket import Bucket, BucketState
from ..comm import Communicator, Exchange, Payload
from ..registry import Option, Registry

COMPRESSORS: Registry["Compressor"] = Registry("compressor")
MEMORIES: Registry["Memory"] = Registry("memory")


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

    def generator(self, bucket: Bucket, device: torch.device, shared: bool) -> torch.Generator:
        """A random generator seeded from (option ``seed``, step, bucket) and, unless ``shared``, the
        rank: the same draws on every rank when ``shared``, independent draws otherwise. Seeding from
        the step makes a resumed run draw what the uninterrupted run would have drawn."""
        seed = self.options.get("seed", 0)
        mixed = ((seed * 1_000_003 + self.step) * 1_000_033 + bucket.index) * 1_000_037
        if not shared:
            mixed += self.rank + 1
        return torch.Generator(device=device).manual_seed(mixed % (2**63 - 1))

    def pop_metrics(self) -> dict[str, float]:
        """Method-specific telemetry accumulated since the last call (e.g. achieved density)."""
        return {}

    def encode(self, flat: Tensor, bucket: Bucket) -> Payload:
        raise NotImplementedError

    def decode(self, payload: Payload, bucket: Bucket) -> Tensor:
        raise NotImplementedError

    def average(self, summed: Payload, bucket: Bucket, world_size: int) -> Tensor:
        """Average from the element-wise sum of all ranks' payloads (summable compressors)."""
        return self.decode(summed, bucket).div_(world_size)

    def aggregate(self, gathered: list[Payload], bucket: Bucket) -> Tensor:
        """Average from every rank's payload (gathered compressors): mean of the decodes."""
        total = self.decode(gathered[0], bucket).clone()
        for payload in gathered[1:]:
            total.add_(self.decode(payload, bucket))
        return total.div_(len(gathered))

    def exchange(self, flat: Tensor, bucket: Bucket, comm: Communicator, need_local: bool) -> Exchange:
        """Encode, communicate, combine. Returns ``(average, local estimate or None)``.

        Multi-round methods override this and ``yield from`` several communicator exchanges.
        """
        payload = self.encode(flat, bucket)
        local = self.decode(payload, bucket).clone() if need_local else None
        received = yield from comm.exchange(payload, self.variable_size)
        if comm.sums:
            return self.average(received, bucket, comm.world_size), local
        return self.aggregate(received, bucket), local

    def extra_state(self) -> dict[str, Any]:
        """Non-per-element state to checkpoint (step counters, seeds); saved per rank."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass


class Memory(BucketState):
    """Error feedback (ALGORITHMS.md §6): ``compensate`` before encoding, ``update`` after.

    ``update`` receives ``finite``, a 0-d bool tensor that is False when the bucket's gradient held an
    inf or NaN; the memory must then keep its previous state (no host synchronisation needed).
    """

    OPTIONS: ClassVar[dict[str, Option]] = {}
    name: ClassVar[str]
    #: whether ``update`` needs the local decode of the local payload
    needs_local_estimate: ClassVar[bool] = True
    #: applies its own momentum (the optimizer's should then be off)
    applies_momentum: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def compensate(self, grad: Tensor, bucket: Bucket) -> Tensor:
        raise NotImplementedError

    def update(self, compensated: Tensor, local_estimate: Tensor, bucket: Bucket, finite: Tensor) -> None:
        raise NotImplementedError
