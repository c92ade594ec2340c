"""Bad input is refused at construction, naming the option, the value and what is allowed."""

import re

import pytest

import gc_strategy
from gc_strategy import GCFusedStrategy, build_components


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(compressor="topkk"),
            "unknown compressor 'topkk' (did you mean 'topk'?); valid names: "
            + ", ".join(gc_strategy.COMPRESSORS.names()),
        ),
        (dict(compressor="topK"), "unknown compressor 'topK' (did you mean 'topk'?)"),
        (
            dict(memory="residul"),
            "unknown memory 'residul' (did you mean 'residual'?); valid names: "
            + ", ".join(gc_strategy.MEMORIES.names()),
        ),
        (dict(communicator="broadcast"), "unknown communicator 'broadcast'; valid names: allgather, allreduce"),
        (
            dict(memory="residual", beta=1.5),
            "memory 'residual': option 'beta' = 1.5 is invalid; allowed: a number in [0, 1]",
        ),
        (dict(memory="residual", gamma=0), "option 'gamma' = 0 is invalid; allowed: a number in (0, inf)"),
        (dict(memory="residual", beta="high"), "option 'beta' = 'high' is invalid"),
        (
            dict(memory="residual", betta=0.5),
            "option(s) betta are not taken by compressor=none, memory=residual (did you mean beta= for betta?); "
            "accepted options: beta, gamma",
        ),
        (
            dict(comm="allgather"),
            "option(s) comm are not taken by compressor=none, memory=none (did you mean communicator= for comm?); "
            "they take no options",
        ),
        (dict(compressor="fp16", xyz=1), "option(s) xyz are not taken by compressor=fp16, memory=none; they take no"),
        (dict(fusion="groups:0"), "fusion = 'groups:0' is invalid; allowed: 'layerwise', 'single', 'groups:N'"),
        (dict(fusion="groups:x"), "fusion = 'groups:x' is invalid"),
        (dict(fusion="bucket_mb:-1"), "fusion = 'bucket_mb:-1' is invalid"),
        (dict(fusion="auto-ish"), "fusion = 'auto-ish' is invalid"),
        (dict(fusion=3), "fusion = 3 is invalid"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError) as error:
        GCFusedStrategy(**kwargs)
    assert message in str(error.value)


def test_incompatible_communicator_is_refused():
    class Unsummable(gc_strategy.Compressor):
        summable = False
        name = "unsummable"

    with pytest.raises(
        ValueError, match="communicator 'allreduce' sums payloads element-wise, but compressor 'unsummable'"
    ):
        build_components(compressor=Unsummable(), communicator="allreduce")
    assert build_components(compressor=Unsummable()).communicator.name == "allgather"


@pytest.mark.parametrize("compressor", ["powersgd", "acpsgd"])
@pytest.mark.parametrize("memory", ["residual", "dgc"])
def test_a_second_error_feedback_loop_is_refused(compressor, memory):
    with pytest.raises(
        ValueError,
        match=f"compressor '{compressor}' keeps its own error feedback .* memory '{memory}' "
        "would stack a second loop on it; use memory='none', or use_error_feedback=False",
    ):
        GCFusedStrategy(compressor=compressor, memory=memory)
    # either loop alone is fine
    assert GCFusedStrategy(compressor=compressor).components.memory.name == "none"
    assert (
        GCFusedStrategy(compressor=compressor, memory=memory, use_error_feedback=False).components.memory.name == memory
    )


def test_auto_communicator_and_option_routing():
    components = build_components(compressor="fp16", memory="residual", beta=0.5, fusion="groups:3")
    assert components.communicator.name == "allreduce"
    assert components.memory.options == {"beta": 0.5, "gamma": 1.0}
    assert components.describe() == "compressor=fp16 memory=residual communicator=allreduce fusion=groups:3"


def test_log_every_n_steps_is_checked():
    message = "option 'log_every_n_steps' = 0 is invalid; allowed: an integer in [1, inf) or None"
    with pytest.raises(ValueError, match=re.escape(message)):
        GCFusedStrategy(log_every_n_steps=0)


def test_strategies_are_registered_by_name():
    from lightning.pytorch.strategies import StrategyRegistry

    for name, method in [("gc_fused", "popen"), ("gc_fused_spawn", "spawn"), ("gc_fused_fork", "fork")]:
        assert StrategyRegistry[name]["strategy"] is GCFusedStrategy
        assert StrategyRegistry[name]["init_params"]["start_method"] == method
