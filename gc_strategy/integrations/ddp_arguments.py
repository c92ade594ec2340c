"""``DistributedDataParallel``'s keyword arguments as :class:`~gc_strategy.integrations.lightning.GCFusedStrategy`
takes them, so that a ``DDPStrategy(...)`` call can be migrated by changing the class name.

Each DDP argument is either taken with the meaning it has for DDP (``find_unused_parameters``,
``broadcast_buffers``, ``bucket_cap_mb``), taken as a no-op (``gradient_as_bucket_view``: the
gradients are always views of the buckets) or refused with what to use instead.
"""

from __future__ import annotations

from typing import Any

from ..components import DEFAULT_FUSION

_HOOKS = (
    "gc_fused has no DDP communication hooks: choose a compressor instead (fp16_compress_hook -> "
    "compressor='fp16', bf16_compress_hook -> compressor='bf16', powerSGD_hook -> compressor='powersgd' "
    "with rank=... and start_iter=...)"
)

#: DDP arguments gc_fused refuses, and what to use instead
REFUSED = {
    "static_graph": "it is an optimisation of DDP's reducer for a graph that never changes; gc_fused records the "
    "gradient order in the first step by itself, so drop the argument",
    "ddp_comm_hook": _HOOKS,
    "ddp_comm_state": _HOOKS,
    "ddp_comm_wrapper": _HOOKS,
    "model_averaging_period": "post-local SGD model averaging is DDP's; gc_fused averages gradients every step",
    "process_group": "gc_fused synchronises over the process group Lightning sets up",
    "mixed_precision": "it is DDP's own mixed precision; use Trainer(precision='bf16-mixed'), or send the gradients "
    "in low precision with compressor='bf16' or 'fp16'",
    "delay_all_reduce_named_params": "gc_fused launches each bucket as soon as its gradients are ready",
    "param_to_hook_all_reduce": "gc_fused launches each bucket as soon as its gradients are ready",
    "skip_all_reduce_unused_params": "use find_unused_parameters=True: parameters no rank used keep their .grad",
    "init_sync": "gc_fused always broadcasts rank 0's parameters and buffers at set-up",
    "check_reduction": "DDP has deprecated it; drop the argument",
    "device_ids": "Lightning sets the device of each rank",
    "output_device": "Lightning sets the device of each rank",
    "dim": "gc_fused leaves the module unwrapped and never scatters inputs",
}

#: DDP arguments gc_fused takes as no-ops, and why
NO_OPS = {
    "gradient_as_bucket_view": "each .grad is always a view of its averaged bucket",
}


def refuse_ddp_arguments(options: dict[str, Any]) -> None:
    """Raise ``ValueError`` for the first of ``options`` that is a refused DDP argument."""
    for key in options:
        if key in REFUSED:
            raise ValueError(
                f"GCFusedStrategy does not take DistributedDataParallel's argument {key}={options[key]!r}: "
                f"{REFUSED[key]}"
            )


def fusion_for(fusion: Any, bucket_cap_mb: float | None) -> Any:
    """The fusion plan from ``fusion`` and DDP's ``bucket_cap_mb`` (``None``: not given)."""
    if bucket_cap_mb is None:
        return DEFAULT_FUSION if fusion is None else fusion
    if fusion is not None:
        raise ValueError(
            f"bucket_cap_mb={bucket_cap_mb:g} and fusion={fusion!r} both set the buckets; give one "
            "(bucket_cap_mb=X is fusion='bucket_mb:X')"
        )
    return f"bucket_mb:{bucket_cap_mb:g}"
