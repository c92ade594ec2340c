"""A replica group's place in torchft's quorums, shared by the fault-tolerant synchronisers
(:mod:`gc_strategy.sync.fault_tolerance.every_step`: every step; :mod:`gc_strategy.sync.fault_tolerance.diloco`:
every outer step). docs/fault_tolerance.md.

A *replica group* is a set of ranks that live and die together: one process, or the ranks of one
launch (its default process group).
torchft (Ma et al., "torchft", PyTorch 2025) runs a lighthouse that decides, at each request, which
groups take part (the *quorum*), and a manager in each group that forms a process group over them
anew whenever a group dies, joins or comes back. A group that joins, comes back or fell behind
first *heals*: it loads a live peer's state, sent by torchft's checkpoint transport.

:class:`Quorum` asks for a quorum, gives the exchanges its process group through
:class:`QuorumRoute`, and holds the round's :class:`StepFailure`: an exchange whose peer died (a
closed connection or the collective's timeout) reports it to the manager instead of raising, and
every later exchange of the round is skipped, so that a round fails in one timeout at most and
torchft's vote (:meth:`Quorum.vote`) then says, on every participant, not to commit it.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...bucket import Bucket
from ...communicators import Exchange, Round
from ...components import Components
from ..paths.hierarchy import NodeGroups, NodeRoute, node_exchange
from ..paths.routes import FlatRoute, Route
from .abort import abortable_gloo
from .lighthouse import reach_lighthouse
from .options import FaultTolerance
from .silence import Address, Heartbeats
from .torchft_setup import checkpoint_transport, require_torchft

#: where a quorum's process group's store holds each member group's number of ranks (``GROUP_RANKS_KEY/RANK``)
GROUP_RANKS_KEY = "gc_strategy_group_ranks"


class UnequalGroups(ValueError):
    """Replica groups of unequal numbers of ranks met in a quorum."""


def same_group_ranks(store: Any, world_size: int, local_world: int, group: int) -> None:
    """Refuse a quorum whose member groups have unequal numbers of ranks (each member wrote its
    own under :data:`GROUP_RANKS_KEY` before it joined the formation). Rank ``r`` of a group
    exchanges with rank ``r`` of the others, its shard, or the buckets it owns: a rank with no
    counterpart would wait for it for ever, and the others' buckets and shards would not match."""
    sizes = [int(store.get(f"{GROUP_RANKS_KEY}/{r}")) for r in range(world_size)]
    if any(size != local_world for size in sizes):
        raise UnequalGroups(
            f"fault_tolerance: replica groups of unequal ranks in one quorum (ranks per group: {sizes}; replica "
            f"group {group} has {local_world}); allowed: every group as many ranks (rank r of a group exchanges "
            "its shard or its buckets with rank r of the others): start every group with the same devices "
            "(nproc_per_node)"
        )


class StepFailure:
    """Whether a collective of the current round failed. The first failure goes to the manager and
    aborts the round's process group (``abort``), so that every participant's pending collective
    of the round fails at once (:mod:`~gc_strategy.sync.fault_tolerance.abort`). Reported from the
    training thread or from the heartbeats' (:mod:`~gc_strategy.sync.fault_tolerance.silence`)."""

    def __init__(self, manager: Any, abort: Callable[[], None]) -> None:
        self.manager, self.abort = manager, abort
        self.failed = False
        self._lock = threading.Lock()

    def report(self, error: Exception) -> None:
        with self._lock:
            first, self.failed = not self.failed, True
        if first:
            self.manager.report_error(error)
            self.abort()


class _GuardedRound(Round):
    """A round whose wait reports a failure instead of raising (and then returns None)."""

    def __init__(self, inner: Round, failure: StepFailure) -> None:
        super().__init__([], inner.wait, inner.nbytes, inner.eager, inner.inside_node)
        self.works, self.inner, self.failure = inner.works, inner, failure

    def wait(self) -> Any:
        try:
            return self.inner.wait()
        except Exception as error:  # a peer died: the collective closed or timed out
            self.failure.report(error)
            return None

    @property
    def duration(self) -> float:
        return self.inner.duration


