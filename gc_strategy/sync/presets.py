"""Published configurations of the roles and the synchronisation, as keyword arguments for
``GCFusedStrategy``, ``GCFSDPStrategy`` and ``gc_strategy.integrations.accelerate.prepare``."""

from __future__ import annotations

from typing import Any

from .modes import DiLoCo

#: SparseLoCo's chunk and its entries kept per chunk (Sarfi et al. 2025: 64 of every 4096, 1.6%)
SPARSELOCO_CHUNK, SPARSELOCO_KEPT = 4096, 64


def sparseloco(
    inner_steps: int,
    density: float = SPARSELOCO_KEPT / SPARSELOCO_CHUNK,
    chunk: int = SPARSELOCO_CHUNK,
    value_bits: int = 2,
    beta: float = 0.95,
    outer_lr: float = 1.0,
    **diloco: Any,
) -> dict[str, Any]:
    """SparseLoCo (Sarfi et al. 2025, "Communication Efficient LLM Pre-training with SparseLoCo"):
    DiLoCo whose pseudo-gradients ``Δ`` travel as chunked top-k with ``value_bits``-bit values,
    with error feedback that decays by ``β`` in place of the outer momentum:

        e ← β e + Δ        c = Q(TopK_chunk(e))        e ← e − c        θ ← θ − α (1/N) Σ_nodes c

    (``Q``: :class:`~gc_strategy.algos.topk.TopK`'s ``value_bits``; the memory is ``residual``
    with ``beta``; the outer optimizer plain SGD at ``outer_lr = α``). Why: the error feedback
    already accumulates past pseudo-gradients, as the outer momentum would, and the payload is
    about ``density × (value_bits + 16)`` bits per element (2-byte in-chunk indices for chunks of
    up to 32768, and a 32-bit scale per chunk). ``diloco``: further :class:`~gc_strategy.sync.modes.DiLoCo` options
    (``vectors``, ``offload``)::

        GCFSDPStrategy(**sparseloco(inner_steps=30))
    """
    return {
        "sync": DiLoCo(inner_steps=inner_steps, outer_lr=outer_lr, outer_momentum=0.0, **diloco),
        "compressor": "topk",
        "density": density,
        "chunk": chunk,
        "value_bits": value_bits,
        "memory": "residual",
        "beta": beta,
    }
