"""``sync=`` and DiLoCo's options: their defaults, written once, and the checks that refuse a bad
configuration before any work, naming the option, the value and what is allowed."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from .components import Components
from .fusion.plans import AutoPlan, FilePlan

SYNC_MODES = ("every_step", "diloco")
VECTOR_POLICIES = ("bf16", "fp32", "compressed")


def nesterov_sgd(lr: float = 0.7, momentum: float = 0.9) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD where ``momentum`` is 0)."""
    return partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=momentum > 0)


def check_diloco_options(
    components: Components,
    inner_steps: Any,
    fragments: Any = 1,
    overlap_steps: Any = 0,
    mixing: Any = 0.5,
    vectors: Any = "bf16",
) -> None:
    """Refuse a bad DiLoCo configuration before any work, naming the option."""

    def whole(name: str, value: Any, low: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} = {value!r} is invalid; allowed: an integer >= {low}")

    whole("inner_steps", inner_steps, 1)
    whole("overlap_steps", overlap_steps, 0)
    if fragments == "auto":
        if overlap_steps < 1:
            raise ValueError(
                "fragments = 'auto' sizes the fragments to hide each exchange behind overlap_steps inner steps; "
                f"overlap_steps = {overlap_steps} is invalid with it; allowed: 1 to {inner_steps - 1}"
            )
    elif not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
        raise ValueError(f"fragments = {fragments!r} is invalid; allowed: an integer >= 1, or 'auto'")
    elif fragments > inner_steps:
        raise ValueError(
            f"fragments = {fragments} is invalid with inner_steps = {inner_steps}; allowed: 1 to inner_steps "
            "(each fragment is exchanged at its own inner step)"
        )
    if overlap_steps >= inner_steps:
        raise ValueError(
            f"overlap_steps = {overlap_steps} is invalid with inner_steps = {inner_steps}; allowed: 0 to "
            f"{inner_steps - 1} (a fragment's exchange must end before its next one starts)"
        )
    if isinstance(mixing, bool) or not isinstance(mixing, (int, float)) or not 0.0 <= mixing <= 1.0:
        raise ValueError(f"mixing = {mixing!r} is invalid; allowed: a number in [0, 1]")
    if vectors not in VECTOR_POLICIES:
        raise ValueError(f"vectors = {vectors!r} is invalid; allowed: {', '.join(map(repr, VECTOR_POLICIES))}")
    compressor, memory = components.compressor, components.memory
    if compressor.applies_momentum or memory.applies_momentum:
        role = f"compressor '{compressor.name}'" if compressor.applies_momentum else f"memory '{memory.name}'"
        raise ValueError(
            f"sync='diloco' with {role}: it applies momentum to each step's gradient, and the outer optimizer "
            "already applies momentum to the pseudo-gradient; use a compressor and memory without momentum"
        )
    if compressor.per_step_schedule:
        raise ValueError(
            f"sync='diloco' with compressor '{compressor.name}': it alternates its payloads step by step and "
            "needs consecutive steps' gradients; use e.g. 'powersgd', 'topk' or 'qsgd' for the outer exchange"
        )
    if isinstance(components.fusion, (AutoPlan, FilePlan)):
        raise ValueError(
            f"sync='diloco' with fusion={components.fusion.describe()!r}: automatic and file plans are made for "
            "the backward's gradients of the whole model; use a fixed plan (e.g. fusion='bucket_mb:25')"
        )


#: DiLoCo's options and their defaults (``inner_steps`` has none: it must be given)
DILOCO_DEFAULTS: dict[str, Any] = dict(
    inner_steps=None,
    outer_lr=0.7,
    outer_momentum=0.9,
    outer_optimizer=None,
    fragments=1,
    overlap_steps=0,
    mixing=0.5,
    vectors="bf16",
    offload=False,
)


def diloco_options(components: Components, sync: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """Check ``sync`` and DiLoCo's ``options`` (the keys of :data:`DILOCO_DEFAULTS`) before any work;
    the keyword arguments of :class:`DiLoCo` for ``sync="diloco"``, None for ``"every_step"``."""
    if sync not in SYNC_MODES:
        raise ValueError(f"sync = {sync!r} is invalid; allowed: {', '.join(map(repr, SYNC_MODES))}")
    if sync == "every_step":
        changed = sorted(key for key, value in options.items() if value != DILOCO_DEFAULTS[key])
        if changed:
            raise ValueError(f"{', '.join(changed)}: option(s) of sync='diloco', but sync = 'every_step'")
        return None
    if options["inner_steps"] is None:
        raise ValueError("sync='diloco' needs inner_steps (the local optimizer steps between outer steps), e.g. 100")
    lr, momentum = options["outer_lr"], options["outer_momentum"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"outer_lr = {lr!r} is invalid; allowed: a number > 0")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"outer_momentum = {momentum!r} is invalid; allowed: a number in [0, 1)")
    if options["outer_optimizer"] is not None and not callable(options["outer_optimizer"]):
        raise ValueError(
            f"outer_optimizer = {options['outer_optimizer']!r} is invalid; allowed: None or a callable that "
            "builds an optimizer from a list of tensors"
        )
    if not isinstance(options["offload"], bool):
        raise ValueError(f"offload = {options['offload']!r} is invalid; allowed: True or False")
    kept = {key: options[key] for key in ("inner_steps", "fragments", "overlap_steps", "mixing", "vectors")}
    check_diloco_options(components, **kept)
    return {
        **kept,
        "offload": options["offload"],
        "outer_optimizer": options["outer_optimizer"] or nesterov_sgd(float(lr), float(momentum)),
    }
