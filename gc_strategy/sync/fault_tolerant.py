"""Per-step fault tolerance across replica groups, on torchft (docs/fault_tolerance.md).

A *replica group* is a set of ranks that live and die together; here each group is one process.
The groups train the same model on their own data and average their compressed gradients every
step, as with :class:`~gc_strategy.sync.every_step.GradientSynchronizer`, but over a process group
that torchft (Ma et al., "torchft", PyTorch 2025) forms anew whenever a group dies, joins or comes
back, so that the survivors go on instead of ending the run. Each step:

1. **Quorum.** torchft's lighthouse decides the participating groups; the manager reconfigures a
   process group over them (rank: the group's place in the quorum). A group that joins, comes back
   or fell behind first *heals*: it loads a live peer's state (parameters and buffers, the optimizers
   and whatever else it was given, the synchroniser's step, gradient order and the state all ranks
   share, e.g. PowerSGD's factors), sent by torchft's checkpoint transport. Its error feedback and
   other per-rank state start at zero: they hold what *this* group's own gradients left unsent, and
   a peer's copy would apply the peer's correction twice (once there, once here).
2. **Bind.** Where the quorum changed, the roles are bound again to the new group
   (:meth:`GradientSynchronizer.rebind`): the average is over the participants, the communicator's
   size. The roles' per-element and shared state are kept (a copy on their device) before any
   exchange of the step.
3. **Exchange.** Backward runs each bucket's compressed exchange over that group. An exchange that
   fails (a peer died: a closed connection or the collective's timeout) is reported to the manager
   and every later exchange of the step is skipped, so a step fails in one timeout at most.
4. **Commit.** ``should_commit`` is True only where every participant finished without error
   (torchft's vote). Where False no optimizer step is taken, and the roles' state is put back as it
   was before the step: error feedback, compressor state and step counter exactly as if the step
   had not been tried.

A failed step costs its compute and one timeout; a dead group's samples of that step are lost (each
group reads its own shard; docs/fault_tolerance.md). torchft is optional (``pip install
"gc_strategy[ft]"``, torch >= 2.7).
"""

from __future__ import annotations

