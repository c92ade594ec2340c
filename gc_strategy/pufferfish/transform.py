"""Turn a model into its Pufferfish low-rank ("hybrid") form, choosing the layers by role.

Which layers are factorised (docs/algorithms.md §7; Pufferfish, MLSys 2021, §3):

* Inside a recognised backbone, every convolution / linear / LSTM except the roles kept full-rank:
  - ResNet (torchvision layout: ``conv1``, ``layer1..4``, ``fc``): the stem ``conv1``, the first
    residual block ``layer1.0``, every shortcut ``downsample``, the classifier ``fc``;
  - BERT encoder (``embeddings``, ``encoder.layer``, ``pooler``): the embeddings, the first encoder
    layer ``encoder.layer.0`` and the pooler; in the others the Q/K/V and attention-output
    projections and both feed-forward matrices are factorised.
  Layers outside every recognised backbone (task heads such as BERT's masked-LM head) stay
  full-rank.
* A model with no recognised backbone (the LSTM language model, a VGG, your own): every such layer
  except the first convolution and the last linear layer (the classifier / decoder).
* ``keep_full_rank``: extra ``fnmatch`` patterns on module names (``"net.layer4.*"``). A pattern
  that matches no factorisable layer is an error: a typo must not silently change the model.

Rank of a layer: ``r = ⌊ratio · min(m, n)⌋`` (at least 1) of its ``m × n`` weight matrix (a conv's
weight as ``c_out × c_in·k·k``, an LSTM's gate matrices ``4H × d_in`` and ``4H × H``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

from torch import Tensor, nn

from ..registry import Option
from .layers import LOW_RANK_LAYERS, LowRankConv2d, LowRankLinear, LowRankLSTM


@dataclass(frozen=True)
class _Kind:
    """How one full-rank layer type becomes its low-rank type."""

    low_rank: type
    matrices: Callable[[Any], list[tuple[int, int]]]  # the (m, n) of each factorised matrix
    factor_keys: Callable[[Any], list[str]]  # state-dict keys of the V factors, one per matrix
    rank_argument: Callable[[list[int]], Any] = lambda ranks: ranks[0]  # from_full's rank argument


def _lstm_matrices(lstm: nn.LSTM) -> list[tuple[int, int]]:
    gates = 4 * lstm.hidden_size
    return [
        shape
        for layer in range(lstm.num_layers)
        for shape in ((gates, lstm.input_size if layer == 0 else lstm.hidden_size), (gates, lstm.hidden_size))
    ]


KINDS: dict[type, _Kind] = {
    nn.Linear: _Kind(LowRankLinear, lambda m: [(m.out_features, m.in_features)], lambda m: ["v.weight"]),
    nn.Conv2d: _Kind(LowRankConv2d, lambda m: [(m.out_channels, m.weight[0].numel())], lambda m: ["v.weight"]),
    nn.LSTM: _Kind(
        LowRankLSTM,
        _lstm_matrices,
        lambda m: [f"{kind}.{layer}.v.weight" for layer in range(m.num_layers) for kind in ("ih", "hh")],
        lambda ranks: list(zip(ranks[0::2], ranks[1::2])),
    ),
}


@dataclass(frozen=True)
class Backbone:
    """A model family recognised by its layout, with the roles it keeps full-rank (patterns on
    module names relative to the backbone)."""

    name: str
    detect: Callable[[nn.Module], bool]
    keep: tuple[str, ...]


BACKBONES = (
    Backbone(
        "ResNet",
        lambda m: all(hasattr(m, a) for a in ("conv1", "layer1", "layer2", "fc")),
        keep=("conv1", "layer1.0.*", "*.downsample.*", "fc"),
    ),
    Backbone(
        "BERT encoder",
        lambda m: hasattr(m, "embeddings") and hasattr(getattr(m, "encoder", None), "layer"),
        keep=("embeddings.*", "encoder.layer.0.*", "pooler.*"),
    ),
)


@dataclass
class Factorization:
    """What :func:`factorize` did: the ranks of each converted layer, the layers kept full-rank
    with the rule that kept each, and the parameter counts before and after."""

    ranks: dict[str, list[int]]
    kept: dict[str, str]
    params_before: int
    params_after: int

    def summary(self) -> str:
        lines = [
            f"Pufferfish: {len(self.ranks)} layers factorised, {len(self.kept)} kept full-rank; "
            f"parameters {self.params_before:,} -> {self.params_after:,} "
            f"({self.params_after / self.params_before:.1%})"
        ]
        lines += [f"  kept {name}: {reason}" for name, reason in self.kept.items()]
        return "\n".join(lines)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def rank_for(m: int, n: int, ratio: float) -> int:
    return max(1, math.floor(ratio * min(m, n) + 1e-9))


def _candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Factorisable layers by name, not counting the insides of layers already low-rank."""
    inside_low_rank = {name for name, m in model.named_modules() if isinstance(m, LOW_RANK_LAYERS)}
    return {
        name: m
        for name, m in model.named_modules()
        if type(m) in KINDS and not any(name.startswith(f"{owner}.") for owner in inside_low_rank)
    }


