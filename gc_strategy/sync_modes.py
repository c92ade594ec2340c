"""``sync=``: when the replicas synchronise, as small validated configuration objects.

:class:`EveryStep` averages every optimizer step's gradients (the default); :class:`DiLoCo`
runs ``inner_steps`` local steps, then a compressed outer step (:mod:`gc_strategy.diloco`). Their
options, defaults and ranges are declared once, in ``OPTIONS``, and checked as a role's options
are, before any work, with a message that names the option, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from .components import Components
from .fusion.plans import AutoPlanner, FilePlanner
from .hierarchy import NodeHierarchy, hierarchy_of
from .registry import Configuration, Option

VECTOR_POLICIES = ("bf16", "fp32", "compressed")


def nesterov_sgd(lr: float = 0.7, momentum: float = 0.9) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD where ``momentum`` is 0)."""
    return partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=momentum > 0)


class EveryStep(Configuration):
    """Average the gradients of every optimizer step (``sync="every_step"``)."""

    def check(self, components: Components) -> None:
        """Every combination of roles synchronises every step."""


class DiLoCo(Configuration):
    """``inner_steps`` local optimizer steps, then the compressed, error-corrected exchange of the
    pseudo-gradient and an outer step (Douillard et al. 2023; Streaming DiLoCo, Douillard et al.
    2025: ``fragments``, ``overlap_steps``, ``mixing``). ``outer_optimizer`` builds the outer
    optimizer from a list of tensors; by default SGD with Nesterov momentum at ``outer_lr`` and
    ``outer_momentum``. ``vectors``: how 1-D tensors are sent. ``offload``: the outer state in CPU
    memory. docs/diloco.md has each option's meaning."""

    OPTIONS = {
        "inner_steps": Option(None, int, low=1, help="the local optimizer steps between outer steps, e.g. 100"),
        "outer_lr": Option(0.7, float, low=0, low_open=True),
        "outer_momentum": Option(0.9, float, low=0, high=1, high_open=True),
        "outer_optimizer": Option(None, callable, optional=True),
        "fragments": Option(1, int, low=1, choices=("auto",)),
        "overlap_steps": Option(0, int, low=0),
        "mixing": Option(0.5, float, low=0, high=1),
        "vectors": Option("bf16", str, choices=VECTOR_POLICIES),
        "offload": Option(False, bool),
    }

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        inner, overlap, fragments = self.inner_steps, self.overlap_steps, self.fragments
        if fragments == "auto" and overlap < 1:
            raise ValueError(
                "DiLoCo: fragments = 'auto' sizes the fragments to hide each exchange behind overlap_steps inner "
                f"steps; option 'overlap_steps' = {overlap} is invalid with it; allowed: 1 to {inner - 1}"
            )
        if fragments != "auto" and fragments > inner:
            raise ValueError(
                f"DiLoCo: option 'fragments' = {fragments} is invalid with inner_steps = {inner}; allowed: 1 to "
                "inner_steps (each fragment is exchanged at its own inner step)"
            )
        if overlap >= inner:
            raise ValueError(
                f"DiLoCo: option 'overlap_steps' = {overlap} is invalid with inner_steps = {inner}; allowed: 0 to "
                f"{inner - 1} (a fragment's exchange must end before its next one starts)"
            )

    def outer(self) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
        """What builds the outer optimizer."""
        return self.outer_optimizer or nesterov_sgd(self.outer_lr, self.outer_momentum)

    def check(self, components: Components) -> None:
        """Refuse roles that cannot serve the outer exchange, before any work."""
        compressor, memory = components.compressor, components.memory
        if compressor.applies_momentum or memory.applies_momentum:
            role = f"compressor '{compressor.name}'" if compressor.applies_momentum else f"memory '{memory.name}'"
            raise ValueError(
                f"sync=DiLoCo with {role}: it applies momentum to each step's gradient, and the outer optimizer "
                "already applies momentum to the pseudo-gradient; use a compressor and memory without momentum"
            )
        if compressor.per_step_schedule:
            raise ValueError(
                f"sync=DiLoCo with compressor '{compressor.name}': it alternates its payloads step by step and "
                "needs consecutive steps' gradients; use e.g. 'powersgd', 'topk' or 'qsgd' for the outer exchange"
            )
        if isinstance(components.fusion, (AutoPlanner, FilePlanner)):
            raise ValueError(
                f"sync=DiLoCo with fusion={components.fusion.describe()!r}: automatic and file plans are made for "
                "the backward's gradients of the whole model; use a fixed plan (e.g. fusion='bucket_mb:25')"
            )


#: the forms ``sync=`` takes
SYNC_FORMS = "'every_step', EveryStep(), or DiLoCo(inner_steps=..., ...)"


def parse_sync(sync: Any, components: Components) -> EveryStep | DiLoCo:
    """``sync=`` as a configuration object, checked against ``components``."""
    if sync == "every_step":
        sync = EveryStep()
    elif sync == "diloco":
        raise ValueError(
            "sync = 'diloco' needs its options; allowed: sync=DiLoCo(inner_steps=..., ...) "
            "(from gc_strategy import DiLoCo)"
        )
    elif not isinstance(sync, (EveryStep, DiLoCo)):
        raise ValueError(f"sync = {sync!r} is invalid; allowed: {SYNC_FORMS}")
    sync.check(components)
    return sync


#: the names of the sync modes in a flat command-line configuration
SYNC_MODES = {"every_step": EveryStep, "diloco": DiLoCo}


def sync_of(name: str, options: dict[str, Any]) -> EveryStep | DiLoCo:
    """The sync mode of a flat command-line configuration (``sync=diloco,inner_steps=20``: the
    app's and the benchmarks')."""
    if name not in SYNC_MODES:
        raise ValueError(f"sync = {name!r} is invalid; allowed: {', '.join(map(repr, SYNC_MODES))}")
    return SYNC_MODES[name](**options)


def from_command_line(options: dict[str, Any]) -> dict[str, Any]:
    """A flat command-line configuration (``compressor=topk,sync=diloco,inner_steps=5,hierarchy=node,
    node_precision=bf16``: the benchmarks' form) as keyword arguments of the strategy: DiLoCo's and
    the hierarchy's options gathered into ``sync=`` and ``hierarchy=`` objects."""
    rest = {key: value for key, value in options.items() if key not in DiLoCo.OPTIONS}
    sync = rest.pop("sync", "every_step")
    hierarchy = hierarchy_of(rest.pop("hierarchy", "flat"), rest.pop("node_precision", "full"))
    mode = sync_of(sync, {key: value for key, value in options.items() if key in DiLoCo.OPTIONS})
    return {**rest, "sync": mode, "hierarchy": hierarchy or "flat"}


def refuse_misplaced_options(options: dict[str, Any]) -> None:
    """Refuse an option of DiLoCo's or of the hierarchy's given beside the roles' options, saying
    where it goes."""
    for key in options:
        if key in DiLoCo.OPTIONS:
            raise ValueError(f"{key} is an option of DiLoCo; pass sync=DiLoCo({key}={options[key]!r}, ...)")
        if key == "node_precision" or key in NodeHierarchy.OPTIONS:
            name = "precision" if key == "node_precision" else key
            raise ValueError(
                f"{key} is an option of the hierarchy; pass hierarchy=NodeHierarchy({name}={options[key]!r})"
            )
