"""Where the synchronisers meet the training frameworks: Lightning's strategies
(:mod:`~gc_strategy.integrations.lightning`, :mod:`~gc_strategy.integrations.lightning_fsdp` and
their shared :mod:`~gc_strategy.integrations.lightning_glue`), 🤗 Accelerate
(:mod:`~gc_strategy.integrations.accelerate`, entry point ``gc_strategy.accelerate``), the per-rank
checkpoint files, the app's throughput monitor and DDP's keyword arguments. They talk to the
:class:`~gc_strategy.sync.base.Synchronizer` interface and the sync modes alone."""
