"""Communicators: asynchronous collectives over one process group (docs/algorithms.md §1).

A communicator's :meth:`Communicator.exchange` is a generator: it issues one collective, ``yield``s a
:class:`Round` (the in-flight collective) and receives the round's result back when the synchroniser has
waited for it. The synchroniser drives these generators in one deterministic order on every rank, so a
collective that needs a previous one (the data gather after a length exchange, PowerSGD's Q after P)
is issued at the same point on all ranks. An exchange may mark a round ``eager``: one whose result a
later collective of the same exchange needs (PowerSGD's P, a length handshake) and small enough to
arrive quickly. The synchroniser advances it at the next launch of a large enough bucket (or at the end
of backward), so that the later collective is issued during backward rather than after it.

- ``allreduce``: element-wise sum of summable payloads; one collective per payload tensor.
- ``allgather``: every rank receives every rank's payload. Payload tensors of any dtypes are packed
  into one byte buffer. Sizes may differ between ranks (variable-size sparsifiers): the ranks first
  exchange their per-tensor lengths, then gather byte buffers padded to the largest one (gloo's
  ``all_gather`` needs equal sizes), so memory stays bounded by largest payload x world size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from .registry import Option, Registry

Payload = list[Tensor]
#: eager rounds are advanced after the launch of a bucket of at least this size (or at the end of
#: backward): a smaller one's gradients and encode give the round too little time to arrive, and
#: waiting for it would stall backward
EAGER_AFTER_BYTES = 1 << 20


class Round:
    """In-flight collectives (``works``, issued together): ``wait()`` blocks until all complete and
    returns the round's result. ``eager`` rounds are advanced by the synchroniser during backward (see
    the module's docstring); ``inside_node`` rounds stay inside a node (``hierarchy="node"``) and
    are counted apart."""

    def __init__(
        self, works: list[Any], result: Callable[[], Any], nbytes: int, eager: bool = False, inside_node: bool = False
    ) -> None:
        self.works = works
        self._result = result
        self.nbytes = nbytes
        self.eager = eager
        self.inside_node = inside_node
        self.launched = time.perf_counter()
        self.completed: float | None = None
        if not works:
            self.completed = self.launched
        else:
            works[-1].get_future().add_done_callback(self._mark_completed)

    def _mark_completed(self, _future: Any) -> None:
        self.completed = time.perf_counter()

    def wait(self) -> Any:
        for work in self.works:
            work.wait()
        if self.completed is None:
            self.completed = time.perf_counter()
        return self._result()

    @property
    def duration(self) -> float:
        """Seconds from issue to completion (valid once waited for)."""
        return (self.completed or time.perf_counter()) - self.launched


Exchange = Generator[Round, Any, Any]


class RunningExchange:
    """One exchange driven round by round: the synchroniser and the fusion profiler both run exchanges
    through it. Starting runs the generator to its first round; :meth:`advance` waits for the
    current round and runs the generator to the next one (or to its end, when ``result`` holds what
    it returned). The host time of each part is kept: ``encode_s`` up to the first round,
    ``between_s`` between rounds, ``wait_s`` waiting for rounds, ``decode_s`` after the last; and
    what the rounds sent (``node_bytes`` for rounds inside a node, ``sent_bytes`` for the rest),
    and whether one was ``eager`` (the rest of the exchange then waits for the synchroniser to advance it).
    ``clock`` reads the time (one that synchronises a device measures its work too)."""

    def __init__(self, exchange: Exchange, clock: Callable[[], float] = time.perf_counter) -> None:
        self.exchange = exchange
        self.clock = clock
        self.result: Any = None
        self.between_s = self.wait_s = self.decode_s = self.collective_s = 0.0
        self.sent_bytes = self.node_bytes = self.collectives = 0
        self.eager = False
        start = clock()
        self.round: Round | None = next(exchange)
        self.encode_s = clock() - start

    @property
    def done(self) -> bool:
        return self.round is None

    @property
    def host_s(self) -> float:
        """All host time spent on this exchange so far."""
        return self.encode_s + self.between_s + self.wait_s + self.decode_s

    def advance(self) -> None:
        """Wait for the current round and run the generator to its next round, or to its end."""
        current = self.round
        start = self.clock()
        value = current.wait()
        resumed = self.clock()
        self.wait_s += resumed - start
        self.collective_s += current.duration
        if current.inside_node:
            self.node_bytes += current.nbytes
        else:
            self.sent_bytes += current.nbytes
        self.collectives += len(current.works)
        self.eager = self.eager or current.eager
        try:
            self.round = self.exchange.send(value)
            self.between_s += self.clock() - resumed
        except StopIteration as stop:
            self.round, self.result = None, stop.value
            self.decode_s += self.clock() - resumed

    def finish(self) -> Any:
        """Advance to the end; the exchange's result."""
        while self.round is not None:
            self.advance()
        return self.result