def guarded(inner: Exchange, flat: Tensor, failure: StepFailure) -> Exchange:
    """``inner`` driven round by round until it ends or a round fails; after a failure (this
    exchange's or an earlier one's) it stops at once and returns ``flat`` as it is: the step will
    not commit, so its value is never used."""
    if failure.failed:
        inner.close()
        yield Round([], lambda: None, 0)
        return flat, None
    try:
        current = next(inner)
        while True:
            value = yield _GuardedRound(current, failure)
            if failure.failed:
                inner.close()
                return flat, None
            current = inner.send(value)
    except StopIteration as stop:
        return stop.value
    except Exception as error:  # issuing a collective on a broken group
        failure.report(error)
        yield Round([], lambda: None, 0)
        return flat, None


class GuardedWork:
    """A collective's work whose ``wait`` reports a failure instead of raising; ``counts`` then
    holds this rank's own values (the round will not commit)."""

    def __init__(self, work: Any, counts: Tensor, failure: StepFailure) -> None:
        self.work, self.counts, self.failure = work, counts, failure
        self.own = counts.clone()

    def wait(self) -> None:
        try:
            if self.work is not None:
                self.work.wait()
        except Exception as error:  # a peer died
            self.failure.report(error)
        if self.failure.failed:
            self.counts.copy_(self.own)


def guarded_sum(counts: Tensor, group: Any, failure: StepFailure) -> GuardedWork:
    """``counts`` summed over ``group`` asynchronously, guarded (skipped after a failure)."""
    work = None
    if not failure.failed:
        try:
            work = dist.all_reduce(counts, group=group, async_op=True)
        except Exception as error:  # issuing it on a broken group
            failure.report(error)
    return GuardedWork(work, counts, failure)


class QuorumRoute(FlatRoute):
    """Groups of one rank: every participating group exchanges with every other over ``quorum``'s
    process group, each collective guarded by the round's :class:`StepFailure`."""

    def __init__(self, quorum: Quorum) -> None:
        super().__init__(quorum.group)
        self.quorum = quorum

    def exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> Exchange:
        return guarded(super().exchange(flat, bucket, roles), flat, self.quorum.failure)

    def sum_counts(self, counts: Tensor) -> GuardedWork:
        return guarded_sum(counts, self.group, self.quorum.failure)


class QuorumNodeRoute(NodeRoute):
    """Groups of several ranks (:mod:`gc_strategy.sync.paths.hierarchy`'s exchange, a group as a node):
    each bucket is reduced onto its owner inside the group, exchanged by the owners across the
    groups over ``quorum``'s process group (the same local rank of every group; guarded), and
    broadcast back inside the group. The collectives inside the group run whatever happened across,
    so that every rank of a group issues the same ones."""

    def __init__(self, quorum: Quorum) -> None:
        groups = NodeGroups(quorum.participants, quorum.local_world, 0, quorum.local_rank, None, quorum.group)
        super().__init__(groups)
        self.quorum = quorum

    def exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> Exchange:
        def across(flat: Tensor, bucket: Bucket) -> Exchange:
            return guarded(roles.exchange(flat, bucket), flat, self.quorum.failure)

        return node_exchange(flat, bucket, roles, self.groups, self.owners[bucket.index], across=across)

    def sum_counts(self, counts: Tensor) -> GuardedWork:
        """Inside the group (every rank of it, whatever happened across), then across the groups
        (guarded)."""
        dist.all_reduce(counts, group=self.groups.intra)
        return guarded_sum(counts, self.group, self.quorum.failure)


def quorum_route(quorum: Quorum) -> Route:
    """The route of the quorum's round: flat for groups of one rank, through each group's ranks
    otherwise."""
    return QuorumRoute(quorum) if quorum.local_world == 1 else QuorumNodeRoute(quorum)


