"""How the replicas synchronise: the :class:`~gc_strategy.sync.base.Synchronizer` interface
(:mod:`~gc_strategy.sync.base`), the sync modes that check a setup and build a synchroniser
(:mod:`~gc_strategy.sync.modes`), and the families of synchronisers, a folder each, lowest first
(:data:`FAMILIES`): the paths a bucket takes across ranks (``paths/``: flat, through the nodes,
collectives, the exchange profiler), every step (``every_step/``: the synchroniser, its bucket
layout, usage, state, rollback point and fusion tuner), DiLoCo (``diloco/``), FSDP2's shards
(``sharded/``) and fault tolerance across replica groups (``fault_tolerance/``). A family imports
the interface and the families before it, never one after it; the modes import them all. It builds
on the roles and their registries (the package's top level, ``algos/``, ``kernels/``, ``fusion/``)
and imports no integration."""

#: the families of synchronisers, each a folder of this package, lowest first
FAMILIES = ("paths", "every_step", "diloco", "sharded", "fault_tolerance")
