"""Pufferfish factorisation (docs/algorithms.md §7): parameter counts, full-rank equivalence, best
rank-r approximation against torch.linalg.svd, role rules, bad options, loading low-rank weights."""

import pytest
import torch
from torch import nn

from gc_strategy.pufferfish import (
    LowRankConv2d,
    LowRankLinear,
    LowRankLSTM,
    PufferfishWarmup,
    count_parameters,
    enable_factorized_loading,
    factorize,
    select_layers,
)
from recipes.bert import BertMaskedLM
from recipes.lstm import LSTMLanguageModel
from recipes.resnet import build_resnet


def _matrices(module):
    """The weight matrices of a full-rank layer, reshaped as in docs/algorithms.md §7."""
    if isinstance(module, nn.LSTM):
        return [
            getattr(module, f"weight_{kind}_l{layer}") for layer in range(module.num_layers) for kind in ("ih", "hh")
        ]
    return [module.weight.reshape(module.weight.shape[0], -1)]


def _products(module):
    """U V of each factor pair of a low-rank layer, in the same order."""
    pairs = (
        [module]
        if not isinstance(module, LowRankLSTM)
        else [p for layer in range(module.num_layers) for p in (module.ih[layer], module.hh[layer])]
    )
    return [p.u.weight.reshape(p.u.weight.shape[0], -1) @ p.v.weight.reshape(p.v.weight.shape[0], -1) for p in pairs]


