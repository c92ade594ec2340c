"""DiLoCo over FSDP2 shards: inner steps sharded inside each node, no traffic across nodes between
outer steps, and each local shard's pseudo-gradient compressed across nodes.

On a 2-D mesh ``(N nodes, S ranks)`` the model is ``fully_shard``-ed over ``mesh["shard"]``, so an
inner step is FSDP2's own: the node's ranks all-gather parameters and reduce-scatter gradients
among themselves, and nothing crosses nodes. Every ``H`` inner steps (Douillard et al. 2023) each
rank takes the pseudo-gradient of its local shards, ``Δ_s = θ_s − θ_{s,n}``, through the memory,
the compressor and the communicator to the ranks holding the same shards on the other nodes (the
mesh's ``"replicate"`` dimension), and applies the outer optimizer to its outer shards ``θ_s``:

    Δ̄_s = (1/N) Σ_nodes D(C(Δ_{s,n} + e_{s,n}))       θ_s ← OuterOpt(θ_s, Δ̄_s)       θ_{s,n} ← θ_s

The outer state (``θ_s`` in fp32 and the outer optimizer's momentum) and the error feedback cover
this rank's shards: ``1/S`` of the model, in CPU memory with ``offload=True``. The local shards keep
their parameter shapes (row-shards of the matrices), so every compressor works on them, PowerSGD on
each row-shard as a matrix; 1-D tensors go apart as :class:`~gc_strategy.sync.modes.DiLoCo`'s
``vectors`` says. Streaming DiLoCo's fragments are not offered here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...bucket import Bucket
from ...communicators import RunningExchange
from ...components import Components
from ...registry import Configuration
from ...telemetry import StepTelemetry, TelemetryLog, add_exchange
from ..base import Synchronizer
from ..diloco.synchronizer import roles_by_dimension
from ..every_step.state import resharded
from ..paths.routes import FlatRoute, Route
from .synchronizer import check_shard_place, check_sharded_model, same_shard, shard_place


class _Group:
    """Parameters whose local shards one set of roles exchanges, as one bucket, along ``route``
    (the mesh's ``"replicate"`` dimension, or fault tolerance's quorum: :meth:`rebind`). ``step``:
    the outer steps its roles took part in."""

    def __init__(self, index: int, named: list[tuple[str, nn.Parameter]], roles: Components, route: Route) -> None:
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.roles, self.compressor = roles, roles.compressor
        shards = self.shards()
        self.bucket = Bucket(index, self.names, [s.shape for s in shards], torch.float32, shards[0].device)
        self.step = 0
        self.rebind(route)

    def shards(self) -> list[Tensor]:
        """This rank's local shards of the parameters (views of FSDP2's sharded storage)."""
        return [p.to_local() for p in self.params]

    def rebind(self, route: Route) -> None:
        """Exchange along ``route`` from the next outer step on, the roles bound to its group."""
        self.route = route
        self.roles.bind(route.group)
        self.compressor.check_group(route.group, [self.bucket])


class ShardedDiLoCo(Synchronizer):
    """DiLoCo as ``config`` says, over ``module`` already ``fully_shard``-ed over ``mesh["shard"]``
    (see the module's docstring). Call :meth:`after_optimizer_step` after every inner step."""

    def __init__(self, module: nn.Module, components: Components, config: Configuration, mesh: Any) -> None:
        fsdp = check_sharded_model(module, mesh)
        config.check_sharded()
        config.check(components)
        self.module = module
        self.config = config
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        group = mesh["replicate"].get_group()
        self.place = shard_place(mesh)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        local = {name: p.to_local() for name, p in named}
        for shard in local.values():  # every node starts from the same values: rank 0's of its shards
            dist.broadcast(shard.detach(), dist.get_global_rank(group, 0), group=group)
        outer_device = torch.device("cpu") if config.offload else next(iter(local.values())).device
        #: θ_s, this rank's outer shards in fp32
        self.outer = {name: local[name].detach().to(outer_device, torch.float32, copy=True) for name, _ in named}
        self.groups = []
        by_name = dict(named)
        for index, (names, roles) in enumerate(roles_by_dimension(named, components, config.vectors)):
            self.groups.append(_Group(index, [(n, by_name[n]) for n in names], roles, FlatRoute(group)))
        self.outer_optimizer = config.outer()(list(self.outer.values()))
        self.inner_step = 0
        #: outer steps taken
        self.step = 0
        self.telemetry = TelemetryLog()
        self._record, self._averages = StepTelemetry(), []
        for _, fsdp_module in fsdp:  # inner steps never cross nodes
            fsdp_module.set_all_reduce_hook(None)

    @property
    def inner_steps(self) -> int:
        return self.config.inner_steps

    @property
    def synchronizers(self) -> list[_Group]:
        """What exchanges: one set of roles per kind of tensor (fault tolerance rebinds and holds them)."""
        return self.groups

    def after_optimizer_step(self) -> None:
        """Count the inner step; every ``inner_steps``, the outer step."""
        self.inner_step += 1
        if self.due_fragment() is not None:
            self.start_outer()
            self.apply_outer()

    # ------------------------------------------------------------------ the outer exchange, driven from outside
    # Fault tolerance's rounds drive it as they drive a fragment's (here the only one, index 0).
    @property
    def overlap_steps(self) -> int:
        return 0

    def due_fragment(self) -> int | None:
        """0 where the outer exchange starts after the current inner step, else None."""
        return 0 if self.inner_step % self.config.inner_steps == 0 else None

    @torch.no_grad()
    def start_outer(self, index: int = 0) -> None:
        """Exchange every group's ``Δ_s`` and keep the averages until :meth:`apply_outer` or
        :meth:`drop_outer` (it ends here: nothing overlaps it)."""
        self._record = StepTelemetry()
        self._averages = []
        for group in self.groups:
            flat = torch.cat(
                [(self.outer[n].to(s.device) - s.float()).reshape(-1) for n, s in zip(group.names, group.shards())]
            )
            group.roles.begin_step(self.step)
            running = RunningExchange(group.route.exchange(flat, group.bucket, group.roles))
            average, _ = running.finish()
            add_exchange(self._record, group.bucket.nbytes, running)
            self._averages.append(average)

    def collect_outer(self, index: int = 0) -> None:
        """Nothing to wait for: :meth:`start_outer` ended the exchange."""

    @torch.no_grad()
    def apply_outer(self, index: int = 0, scale: float = 1.0) -> None:
        """The outer step on the averages of :meth:`start_outer`, each ``Δ̄_s`` times ``scale``
        first (fault tolerance: a mean over the participants made a mean over those that trained)."""
        for group, average in zip(self.groups, self._averages):
            for name, value in zip(group.names, group.bucket.views(average)):
                grad = value.to(self.outer[name].device)
                self.outer[name].grad = grad if scale == 1.0 else grad * scale
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for group in self.groups:
            for name, shard in zip(group.names, group.shards()):
                shard.copy_(self.outer[name])
        self.set_step(self.step + 1)
        self.telemetry.record(self._record)
        self.drop_outer()

    def set_step(self, step: int) -> None:
        """The outer steps taken, which every group's compressor reads as its step."""
        self.step = step
        for group in self.groups:
            group.step = step

    def drop_outer(self, index: int = 0) -> None:
        """Forget the averages of :meth:`start_outer` (an exchange that did not commit)."""
        self._averages = []

    def replicated_state(self) -> dict[str, Any]:
        """What the ranks holding this shard in every replica hold alike after an outer step (a
        healing one takes it from a peer): ``θ_s``, the outer optimizer, the counters and each
        group's compressor state beyond the per-element one."""
        return {
            "outer": self.outer,
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "compressors": [group.compressor.extra_state() for group in self.groups],
            "inner_step": self.inner_step,
            "step": self.step,
        }

    @torch.no_grad()
    def load_replicated_state(self, state: dict[str, Any]) -> None:
        """A peer's :meth:`replicated_state`; the local shards become ``θ_s``, and this rank's own
        error feedback starts at zero."""
        for name, value in state["outer"].items():
            self.outer[name].copy_(value)
        for group, extra in zip(self.groups, state["compressors"]):
            for name, shard in zip(group.names, group.shards()):
                shard.copy_(self.outer[name])
            group.roles.clear_state()
            group.compressor.load_extra_state(extra)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_step = int(state["inner_step"])
        self.set_step(int(state["step"]))

    def close(self) -> None:
        """Nothing is left in flight between outer steps."""

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's outer shards, outer optimizer, schedule and roles' state, on the CPU."""
        roles: dict[str, dict[str, dict[str, Any]]] = {}
        for group in self.groups:
            for kind, by_name in group.roles.state_by_parameter([group.bucket]).items():
                for name, tensors in by_name.items():
                    roles.setdefault(kind, {}).setdefault(name, {}).update({n: t.cpu() for n, t in tensors.items()})
        return {
            "format": "sharded-diloco-1",
            "shard": self.place,
            "inner_step": self.inner_step,
            "step": self.step,
            "outer": {n: t.cpu().clone() for n, t in self.outer.items()},
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "roles": roles,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_shard_place(state["shard"], self.place)
        self.inner_step = int(state["inner_step"])
        self.set_step(int(state["step"]))
        for name, value in state["outer"].items():
            self.outer[name].copy_(value)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for group in self.groups:
            group.roles.load_state_by_parameter(state["roles"], [group.bucket])

    def holds_rank_state(self, state: dict[str, Any]) -> bool:
        """Every rank keeps its own outer shards."""
        return True

    def load_states_of(self, states: Iterable[dict[str, Any]], world_size: int) -> None:
        """Start from a run on another number of nodes of as many ranks: the outer shards, the outer
        optimizer and the schedule of the first old node's rank that held this rank's shard (every
        node's are the same after an outer step), the roles' state the mean over the old nodes'
        (:func:`~gc_strategy.sync.every_step.state.resharded`)."""
        first: dict[str, Any] = {}

        def roles() -> Iterator[dict[str, Any]]:
            for state in same_shard(states, self.place):
                if not first:
                    first.update(state)
                yield {"memory": state["roles"].get("memory", {}), "compressor": state["roles"].get("compressor", {})}

        merged = resharded(roles())
        self.load_state_dict({**first, "shard": self.place, "roles": merged})
