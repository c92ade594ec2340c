"""CUDA paths (side stream, fp16 AMP with a grad scaler); skipped without a GPU."""

import lightning.pytorch as pl
import pytest
import torch

from gc_strategy import GCFusedStrategy, GradientSynchronizer, build_components

from models import ParityModule, SmallCNN

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_side_stream_engine_matches_plain_gradients():
    reference = SmallCNN().cuda()
    model = SmallCNN().cuda()
    model.load_state_dict(reference.state_dict())
    c = build_components(compressor="none", fusion="groups:3")
    engine = GradientSynchronizer(model, c.compressor, c.memory, c.communicator, c.fusion)
    assert engine.stream is not None
    for seed in range(3):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed)).cuda()
        reference(x).square().mean().backward()
        model(x).square().mean().backward()
        for a, b in zip(reference.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)


def test_16_mixed_with_grad_scaler_trains_on_one_gpu():
    pl.seed_everything(0, verbose=False)
    module = ParityModule()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, precision="16-mixed", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
        strategy=GCFusedStrategy(compressor="fp16", memory="residual", start_method="fork"),
    )
    trainer.fit(module)
    assert all(torch.isfinite(p).all() for p in module.parameters())
