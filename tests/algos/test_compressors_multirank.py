"""Every compressor through the synchroniser on 2 and 3 gloo ranks: the synchronised gradient equals the
reference aggregation of the ranks' own decodes, and telemetry counts the payload bytes."""

import pytest
import torch
import torch.distributed as dist
from compressor_helpers import SMALL_MODEL_OPTIONS
from models import SmallCNN

from gc_strategy import COMPRESSORS, GradientSynchronizer, build_components
from gc_strategy.bucket import Bucket
from gc_strategy.tools.ranks import run_ranks

MAJORITY = {"signsgd", "signum"}
LOWRANK = {"powersgd", "acpsgd"}
# the casts sum on the wire in 16 bits: each addition rounds by up to the unit roundoff
TOLERANCE = {"fp16": 2.0**-10, "bf16": 2.0**-7}
OPTIONS = SMALL_MODEL_OPTIONS


def _check_all(rank, world_size, memory):
    """Per compressor, 3 steps: the synchronised gradient against the reference aggregation of every
    rank's decode of its own ``x`` (``x = g``; with residual memory ``x = g + e`` and ``e ← x −
    decode(x)``, tracked here), and the synchroniser's residual against the tracked ``e``."""
    errors = {}
    for name in sorted(set(COMPRESSORS.names()) - LOWRANK):  # low-rank: tests/algos/test_powersgd.py
        torch.manual_seed(7)
        model = SmallCNN()
        c = build_components(name, memory, "auto", "groups:3", **OPTIONS.get(name, {}))
        synchronizer = GradientSynchronizer(model, c)
        # a twin compressor encodes this rank's gradients independently, for the reference
        twin = COMPRESSORS.build(name, **OPTIONS.get(name, {}))
        twin.bind(world_size, rank)
        model(torch.randn(2, 3, 8, 8)).sum().backward()  # the first step records the ready order
        if memory == "residual":  # from where the first step left it
            residual = [synchronizer.memory.buffer("residual", b).clone() for b in synchronizer.buckets]
        for step in range(3):
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model.zero_grad(set_to_none=True)
            with synchronizer.no_sync():
                model(x).square().mean().backward()
            local = torch.cat(
                [p.grad.reshape(-1) for p in map(synchronizer.layout.parameter, synchronizer.layout.order)]
            )
            model.zero_grad(set_to_none=True)
            state_before = {k: {b: t.clone() for b, t in v.items()} for k, v in synchronizer.compressor.buffers.items()}
            model(x).square().mean().backward()
            synced = torch.cat(
                [p.grad.reshape(-1) for p in map(synchronizer.layout.parameter, synchronizer.layout.order)]
            )
            twin.begin_step(synchronizer.step - 1)
            twin.buffers = {k: {b: t.clone() for b, t in v.items()} for k, v in state_before.items()}
            decodes, offset = [], 0
            for bucket in synchronizer.buckets:
                piece = local[offset : offset + bucket.numel]
                if memory == "residual":
                    piece = piece + residual[bucket.index]
                decoded = twin.decode(twin.encode(piece.clone(), bucket), bucket)
                if memory == "residual":
                    residual[bucket.index] = piece - decoded
                    kept = synchronizer.memory.buffer("residual", bucket)
                    scale = float(piece.abs().max().clamp_min(1e-12))
                    errors[f"{name} residual"] = max(
                        errors.get(f"{name} residual", 0.0), float((kept - residual[bucket.index]).abs().max()) / scale
                    )
                decodes.append(decoded)
                offset += bucket.numel
            mine = torch.cat(decodes)
            everyone = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(everyone, mine)
            reference = torch.stack(everyone).sum(0)
            reference = reference.sign() if name in MAJORITY else reference / world_size
            relative = float((synced - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
            errors[name] = max(errors.get(name, 0.0), relative)
        assert synchronizer.telemetry.last.sent_bytes > 0
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("memory", ["none", "residual"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_compressor_aggregates_like_the_reference(world_size, memory):
    for errors in run_ranks(_check_all, world_size, memory, timeout=240):
        bad = {name: err for name, err in errors.items() if err > TOLERANCE.get(name.split()[0], 1e-6)}
        assert not bad, bad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_compressor_runs_on_16_bit_gradients(dtype):
    """A model held in bf16/fp16: every compressor and memory produces finite gradients of the
    parameters' dtype (low-rank factors and memories stay fp32 inside)."""
    for name in COMPRESSORS.names():
        for memory in ("none", "residual", "dgc"):
            torch.manual_seed(0)
            model = SmallCNN().to(dtype)
            options = dict(OPTIONS.get(name, {}))
            if name in ("powersgd", "acpsgd"):  # their own error feedback only where no memory keeps one
                options.update(start_iter=0, use_error_feedback=memory == "none")
            c = build_components(name, memory, "auto", "groups:2", **options)
            synchronizer = GradientSynchronizer(model, c)
            for _ in range(2):
                model.zero_grad()
                model(torch.randn(2, 3, 8, 8).to(dtype)).float().square().mean().backward()
            for p in model.parameters():
                assert p.grad.dtype == dtype and torch.isfinite(p.grad).all(), (name, memory)
            assert synchronizer.telemetry.last.raw_bytes == sum(p.numel() * 2 for p in model.parameters())


def test_a_payload_outlives_the_next_encode_of_its_bucket():
    """Compressors keep scratch vectors per bucket from step to step; what ``encode`` returns is
    not one of them: the next encode of the same bucket leaves it unchanged."""
    n = 5000
    bucket = Bucket(0, ["p"], [torch.Size([n])], torch.float32, torch.device("cpu"))
    for name in sorted(set(COMPRESSORS.names()) - LOWRANK):  # low-rank: several rounds, no single encode
        compressor = COMPRESSORS.build(name, **OPTIONS.get(name, {}))
        first = compressor.encode(torch.randn(n), bucket)
        kept = [tensor.clone() for tensor in first]
        compressor.encode(torch.randn(n), bucket)
        assert all(torch.equal(a, b) for a, b in zip(first, kept)), name
