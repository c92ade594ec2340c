"""Tools beside the runtime, which no runtime module imports: the advisor
(:mod:`~gc_strategy.tools.advise`, ``python -m gc_strategy.advise``), its measurements and plots,
the contention measurement, and the helper that forks gloo ranks."""