import copy
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..bucket import Bucket
from ..communicators import Exchange, Round
from ..components import Components
from ..fusion import AutoPlanner
from ..telemetry import TelemetryLog
from .base import Synchronizer
from .every_step import GradientSynchronizer
from .routes import FlatRoute


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class FaultTolerance:
    """Where the lighthouse is and which replica group this process is.

    ``lighthouse``: the lighthouse's address (``http://HOST:PORT``; ``torchft_lighthouse`` prints
    it). ``replica_group``: this group's id, 0 to ``groups - 1`` (a group that comes back uses its
    old id); ``groups``: how many the run is planned with, the shards the data is split into (group
    ``g`` reads shard ``g``; the integrations' samplers do so). ``min_replicas``: the fewest groups a
    step commits with. ``timeout_s``: the bound on a collective, the commit vote and a healing
    transfer; ``quorum_timeout_s``: on waiting for a quorum. ``host``: the address the peers reach
    this group's manager and store at (a healing peer fetches state from it)."""

    lighthouse: str
    replica_group: int
    groups: int = 1
    min_replicas: int = 1
    timeout_s: float = 30.0
    quorum_timeout_s: float = 120.0
    host: str = socket.gethostname()

    def __post_init__(self) -> None:
        if not isinstance(self.lighthouse, str) or not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(
                f"fault_tolerance: lighthouse = {self.lighthouse!r} is invalid; allowed: the lighthouse's address "
                "as http://HOST:PORT (torchft_lighthouse prints it)"
            )
        for name, low in (("replica_group", 0), ("groups", 1), ("min_replicas", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"fault_tolerance: {name} = {value!r} is invalid; allowed: an integer >= {low}")
        if self.replica_group >= self.groups:
            raise ValueError(
                f"fault_tolerance: replica_group = {self.replica_group} is invalid with groups = {self.groups}; "
                f"allowed: 0 to {self.groups - 1}"
            )
        for name in ("timeout_s", "quorum_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"fault_tolerance: {name} = {value!r} is invalid; allowed: a number of seconds > 0")


def require_torchft() -> Any:
    """The ``torchft`` module with the parts used here imported, or an error that says how to
    install it."""
    try:
        import torchft
        import torchft.checkpointing.http_transport
        import torchft.process_group
    except ImportError as error:
        raise ImportError('fault_tolerance needs torchft (torch >= 2.7): pip install "gc_strategy[ft]"') from error
    return torchft


def checkpoint_transport(torchft: Any, host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (how a healing group fetches a peer's state), advertised
    at ``host``: torchft's own advertises the machine's host name, which peers on another network
    (a namespace, a container) may not reach."""

    class Transport(torchft.checkpointing.http_transport.HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


class _StepFailure:
    """Whether an exchange of the current step failed; the first failure goes to the manager."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.failed = False

    def report(self, error: Exception) -> None:
        if not self.failed:
            self.failed = True
            self.manager.report_error(error)


class _GuardedRound(Round):
    """A round whose wait reports a failure instead of raising (and then returns None)."""

    def __init__(self, inner: Round, failure: _StepFailure) -> None:
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


def _guarded(inner: Exchange, flat: Tensor, failure: _StepFailure) -> Exchange:
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


class _QuorumRoute(FlatRoute):
    """Every participating group exchanges with every other over the quorum's process group, each
    exchange guarded by the step's :class:`_StepFailure`."""

    def __init__(self, group: Any, failure: _StepFailure) -> None:
        super().__init__(group)
        self.failure = failure

    def exchange(self, flat: Tensor, bucket: Bucket, roles: Components) -> Exchange:
        return _guarded(super().exchange(flat, bucket, roles), flat, self.failure)


class FaultTolerantSynchronizer(Synchronizer):
    """See the module's docstring. ``module``'s gradients are averaged through ``roles`` across the
    participating replica groups; ``healed`` names further objects with ``state_dict`` and
    ``load_state_dict`` that a healing group takes from a peer (optimizers, LR schedules, a loop's
    counters); optimizers given to :meth:`use_optimizers` are added to them.

    A training loop::

        sync = FaultTolerantSynchronizer(model, build_components("topk", "residual"), options)
        sync.use_optimizers([optimizer])
        for batch in loader:
            with sync.forward_pass():           # the quorum (and healing) before the first forward
                loss = model(batch)
            loss.backward()                     # the exchange over the participating groups
            if sync.should_commit():            # False: a peer failed; the roles' state is restored
                optimizer.step()
            optimizer.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        roles: Components,
        options: FaultTolerance,
        healed: dict[str, Stateful] | None = None,
        find_unused_parameters: bool = False,
    ) -> None:
        torchft = require_torchft()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "fault_tolerance: replica groups of one process are supported (each process its own group, "
                f"--replica_group); this process group has {dist.get_world_size()} ranks"
            )
        if isinstance(roles.fusion, AutoPlanner):
            raise ValueError(
                "fault_tolerance: fusion = 'auto' is invalid (its plan is measured with collectives the groups "
                "would not all take part in); allowed: 'bucket_mb:N', 'groups:N', 'layerwise', 'single', 'file:PATH'"
            )
        self.module, self.options = module, options
        self.healed: dict[str, Stateful] = dict(healed or {})
        self.inner = GradientSynchronizer(
            module,
            roles,
            broadcast_from_rank0=False,
            broadcast_buffers=False,
            find_unused_parameters=find_unused_parameters,
        )
        if self.inner.ready_order is None:  # no first-step agreement: a group may join at any step
            self.inner.ready_order = list(self.inner.layout.order)
        timeout = timedelta(seconds=options.timeout_s)
        self._store = dist.TCPStore(options.host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self.process_group = torchft.process_group.ProcessGroupGloo(timeout=timeout)
        try:
            self.manager = self._manager(torchft, options, timeout)
        except RuntimeError as error:
            raise RuntimeError(
                f"fault_tolerance: the lighthouse at {options.lighthouse} could not be reached within "
                f"timeout_s = {options.timeout_s} s; start it first (torchft_lighthouse --min_replicas 1 "
                f"--join_timeout_ms 10000) or correct lighthouse=. {error}"
            ) from error
        self._failure = _StepFailure(self.manager)
        self._group: Any = None
        self._kept: dict[str, Any] | None = None
        self._short_since: float | None = None
        #: the participating groups of the current step (0 before the first quorum)
        self.participants = 0
        self.failed_steps = 0

    def _manager(self, torchft: Any, options: FaultTolerance, timeout: timedelta) -> Any:
        return torchft.Manager(
            pg=self.process_group,
            load_state_dict=self._load_peer_state,
            state_dict=self._peer_state,
            min_replica_size=options.min_replicas,
            use_async_quorum=False,  # heal before the forward; every group in the quorum takes part
            timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr=options.host,
            store_port=self._store.port,
            lighthouse_addr=options.lighthouse,
            replica_id=str(options.replica_group),
            hostname=options.host,
            checkpoint_transport=checkpoint_transport(torchft, options.host, timeout),
        )

    # ------------------------------------------------------------------ one step
    def start_step(self) -> None:
        """The step's quorum (healing first where this group must), then the roles bound to its
        group and their state kept. Called by :meth:`before_forward` once per optimizer step."""
        options = self.options
        try:
            self.manager.start_quorum()
        except Exception as error:
            raise RuntimeError(
                f"fault_tolerance: no quorum within quorum_timeout_s = {options.quorum_timeout_s} s from the "
                f"lighthouse at {options.lighthouse} (is it running, and are enough replica groups up?): {error}"
            ) from error
        self._failure = _StepFailure(self.manager)
        if self.manager.errored() is not None:  # the group could not be formed: the step cannot commit
            self._failure.failed = True
        else:
            group = self.process_group.parent  # a new object whenever the quorum changed
            if group is not self._group:
                self.inner.rebind(_QuorumRoute(group, self._failure))
                self._group = group
            self.inner.route.failure = self._failure
        self.participants = self.manager.num_participants()
        self._check_enough_groups()
        self._kept = self._keep()

    def _check_enough_groups(self) -> None:
        """Refuse to retry for longer than the quorum timeout steps that cannot commit because fewer
        than ``min_replicas`` groups take part."""
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

    def should_commit(self) -> bool:
        """torchft's vote: True where every participant's exchange of this step succeeded (then
        take the optimizer step); False restores the roles' state as it was before the step."""
        if self._kept is None:
            raise RuntimeError("should_commit: no step was started (run the forward inside sync.forward_pass())")
        committed = self.manager.should_commit()
        if not committed:
            self._restore(self._kept)
            self.failed_steps += 1
        self._kept = None
        figures = {"participants": self.participants, "committed": float(committed), "failed_steps": self.failed_steps}
        self.inner.telemetry.last.extra.update(figures)  # beside the step's exchange figures: gc/participants, ...
        return committed

    def _keep(self) -> dict[str, Any]:
        """The roles' state and the step counter, copied on their device."""
        inner = self.inner
        per_element = inner.roles.state_by_parameter(inner.buckets)
        return {
            "step": inner.step,
            "per_element": {
                role: {name: {p: t.clone() for p, t in by_param.items()} for name, by_param in states.items()}
                for role, states in per_element.items()
            },
            "extra": copy.deepcopy(inner.compressor.extra_state()),
        }

    def _restore(self, kept: dict[str, Any]) -> None:
        inner = self.inner
        inner.step = kept["step"]
        inner.roles.clear_state()
        inner.roles.load_state_by_parameter(kept["per_element"], inner.buckets)
        inner.compressor.load_extra_state(kept["extra"])

    # ------------------------------------------------------------------ healing
    def _peer_state(self) -> dict[str, Any]:
        """What a healing group loads from this one: called by torchft between steps."""
        shared = {**self.inner.state_dict(), "memory": {}, "compressor": {}}  # per-rank state stays here
        return {
            "module": self.module.state_dict(),
            "healed": {name: obj.state_dict() for name, obj in self.healed.items()},
            "synchronizer": shared,
        }

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        for name, obj in self.healed.items():
            obj.load_state_dict(state["healed"][name])
        self.inner.roles.clear_state()  # this group's own error feedback starts at zero
        self.inner.load_state_dict(state["synchronizer"])

    # ------------------------------------------------------------------ the Synchronizer interface
    def before_forward(self) -> None:
        """The step's quorum before its first training forward; a forward without gradients
        (validation, Lightning's sanity check) takes no part in quorums."""
        if self._kept is None and torch.is_grad_enabled():
            self.start_step()
        self.inner.before_forward()

    def after_forward(self) -> None:
        self.inner.after_forward()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.inner.no_sync():
            yield

    votes_on_commit = True

    def use_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.share_state({f"optimizer_{i}": optimizer for i, optimizer in enumerate(optimizers)})

    def share_state(self, objects: dict[str, Any]) -> None:
        self.healed.update(objects)

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.inner.rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.inner.world_size

    @property
    def telemetry(self) -> TelemetryLog:  # type: ignore[override]
        return self.inner.telemetry

    @property
    def synchronizers(self) -> list[GradientSynchronizer]:
        """The synchroniser that runs the exchanges (as DiLoCo's, for reports of the buckets)."""
        return [self.inner]

    @property
    def committed_steps(self) -> int:
        """The steps committed so far across the groups (the same on every participant; a healed
        group takes its peer's): the step to read data for."""
        return self.manager.current_step()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Whether this group keeps state of its own (no collective: the groups are not all there)."""
        return bool(state["memory"] or state["compressor"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        """Leave the quorum (the others go on without this group) and remove the hooks."""
        self.inner.close()
        self.manager.shutdown(wait=False)
