"""Per-step measurements of the gradient synchroniser (docs/design.md, "Telemetry").

Times are wall-clock seconds from ``time.perf_counter`` on the host. On CUDA, encode/decode times
count the host time to issue the work (the side stream runs it asynchronously).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from torch import Tensor


@dataclass
class StepTelemetry:
    """What one synchronised backward did."""

    buckets: int = 0
    raw_bytes: int = 0
    #: payload bytes this rank put into collectives (with ``hierarchy="node"``: those across nodes)
    sent_bytes: int = 0
    #: ``hierarchy="node"``: bytes of the collectives inside the node (the reduce and the broadcast)
    node_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    #: sum over collectives of the time from issue to completion
    collective_s: float = 0.0
    #: time the end-of-backward flush spent waiting for collectives (communication not hidden)
    exposed_wait_s: float = 0.0
    #: buckets whose gradient held inf/NaN (their error-feedback memory was left unchanged); a 0-d
    #: tensor on the gradients' device, so that the step needs no host synchronisation (``int()``
    #: of it synchronises, e.g. when the metrics are logged)
    nonfinite_buckets: int | Tensor = 0
    collectives: int = 0
    #: method-specific measurements (e.g. achieved vs target density of a sparsifier): numbers, or 0-d
    #: tensors on the device that :meth:`as_metrics` reads when the metrics are logged
    extra: dict[str, float | Tensor] = field(default_factory=dict)

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.sent_bytes if self.sent_bytes else float("inf")

    def as_metrics(self, prefix: str = "gc/") -> dict[str, float]:
        values = {item.name: float(getattr(self, item.name)) for item in fields(self) if item.name != "extra"}
        values["compression_ratio"] = self.compression_ratio
        values.update({key: float(value) for key, value in self.extra.items()})  # a device counter is read here
        return {prefix + key: value for key, value in values.items()}


@dataclass
class TelemetryLog:
    """The last step and running totals over all synchronised steps."""

    last: StepTelemetry = field(default_factory=StepTelemetry)
    steps: int = 0
    total: StepTelemetry = field(default_factory=StepTelemetry)

    def record(self, step: StepTelemetry) -> None:
        self.last = step
        self.steps += 1
        add_into(self.total, step)


def add_into(total: StepTelemetry, step: StepTelemetry) -> None:
    """``total += step``, field by field (``extra`` is per step and left out)."""
    for item in fields(step):
        if item.name != "extra":
            setattr(total, item.name, getattr(total, item.name) + getattr(step, item.name))


def add_exchange(step: StepTelemetry, raw_bytes: int, running: Any) -> None:
    """Add one bucket's completed exchange (a :class:`~gc_strategy.communicators.RunningExchange`
    of ``raw_bytes`` of gradients) to the step's telemetry."""
    step.buckets += 1
    step.raw_bytes += raw_bytes
    step.encode_s += running.encode_s + running.between_s
    step.exposed_wait_s += running.wait_s
    step.decode_s += running.decode_s
    step.collective_s += running.collective_s
    step.sent_bytes += running.sent_bytes
    step.node_bytes += running.node_bytes
    step.collectives += running.collectives