def select_layers(model: nn.Module, keep_full_rank: Iterable[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The names of the layers to factorise, and the factorisable layers kept full-rank with the
    rule that keeps each (see the module docstring)."""
    candidates = _candidates(model)
    kept: dict[str, str] = {}
    backbones = [(name, b) for name, m in model.named_modules() for b in BACKBONES if b.detect(m)]
    if backbones:
        for layer in candidates:
            owner = next(((prefix, b) for prefix, b in backbones if not prefix or layer.startswith(f"{prefix}.")), None)
            if owner is None:
                kept[layer] = "outside the recognised backbone (task heads stay full-rank)"
                continue
            prefix, backbone = owner
            relative = layer[len(prefix) + 1 :] if prefix else layer
            rule = next((p for p in backbone.keep if fnmatch(relative, p)), None)
            if rule is not None:
                kept[layer] = f"{backbone.name} role '{rule}'"
    else:
        convs = [n for n, m in candidates.items() if isinstance(m, nn.Conv2d)]
        linears = [n for n, m in candidates.items() if isinstance(m, nn.Linear)]
        if convs:
            kept[convs[0]] = "first convolution"
        if linears:
            kept[linears[-1]] = "last linear layer (classifier / decoder)"
    for name, m in candidates.items():
        if isinstance(m, nn.Conv2d) and m.groups != 1:
            kept.setdefault(name, f"grouped convolution (groups={m.groups})")
        if isinstance(m, nn.LSTM) and (m.bidirectional or m.proj_size):
            kept.setdefault(name, "bidirectional or projected LSTM")
    for pattern in keep_full_rank:
        matched = [name for name in candidates if fnmatch(name, pattern)]
        if not matched:
            raise ValueError(
                f"keep_full_rank pattern {pattern!r} matches no factorisable layer; "
                f"layer names look like: {', '.join(list(candidates)[:6])}"
            )
        for name in matched:
            kept.setdefault(name, f"keep_full_rank pattern '{pattern}'")
    return [name for name in candidates if name not in kept], kept


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)


def _convert(module: nn.Module, ranks: list[int], copy_weights: bool = True) -> nn.Module:
    kind = KINDS[type(module)]
    return kind.low_rank.from_full(module, kind.rank_argument(ranks), copy_weights).train(module.training)


#: the rank of each factorised layer, as a fraction of ``min(dims)``
RATIO = Option(0.25, float, low=0, high=1, low_open=True, help="rank = ratio x min(dims)")


def check_ratio(ratio: Any) -> float:
    return RATIO.validate("Pufferfish", "ratio", ratio)


def factorize(model: nn.Module, ratio: float = 0.25, keep_full_rank: Iterable[str] = ()) -> Factorization:
    """Replace, in place, every selected layer by its low-rank form initialised from the truncated
    SVD of its current weights; every other tensor is left as it is."""
    ratio = check_ratio(ratio)
    selected, kept = select_layers(model, keep_full_rank)
    before = count_parameters(model)
    modules = dict(model.named_modules())
    ranks = {}
    for name in selected:
        ranks[name] = [rank_for(m, n, ratio) for m, n in KINDS[type(modules[name])].matrices(modules[name])]
        _replace(model, name, _convert(modules[name], ranks[name]))
    return Factorization(ranks, kept, before, count_parameters(model))


def factorize_like(model: nn.Module, state_dict: Mapping[str, Tensor], prefix: str = "") -> list[str]:
    """Give ``model`` the low-rank structure of ``state_dict`` (saved after a conversion) so that it
    loads: each full-rank layer whose factors the state dict holds becomes low-rank with the ranks
    read from the factors' shapes. Returns the names of the converted layers."""
    converted = []
    for name, module in _candidates(model).items():
        keys = [f"{prefix}{name}.{key}" for key in KINDS[type(module)].factor_keys(module)]
        if keys[0] in state_dict:
            _replace(model, name, _convert(module, [state_dict[key].shape[0] for key in keys], copy_weights=False))
            converted.append(name)
    return converted


def _factorize_before_loading(module: nn.Module, state_dict: Mapping[str, Tensor], prefix: str, *_: Any) -> None:
    factorize_like(module, state_dict, prefix)


def enable_factorized_loading(model: nn.Module) -> None:
    """Make ``model.load_state_dict`` accept low-rank weights: a load-state-dict pre-hook converts
    the layers the state dict holds factors for (checkpoints saved after a Pufferfish conversion
    then load into a freshly built vanilla model). Idempotent."""
    if not getattr(model, "_gc_factorized_loading", False):
        model.register_load_state_dict_pre_hook(_factorize_before_loading)
        model._gc_factorized_loading = True