COMMUNICATORS: Registry[Communicator] = Registry("communicator")


class Communicator:
    """Moves payloads between the ranks of one process group."""

    OPTIONS: ClassVar[dict[str, Option]] = {}
    name: ClassVar[str]
    #: True when the result is the element-wise sum of the payloads (needs summable payloads).
    sums: ClassVar[bool]

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.group: Any = None
        self.world_size = 1
        self.rank = 0

    def bind(self, group: Any) -> None:
        """Attach to a process group (``None``: the default group, or a single process without one).
        The group's own size and rank are read, so that a group torch does not know of (one that
        fault tolerance reconfigures at each quorum) serves too."""
        self.group = group
        if group is not None:
            self.world_size, self.rank = group.size(), group.rank()
        else:
            initialized = dist.is_available() and dist.is_initialized()
            self.world_size = dist.get_world_size() if initialized else 1
            self.rank = dist.get_rank() if initialized else 0

    def exchange(self, payload: Payload, variable_size: bool, eager: bool = False) -> Exchange:
        """Send ``payload``; the generator yields the collectives' rounds (the last one ``eager``
        when asked) and returns what arrived."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait for every rank of the group (so that timed exchanges start together)."""
        if self.world_size > 1:
            dist.barrier(group=self.group)


@COMMUNICATORS.register("allreduce")
class AllReduce(Communicator):
    """Sum each payload tensor over all ranks, in place (ring/tree allreduce of the backend)."""

    sums = True

    def exchange(self, payload: Payload, variable_size: bool, eager: bool = False) -> Exchange:
        if variable_size:
            raise ValueError("allreduce cannot sum payloads whose sizes differ between ranks")
        nbytes = sum(t.numel() * t.element_size() for t in payload)
        works = [] if self.world_size == 1 else [dist.all_reduce(t, group=self.group, async_op=True) for t in payload]
        return (yield Round(works, lambda: payload, nbytes, eager))


@COMMUNICATORS.register("allgather")
class AllGather(Communicator):
    """Gather every rank's payload; sizes may differ between ranks (length exchange + padding)."""

    sums = False

    def exchange(self, payload: Payload, variable_size: bool, eager: bool = False) -> Exchange:
        payload = [t.contiguous().view(-1) for t in payload]
        nbytes = sum(t.numel() * t.element_size() for t in payload)
        if self.world_size == 1:
            return (yield Round([], lambda: [payload], nbytes, eager))
        counts = [t.numel() for t in payload]
        if variable_size:  # the one host synchronisation: every rank's lengths are needed to unpack
            lengths = torch.tensor(counts, dtype=torch.int64, device=_device(payload))
            all_counts = [lens.tolist() for lens in (yield self._gather(lengths, eager=True))]
        else:  # known on the host: no device round trip
            all_counts = [counts] * self.world_size
        dtypes = [t.dtype for t in payload]
        sizes = [[n * d.itemsize for n, d in zip(rank_counts, dtypes)] for rank_counts in all_counts]
        padded = max(1, max(sum(s) for s in sizes))  # never gather zero bytes (no rank selected anything)
        packed = torch.zeros(padded, dtype=torch.uint8, device=_device(payload))
        if nbytes:
            torch.cat([t.view(torch.uint8) for t in payload], out=packed[:nbytes])
        gathered = yield self._gather(packed, eager, nbytes)
        return [_unpack(buf, rank_sizes, dtypes) for buf, rank_sizes in zip(gathered, sizes)]

    def _gather(self, tensor: Tensor, eager: bool = False, nbytes: int | None = None) -> Round:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        sent = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
        return Round([work], lambda: out, sent, eager=eager)


def _device(payload: Payload) -> torch.device:
    return payload[0].device if payload else torch.device("cpu")


def _unpack(buffer: Tensor, sizes: list[int], dtypes: list[torch.dtype]) -> Payload:
    out, start = [], 0
    for size, dtype in zip(sizes, dtypes):
        piece = buffer[start : start + size]
        if start % dtype.itemsize:  # a dtype view needs an aligned offset
            piece = piece.clone()
        out.append(piece.view(dtype))
        start += size
    return out