def test_cifar_resnet18_parameter_count():
    """11,173,962 -> 3,336,266. Kept full-rank: the 3x3 stem (1,728), layer1.0 (2 x 36,864), the
    three 1x1 shortcuts and fc. Every other 3x3 conv c_in -> c_out becomes r (9 c_in + c_out) with
    r = c_out / 4 (the matrix is c_out x 9 c_in, and c_out is the smaller side)."""
    model = build_resnet("resnet18", 10, cifar_stem=True)
    report = factorize(model, ratio=0.25)
    convs = [(64, 64)] * 2  # layer1.1
    for c_in, c_out in ((64, 128), (128, 256), (256, 512)):  # layer2..4: first conv of the stage, then 3 c_out->c_out
        convs += [(c_in, c_out)] + [(c_out, c_out)] * 3
    factorised = sum((c_out // 4) * (9 * c_in + c_out) for c_in, c_out in convs)
    full = sum(9 * c_in * c_out for c_in, c_out in convs)
    assert report.params_before == count_parameters(build_resnet("resnet18", 10, cifar_stem=True)) == 11_173_962
    assert report.params_after == report.params_before - full + factorised == 3_336_266
    assert set(report.kept) == {
        "conv1",
        "layer1.0.conv1",
        "layer1.0.conv2",
        "fc",
        "layer2.0.downsample.0",
        "layer3.0.downsample.0",
        "layer4.0.downsample.0",
    }


@pytest.mark.parametrize("name", ["lstm", "bert"])
def test_parameter_counts_follow_the_ranks(name):
    """params after = before - sum(m n) + sum(r (m + n)) over the factorised matrices."""
    model = LSTMLanguageModel(vocab_size=500) if name == "lstm" else BertMaskedLM(vocab_size=500, max_length=32)
    originals = {n: m for n, m in model.named_modules()}
    report = factorize(model, ratio=0.25)
    expected = report.params_before
    for layer, ranks in report.ranks.items():
        for matrix, r in zip(_matrices(originals[layer]), ranks):
            m, n = matrix.shape
            assert r == min(m, n) // 4
            expected += r * (m + n) - m * n
    assert report.params_after == expected == count_parameters(model) < report.params_before
    print(f"{name}: {report.params_before:,} -> {report.params_after:,} parameters")


def _inputs(name):
    g = torch.Generator().manual_seed(1)
    if name == "resnet18":
        return build_resnet("resnet18", 10, cifar_stem=True), torch.randn(4, 3, 32, 32, generator=g)
    if name == "lstm":
        return LSTMLanguageModel(vocab_size=300, layers=2), torch.randint(0, 300, (3, 9), generator=g)
    return BertMaskedLM(vocab_size=300, max_length=32), torch.randint(0, 300, (2, 12), generator=g)


def _forward(model, x):
    with torch.no_grad():
        return model.bert(input_ids=x).logits if isinstance(model, BertMaskedLM) else model(x)


@pytest.mark.parametrize("name", ["resnet18", "lstm", "bert"])
def test_full_rank_conversion_reproduces_the_model(name):
    model, x = _inputs(name)
    model.eval()
    reference = _forward(model, x)
    report = factorize(model, ratio=1.0)
    assert report.ranks
    torch.testing.assert_close(_forward(model, x), reference, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("name", ["resnet18", "lstm", "bert"])
def test_quarter_rank_is_the_best_rank_r_approximation(name):
    model, _ = _inputs(name)
    originals = {n: m for n, m in model.named_modules()}
    report = factorize(model, ratio=0.25)
    converted = dict(model.named_modules())
    for layer, ranks in report.ranks.items():
        for matrix, product, r in zip(_matrices(originals[layer]), _products(converted[layer]), ranks):
            u, s, vh = torch.linalg.svd(matrix.detach().double(), full_matrices=False)
            best = (u[:, :r] * s[:r]) @ vh[:r]
            torch.testing.assert_close(product.detach().double(), best, rtol=0, atol=1e-5 * s[0].item())
            # Eckart-Young: the error is the energy of the dropped singular values
            error = torch.linalg.matrix_norm(matrix.detach().double() - product.detach().double())
            assert error == pytest.approx(s[r:].pow(2).sum().sqrt().item(), rel=1e-4)


def test_role_rules():
    bert = BertMaskedLM(vocab_size=100, max_length=16)
    selected, kept = select_layers(bert)
    assert all(".encoder.layer.1." in name for name in selected) and len(selected) == 6  # tiny BERT: 2 layers
    assert {n for n in kept if "encoder.layer.0." in n} and {n for n in kept if n.startswith("bert.cls.")}
    lstm = LSTMLanguageModel(vocab_size=100)
    assert select_layers(lstm) == (["lstm"], {"decoder": "last linear layer (classifier / decoder)"})
    grouped = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 8, 3, groups=4), nn.Conv2d(8, 8, 3), nn.Linear(8, 2))
    selected, kept = select_layers(grouped)
    assert selected == ["2"] and set(kept) == {"0", "1", "3"}
    resnet = build_resnet("resnet18", 10, cifar_stem=False)
    selected, kept = select_layers(resnet, keep_full_rank=["layer4.*"])
    assert not [n for n in selected if n.startswith("layer4")] and "layer4.1.conv2" in kept


def test_bad_options_are_refused():
    model = LSTMLanguageModel(vocab_size=50)
    for ratio in (0, 1.5, -0.25, True, "half"):
        with pytest.raises(ValueError, match="ratio"):
            factorize(model, ratio=ratio)
    with pytest.raises(ValueError, match="keep_full_rank pattern 'lstn' matches no factorisable layer"):
        factorize(model, keep_full_rank=["lstn"])
    assert isinstance(model.lstm, nn.LSTM)  # nothing was converted
    with pytest.raises(ValueError, match=r"'warmup_epochs' = -1 is invalid; allowed: an integer in \[0, inf\) or None"):
        PufferfishWarmup(warmup_epochs=-1)
    with pytest.raises(ValueError, match="exactly one of warmup_epochs and warmup_steps"):
        PufferfishWarmup()
    with pytest.raises(ValueError, match="exactly one of warmup_epochs and warmup_steps"):
        PufferfishWarmup(warmup_epochs=1, warmup_steps=10)
    with pytest.raises(ValueError, match="Pufferfish: option 'ratio' = 2 is invalid"):
        PufferfishWarmup(ratio=2, warmup_steps=1)
    with pytest.raises(ValueError, match="unknown compressor 'powersdg'"):
        PufferfishWarmup(warmup_steps=1, after_warmup={"compressor": "powersdg"})


def test_low_rank_weights_load_into_a_vanilla_model():
    model, x = _inputs("resnet18")
    model.eval()
    factorize(model, ratio=0.25)
    state = model.state_dict()
    fresh = build_resnet("resnet18", 10, cifar_stem=True).eval()
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict(state)
    enable_factorized_loading(fresh)
    fresh.load_state_dict(state)
    assert isinstance(fresh.layer2[0].conv1, LowRankConv2d)
    torch.testing.assert_close(_forward(fresh, x), _forward(model, x), rtol=0, atol=0)


def test_low_rank_layers_match_their_products():
    """Each layer computes exactly (U V) applied to its input."""
    g = torch.Generator().manual_seed(0)
    linear = LowRankLinear.from_full(nn.Linear(12, 7), rank=3)
    x = torch.randn(5, 12, generator=g)
    torch.testing.assert_close(linear(x), x @ _products(linear)[0].T + linear.u.bias)
    conv = nn.Conv2d(3, 6, 3, padding=1, stride=2)
    low = LowRankConv2d.from_full(conv, rank=2)
    image = torch.randn(2, 3, 9, 9, generator=g)
    expected = nn.functional.conv2d(
        image, _products(low)[0].reshape(conv.weight.shape), low.u.bias, stride=2, padding=1
    )
    torch.testing.assert_close(low(image), expected, rtol=1e-5, atol=1e-5)
