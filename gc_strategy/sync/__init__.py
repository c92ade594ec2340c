"""How the replicas synchronise: the :class:`~gc_strategy.sync.base.Synchronizer` interface, the sync
modes that build one (:mod:`gc_strategy.sync.modes`), and each synchroniser with its parts: every
step (:mod:`~gc_strategy.sync.every_step`, its bucket :mod:`~gc_strategy.sync.layout`,
:mod:`~gc_strategy.sync.usage`, :mod:`~gc_strategy.sync.state`, :mod:`~gc_strategy.sync.autotune`,
:mod:`~gc_strategy.sync.profiler`), the paths across ranks (:mod:`~gc_strategy.sync.routes`,
:mod:`~gc_strategy.sync.hierarchy`, :mod:`~gc_strategy.sync.collectives`), DiLoCo
(:mod:`~gc_strategy.sync.diloco`, :mod:`~gc_strategy.sync.presets`) and FSDP2's shards
(:mod:`~gc_strategy.sync.sharded`, :mod:`~gc_strategy.sync.sharded_layout`,
:mod:`~gc_strategy.sync.sharded_diloco`). It builds on the roles and their registries (the package's
top level, ``algos/``, ``kernels/``, ``fusion/``) and imports no integration."""