class Quorum:
    """This replica group's membership in torchft's quorums (see the module's docstring).
    ``state_dict`` gives what a healing peer loads from this group, ``load_state_dict`` loads a
    peer's; torchft calls them inside :meth:`start`, between rounds."""

    def __init__(
        self,
        options: FaultTolerance,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> None:
        torchft = require_torchft()
        reach_lighthouse(options)
        self.options = options
        timeout = timedelta(seconds=options.timeout_s)
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        #: this process's place in its replica group: a group of several ranks is the default process group
        self.local_rank, self.local_world = (dist.get_rank(), dist.get_world_size()) if several else (0, 1)
        if several:  # the group's launcher's store, where torchft's manager of the group registers
            store_port = int(os.environ["MASTER_PORT"])
        else:
            self._store = dist.TCPStore(options.host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
            store_port = self._store.port
        self.process_group = abortable_gloo(torchft)(timeout, timedelta(seconds=options.silence_s))
        self._load_state_dict = load_state_dict
        self._received: dict[str, Any] | None = None
        #: the group's own ranks, on the host, to agree at each round whether all of them formed it
        agreement = timeout + timedelta(seconds=options.quorum_timeout_s)
        self._ranks = dist.new_group(backend="gloo", timeout=agreement) if several else None
        try:
            self.manager = torchft.Manager(
                pg=self.process_group,
                load_state_dict=self._receive,
                state_dict=state_dict,
                min_replica_size=options.min_replicas,
                use_async_quorum=False,  # heal before the round; every group in the quorum takes part
                timeout=timeout,
                quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
                connect_timeout=timeout,
                rank=self.local_rank,
                world_size=self.local_world,
                store_addr=options.host,
                store_port=store_port,
                lighthouse_addr=options.lighthouse,
                replica_id=str(options.replica_group),
                hostname=options.host,
                checkpoint_transport=checkpoint_transport(torchft, options.host, timeout),
            )
        except RuntimeError as error:
            raise RuntimeError(
                f"fault_tolerance: the lighthouse at {options.lighthouse} did not answer as a lighthouse within "
                f"timeout_s = {options.timeout_s} s; start it first (torchft_lighthouse --min_replicas 1 "
                f"--join_timeout_ms 10000) or correct lighthouse=. {error}"
            ) from error
        self.failure = self._new_failure()
        #: beats to the round's peers, and the watch on theirs: a silent peer fails the round
        self.heartbeats = Heartbeats(options.host, options.silence_s, self._silent)
        self.process_group.on_forming = self._forming  # as each quorum's group is formed
        #: why this group cannot train with the others (groups of unequal ranks), once a quorum found it
        self._refused: UnequalGroups | None = None
        #: the quorum's process group (None before the first quorum, or where it could not be formed)
        self.group: Any = None
        #: the participating groups of the current round (0 before the first quorum)
        self.participants = 0
        self._short_since: float | None = None
        self._alone = False

    def start(self) -> bool:
        """The round's quorum (healing first where this group must); whether its process group
        changed (then the roles must be bound to it again)."""
        options = self.options
        counters = self.manager.state_dict()
        try:
            self.manager.start_quorum()
        except Exception as error:
            raise RuntimeError(
                f"fault_tolerance: no quorum within quorum_timeout_s = {options.quorum_timeout_s} s from the "
                f"lighthouse at {options.lighthouse} (is it running, and are enough replica groups up?): {error}"
            ) from error
        if self._refused is not None:
            raise self._refused
        self.failure = self._new_failure()
        received, self._received = self._received, None
        changed = False
        if not self._all_ranks_formed_it():  # the round cannot commit, and no rank applies a peer's state
            if self.manager.errored() is None:
                self.failure.report(RuntimeError("fault_tolerance: another rank of this group could not join"))
            self.failure.failed = True
            self.manager.load_state_dict(counters)  # a rank that healed drops the peer's counters too
        else:
            if received is not None:
                self._load_state_dict(received)
            group = self.process_group.parent  # a new object whenever the quorum changed
            changed, self.group = group is not self.group, group
        self.participants = self.manager.num_participants()
        self._say_when_alone()
        self._check_enough_groups()
        return changed

    def _forming(self, store: Any, rank: int, world_size: int) -> None:
        """A new quorum's process group is formed: write this group's ranks, learn the members'
        heartbeat addresses (every member's ranks are written once its address is), and refuse
        members of unequal ranks."""
        store.set(f"{GROUP_RANKS_KEY}/{rank}", str(self.local_world))
        self.heartbeats.exchange(store, rank, world_size)
        try:
            same_group_ranks(store, world_size, self.local_world, self.options.replica_group)
        except UnequalGroups as refusal:
            self._refused = refusal
            raise

    def _new_failure(self) -> StepFailure:
        return StepFailure(self.manager, self.process_group.abort_connections)

    def _silent(self, peers: list[Address]) -> None:
        self.failure.report(
            TimeoutError(
                f"fault_tolerance: {len(peers)} peer(s) of this round unheard for silence_s = "
                f"{self.options.silence_s} s ({', '.join(f'{h}:{p}' for h, p in peers)}): hung or cut off"
            )
        )

    def watch(self) -> None:
        """The round's collectives begin: a peer silent for ``silence_s`` fails it from now on."""
        self.heartbeats.arm()

    def unwatch(self) -> None:
        """The round's collectives are over (the vote and the next quorum involve no peer)."""
        self.heartbeats.disarm()

    def _say_when_alone(self) -> None:
        """Warn, each time this group starts to train alone, that its steps are averaged with no
        other group's, and how to wait for peers instead."""
        options = self.options
        alone = self.participants == 1 < options.groups and options.min_replicas == 1
        if alone and not self._alone:
            warnings.warn(
                f"fault_tolerance: replica group {options.replica_group} trains alone: it is the only one of "
                f"groups = {options.groups} in this round's quorum (the others have not started, have ended or "
                "were lost), and min_replicas = 1 lets a round commit with it alone. To wait for peers instead, "
                "set min_replicas to the fewest groups a step should have (e.g. 2)",
                RuntimeWarning,
                stacklevel=5,  # the loop's call of start_step
            )
        self._alone = alone

    def _receive(self, state: dict[str, Any]) -> None:
        """torchft hands over a peer's state: it is applied once every rank of the group has its own."""
        self._received = state

    def _all_ranks_formed_it(self) -> bool:
        """Whether every rank of this group formed the round's process group and, where it heals,
        received its peer's state. A healing rank whose transfer failed (the peer died while sending)
        would otherwise leave the others healed alone, at another step than its own: the group's
        ranks would then run different rounds, and wait for each other for ever."""
        formed = self.manager.errored() is None
        if self._ranks is None:
            return formed
        flag = torch.tensor([int(formed)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._ranks)
        return bool(flag.item())

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of this group (a one-number all-reduce inside a group
        of several ranks), so that a decision taken by the clock is the same on all of them."""
        if self._ranks is None:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._ranks)
        return bool(value.item())

    def _check_enough_groups(self) -> None:
        """Refuse to retry for longer than the quorum timeout rounds that cannot commit because
        fewer than ``min_replicas`` groups take part."""
        options = self.options
        if self.participants >= options.min_replicas:
            self._short_since = None
            return
        now = time.monotonic()
        self._short_since = self._short_since or now
        if now - self._short_since > options.quorum_timeout_s:
            raise RuntimeError(
                f"fault_tolerance: only {self.participants} replica group(s) took part for over quorum_timeout_s = "
                f"{options.quorum_timeout_s} s, and min_replicas = {options.min_replicas}: no step can commit; start "
                "more groups or lower min_replicas"
            )

    def sum(self, value: float) -> float:
        """``value`` summed over the participants, guarded as the exchanges are (after a failure the
        sum is meaningless: the round will not commit)."""
        tensor = torch.tensor([value], dtype=torch.float64)
        if not self.failure.failed:
            try:
                dist.all_reduce(tensor, group=self.group, async_op=True).wait()
            except Exception as error:  # a peer died
                self.failure.report(error)
        return tensor.item()

    def guard(self, collective: Callable[[], Any]) -> bool:
        """Run ``collective`` over the quorum's group (several collectives, or work that issues
        them); where a peer died in it, report the failure instead of raising. Whether it succeeded."""
        if self.failure.failed:
            return False
        try:
            collective()
        except Exception as error:  # a peer died
            self.failure.report(error)
            return False
        return True

    def vote(self) -> bool:
        """torchft's vote: True where every participant's round succeeded."""
        return self.manager.should_commit()

    @property
    def step(self) -> int:
        """The rounds committed so far (the same on every participant; a healed group takes its peer's)."""
        return self.manager.current_step()

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes the run's checkpoint: the first participant of the last
        quorum, so that one group writes at a time (every group holds the same parameters)."""
        return self.manager.participating_rank() == 0

    def state_dict(self) -> dict[str, int]:
        """The manager's counters (the rounds committed), for a checkpoint."""
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """A checkpoint's counters: groups restarted from one checkpoint start at its round, and no
        group heals from another (which would reset its error feedback)."""
        self.manager.load_state_dict(state)

    def close(self) -> None:
        """Leave the quorums: the others go on without this group."""
        self.heartbeats.close()
        self.manager.shutdown(wait=False)
