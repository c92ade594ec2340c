"""``GCFSDPStrategy`` (``strategy="gc_fsdp"``): Lightning's ``ModelParallelStrategy`` with FSDP2
inside each node and compression across nodes (docs/sharded.md).

Lightning glue only. The device mesh is ``(num_nodes, devices)`` with the dimensions
``("replicate", "shard")``; the LightningModule's ``configure_model`` may call ``fully_shard`` on
``self.device_mesh["shard"]`` itself, and where it does not, the strategy shards by its policy:
every module of a class in ``shard_modules`` (by default every module that holds parameters of its
own), then each child of the LightningModule (:func:`shard_by_policy`). Each step's gradients are synchronised by a
:class:`~gc_strategy.sync.sharded.synchronizer.ShardedSynchronizer` (``sync="every_step"``), or the model by a
:class:`~gc_strategy.sync.sharded.diloco.ShardedDiLoCo` (``sync=DiLoCo(...)``). Gradient accumulation
reduces nothing until the step's last micro-batch (FSDP2's ``set_requires_gradient_sync``).
Checkpoints are ``ModelParallelStrategy``'s sharded ones (``torch.distributed.checkpoint``), with
each rank's compression state beside them (:mod:`gc_strategy.integrations.checkpoint`).
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.strategies.model_parallel import _materialize_distributed_module, _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from ..algos import Compressor, Memory
from ..communicators import Communicator
from ..components import build_components
from ..registry import validate_options
from ..sync.base import Synchronizer
from ..sync.fault_tolerance.options import FaultTolerance
from ..sync.modes import Sharded, SyncMode, check_setup, parse_sync, refuse_misplaced_options
from ..sync.sharded.synchronizer import MESH_DIMS, fsdp_modules, shard_by_policy
from .lightning_glue import LOG_EVERY, SynchronizerGlue, end_process_group_at_exit

START_METHODS = ("popen", "spawn", "fork")


class FullWeightsLauncher(_MultiProcessingLauncher):
    """Lightning's fork and spawn launcher, which hands rank 0's trained weights back to the main
    process: gathered whole from the shards, since a sharded state dict does not travel."""

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(trainer.lightning_module, options=options)  # a collective: every rank
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        path = None
        if trainer.state.fn == TrainerFn.FITTING:
            path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(weights, path)
        return _WorkerOutput(best, path, trainer.state, results, self.get_extra_results(trainer))


class GCFSDPStrategy(SynchronizerGlue, ModelParallelStrategy):
    """Sharded data-parallel training with compression across nodes (see the module's docstring).

    Args:
        compressor, memory, communicator: a registered name (with keyword ``options``) or an object;
            PowerSGD and ACP-SGD compress each parameter's row-shard as a matrix.
        sync: ``"every_step"`` or :class:`~gc_strategy.sync.modes.DiLoCo` (``fragments=1``,
            ``overlap_steps=0``).
        shard_modules: the module classes to shard where ``configure_model`` shards nothing
            (None: every module that holds parameters of its own).
        mixed_precision: FSDP2's ``MixedPrecisionPolicy`` for the modules the strategy shards
            (``param_dtype`` for forward and backward, ``reduce_dtype`` for the reductions and the
            shards the compressor receives); None: full precision.
        start_method: ``"popen"`` (as ``ModelParallelStrategy``), ``"spawn"`` or ``"fork"``.
        log_every_n_steps: how often the ``gc/...`` telemetry goes to the Trainer's loggers
            (``None``: the Trainer's own ``log_every_n_steps``).
        process_group_backend, timeout: as for ``ModelParallelStrategy``.
        fault_tolerance: a :class:`~gc_strategy.sync.fault_tolerance.options.FaultTolerance`: the
            Trainer's ranks (``num_nodes=1``) are a replica group that shards the model over them and
            goes on when other groups die (every step, or DiLoCo's outer steps; docs/fault_tolerance.md).
        **options: options of the chosen compressor / memory / communicator (e.g. ``density=0.01``).
            ``fusion`` and ``hierarchy``, ``find_unused_parameters`` and ``broadcast_buffers`` are
            ``gc_fused``'s and are refused here with what sharding does instead.
    """

    strategy_name = "gc_fsdp"

    def __init__(
        self,
        compressor: str | Compressor = "none",
        memory: str | Memory = "none",
        communicator: str | Communicator = "auto",
        sync: str | SyncMode = "every_step",
        shard_modules: tuple[type, ...] | None = None,
        mixed_precision: Any = None,
        start_method: str = "popen",
        log_every_n_steps: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        fault_tolerance: FaultTolerance | None = None,
        **options: Any,
    ) -> None:
        replicated = ("fusion", "hierarchy", "find_unused_parameters", "broadcast_buffers")
        given = {key: options.pop(key) for key in replicated if key in options}
        refuse_misplaced_options(options)
        if start_method not in START_METHODS:
            raise ValueError(f"start_method = {start_method!r} is invalid; allowed: {', '.join(START_METHODS)}")
        self.components = build_components(compressor, memory, communicator, **options)
        self.sync = parse_sync(sync, self.components)
        self.fault_tolerance = fault_tolerance
        check_setup(self.sync, self.components, self.placement(), replicated_options=given)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.shard_modules = shard_modules
        self.mixed_precision = mixed_precision
        self.start_method = start_method
        self.log_every_n_steps = validate_options(
            "GCFSDPStrategy", {"log_every_n_steps": LOG_EVERY}, {"log_every_n_steps": log_every_n_steps}
        )["log_every_n_steps"]
        self.synchronizer: Synchronizer | None = None

    def placement(self, mesh: Any = None) -> Sharded:
        """Where the model lives: sharded by FSDP2 over ``mesh``; with fault tolerance, a replica group."""
        return Sharded(mesh, self.fault_tolerance)

    @override
    def _configure_launcher(self) -> None:
        """The Trainer's devices and nodes are known here, before any process starts: a replica
        group that fault tolerance cannot serve is refused now."""
        check_setup(self.sync, self.components, self.placement(), self.num_processes, self.num_nodes)
        if self.start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = FullWeightsLauncher(self, start_method=self.start_method)

    @override
    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self._setup_distributed()
        end_process_group_at_exit()
        shape = (self.num_nodes, self.num_processes)
        self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=MESH_DIMS)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank reads its own data: the shards of a node hold one model, not one batch; with
        fault tolerance each rank of each replica group its own shard
        (:meth:`~gc_strategy.sync.fault_tolerance.options.FaultTolerance.shard`)."""
        if self.fault_tolerance is None:
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        rank, shards = self.fault_tolerance.shard(self.global_rank, self.world_size)
        return {"num_replicas": shards, "rank": rank}

    @override
    def setup(self, trainer: Any) -> None:
        """``ModelParallelStrategy.setup`` without its demand that ``configure_model`` shard the
        module (the policy shards what it leaves): Lightning has no hook in between, so its body is
        written again here, and ``tests/integrations/test_lightning_dependencies.py`` pins the Lightning code it
        follows."""
        self.accelerator.setup(trainer)
        if not fsdp_modules(self.model):
            self._shard()
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            self.synchronizer = self.sync.build(self.model, self.components.fresh(), self.placement(self.device_mesh))
            self.attach_optimizers(trainer)
            self.load_pending_state()

    def _shard(self) -> None:
        """Shard the model inside each node by the policy (:func:`shard_by_policy`)."""
        policy = {} if self.mixed_precision is None else {"mp_policy": self.mixed_precision}
        shard_by_policy(self.model, self.device_mesh["shard"], self.shard_modules, through_root=False, **policy)

    @override
    def teardown(self) -> None:
        self.close_synchronizer()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("gc_fsdp", "popen"), ("gc_fsdp_spawn", "spawn"), ("gc_fsdp_fork", "fork")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"FSDP2 inside each node, compression across nodes, start_method '{start_method}'",
                    start_method=start_method,
                )
