"""DDPStrategy's keyword arguments given to GCFusedStrategy: taken with DDP's meaning, taken as a
no-op, or refused with a message that speaks of DDP and says what to use instead."""

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from gc_strategy import GCFusedStrategy
from gc_strategy.integrations.ddp_arguments import REFUSED


def test_taken_arguments():
    strategy = GCFusedStrategy(
        find_unused_parameters=True, broadcast_buffers=False, bucket_cap_mb=5, gradient_as_bucket_view=True
    )
    assert strategy.find_unused_parameters is True and strategy.broadcast_buffers is False
    assert strategy.components.fusion.describe() == "bucket_mb:5"
    assert GCFusedStrategy().components.fusion.describe() == "bucket_mb:25"


def test_the_registered_find_unused_names_set_the_option():
    for name in ("gc_fused_find_unused_parameters_true", "gc_fused_fork_find_unused_parameters_true"):
        assert StrategyRegistry[name]["init_params"]["find_unused_parameters"] is True


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_arguments_name_ddp_and_the_alternative(name):
    with pytest.raises(ValueError, match=f"DistributedDataParallel's argument {name}=") as error:
        GCFusedStrategy(**{name: object()})
    assert REFUSED[name] in str(error.value)


def test_hooks_point_at_compressors():
    with pytest.raises(ValueError, match="compressor='powersgd'"):
        GCFusedStrategy(ddp_comm_hook=lambda state, bucket: bucket)
    with pytest.raises(ValueError, match="gradient order in the first step"):
        GCFusedStrategy(static_graph=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bucket_cap_mb=5, fusion="single"), "bucket_cap_mb=5 and fusion='single' both set the buckets"),
        (dict(bucket_cap_mb=0), "option 'bucket_cap_mb' = 0 is invalid; allowed: a number in (0, inf) or None"),
        (dict(find_unused_parameters="yes"), "'find_unused_parameters' = 'yes' is invalid; allowed: true or false"),
        (dict(broadcast_buffers=1), "option 'broadcast_buffers' = 1 is invalid; allowed: true or false"),
    ],
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GCFusedStrategy(**kwargs)
