"""``GCFusedStrategy``: Lightning's DDP strategy with the gradient synchroniser instead of DDP.

Lightning glue only: process-group set-up, launchers and everything else stay DDPStrategy's. The
LightningModule runs unwrapped; a :class:`~gc_strategy.sync.base.Synchronizer` averages the
gradients, and each step's forward runs inside its :meth:`~gc_strategy.sync.base.Synchronizer.forward_pass`
(DDP's buffer broadcast). Each rank writes its own synchroniser state beside the checkpoint, which
holds a manifest under the key ``"gc_strategy"`` (:mod:`gc_strategy.integrations.checkpoint`). DDP's
keyword arguments are taken or refused as :mod:`gc_strategy.integrations.ddp_arguments` lists them.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from ..algos import Compressor, Memory
from ..communicators import Communicator
from ..components import Components, build_components
from ..fusion import FusionPlanner
from ..registry import Option, validate_options
from ..sync.base import Synchronizer
from ..sync.fault_tolerance.options import FaultTolerance
from ..sync.modes import Replicated, SyncMode, check_setup, parse_sync, refuse_misplaced_options
from ..sync.paths.hierarchy import NodeHierarchy, parse_hierarchy
from .ddp_arguments import NO_OPS, fusion_for, refuse_ddp_arguments
from .lightning_glue import LOG_EVERY, SynchronizerGlue, end_process_group_at_exit


class GCFusedStrategy(SynchronizerGlue, DDPStrategy):
    """Data-parallel training with compressed, fused gradient synchronisation.

    Args:
        compressor, memory, communicator, fusion: a registered name (with keyword ``options``) or an object;
            ``communicator="auto"`` picks allreduce for summable payloads and allgather otherwise; ``fusion``
            is ``"layerwise"``, ``"single"``, ``"groups:N"``, ``"bucket_mb:X"``, ``"auto"`` (``"auto:S"``),
            ``"file:PATH"`` or a planner (default :data:`~gc_strategy.components.DEFAULT_FUSION`, 25 MB buckets).
        sync: ``"every_step"`` (every optimizer step's gradients) or
            :class:`~gc_strategy.sync.modes.DiLoCo` (``DiLoCo(inner_steps=100, ...)``): local steps,
            then the compressed, error-corrected exchange of the pseudo-gradient and an outer step.
        fault_tolerance: a :class:`~gc_strategy.sync.fault_tolerance.quorum.FaultTolerance`: the Trainer's ranks
            are a replica group that goes on when others die and heals when it comes back (torchft;
            docs/fault_tolerance.md).
        hierarchy: ``"flat"`` (every rank exchanges with every rank), or ``"node"`` /
            :class:`~gc_strategy.sync.paths.hierarchy.NodeHierarchy` (``NodeHierarchy(precision="bf16")``): a
            dense reduction inside each node and compression only across nodes; the nodes are the
            Trainer's ``num_nodes`` of ``devices`` ranks each.
        log_every_n_steps: how often the ``gc/...`` telemetry goes to the Trainer's loggers
            (``None``: the Trainer's own ``log_every_n_steps``).
        find_unused_parameters, broadcast_buffers, bucket_cap_mb, and the rest: as for ``DDPStrategy``
            (``bucket_cap_mb=X`` is ``fusion="bucket_mb:X"``); ``gradient_as_bucket_view`` is taken
            and has no effect (gradients are always bucket views); DDP's other arguments are refused
            with what to use instead.
        **options: options of the chosen compressor / memory / communicator (e.g. ``beta=0.9``).
    """

    strategy_name = "gc_fused"
    #: the strategy's own options, beside the roles' and DDP's set-up arguments
    OPTIONS = {
        "find_unused_parameters": Option(False, bool),
        "broadcast_buffers": Option(True, bool),
        "log_every_n_steps": LOG_EVERY,
        "bucket_cap_mb": Option(None, float, low=0, low_open=True, optional=True),
    }

    def __init__(
        self,
        compressor: str | Compressor = "none",
        memory: str | Memory = "none",
        communicator: str | Communicator = "auto",
        fusion: str | FusionPlanner | None = None,
        sync: str | SyncMode = "every_step",
        hierarchy: str | NodeHierarchy = "flat",
        fault_tolerance: FaultTolerance | None = None,
        log_every_n_steps: int | None = None,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float | None = None,
        accelerator: Any = None,
        parallel_devices: list | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **options: Any,
    ) -> None:
        refuse_ddp_arguments(options)
        refuse_misplaced_options(options)
        for key in NO_OPS:
            options.pop(key, None)
        own = validate_options(
            "GCFusedStrategy",
            self.OPTIONS,
            dict(
                find_unused_parameters=find_unused_parameters,
                broadcast_buffers=broadcast_buffers,
                log_every_n_steps=log_every_n_steps,
                bucket_cap_mb=bucket_cap_mb,
            ),
        )
        self.find_unused_parameters = own["find_unused_parameters"]
        self.broadcast_buffers = own["broadcast_buffers"]
        self.log_every_n_steps = own["log_every_n_steps"]
        self.hierarchy = parse_hierarchy(hierarchy)
        self.components = build_components(
            compressor, memory, communicator, fusion_for(fusion, own["bucket_cap_mb"]), **options
        )
        self.sync = parse_sync(sync, self.components)
        self.fault_tolerance = fault_tolerance
        check_setup(self.sync, self.components, self.placement())
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.synchronizer: Synchronizer | None = None
        self._announced_plan: dict[str, Any] | None = None

    # ---------------------------------------------------------------- process group
    @override
    def _configure_launcher(self) -> None:
        """The Trainer's devices and nodes are known here, before any process starts: a replica
        group that fault tolerance cannot serve is refused now."""
        check_setup(self.sync, self.components, self.placement(), self.num_processes, self.num_nodes)
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        end_process_group_at_exit()

    # ---------------------------------------------------------------- model set-up
    def configure_ddp(self) -> None:
        """Install the gradient synchroniser on the unwrapped LightningModule (no DDP wrapper)."""
        self.synchronizer = self._synchronizer(self.components)
        self.load_pending_state()

    def switch_components(self, components: Components, broadcast_from_rank0: bool = False) -> None:
        """Synchronise with other roles from now on (e.g. an uncompressed baseline phase, or the
        parameters of a converted model). Call it on every rank between the same two steps; the new
        roles start with fresh state, cover the module's current parameters and record the gradient
        order again; ``broadcast_from_rank0`` first copies rank 0's parameters and buffers to all."""
        check_setup(self.sync, components, self.placement(), switches_roles=True)
        self.components = components
        if self.synchronizer is not None:
            self.synchronizer.close()
            self.synchronizer = self._synchronizer(components, broadcast_from_rank0)

    def placement(self, broadcast_from_rank0: bool = True) -> Replicated:
        """Where the model lives: replicated on every rank, with this strategy's options."""
        return Replicated(
            hierarchy=self.hierarchy or "flat",
            broadcast_buffers=self.broadcast_buffers,
            broadcast_from_rank0=broadcast_from_rank0,
            find_unused_parameters=self.find_unused_parameters,
            fault_tolerance=self.fault_tolerance,
        )

    def _synchronizer(self, c: Components, broadcast_from_rank0: bool = True) -> Synchronizer:
        placement = self.placement(broadcast_from_rank0)
        if self.hierarchy is not None:  # the Trainer's nodes
            launched = self.hierarchy.launched(self.num_processes, self.node_rank, self.local_rank)
            placement = replace(placement, hierarchy=launched)
        return self.sync.build(self.model, c, placement)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """With fault tolerance each rank of each replica group reads its own shard
        (:meth:`~gc_strategy.sync.fault_tolerance.options.FaultTolerance.shard`)."""
        if self.fault_tolerance is None:
            return super().distributed_sampler_kwargs
        rank, shards = self.fault_tolerance.shard(self.global_rank, self.world_size)
        return {"num_replicas": shards, "rank": rank}

    @override
    def teardown(self) -> None:
        self.close_synchronizer()
        super().teardown()

    # ---------------------------------------------------------------- registration
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("gc_fused", "popen"), ("gc_fused_spawn", "spawn"), ("gc_fused_fork", "fork")):
            for suffix, find_unused in (("", False), ("_find_unused_parameters_true", True)):
                if name + suffix not in strategy_registry:
                    strategy_registry.register(
                        name + suffix,
                        cls,
                        description=f"compressed fused gradient synchronisation, start_method '{start_method}'"
                        + (", find_unused_parameters=True" if find_unused else ""),
                        start_method=start_method,
                        find_unused_parameters=find_unused,
                    )
