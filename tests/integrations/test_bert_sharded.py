"""The app's BERT recipe sharded by ``gc_fsdp`` on one node of 2 processes, with ``compressor="none"``,
against the same run under ``gc_fused`` (every rank the whole model, DDP's average): the same
parameters after the same steps, with the recipe's units (each encoder layer, then the model) and
with a unit per module that holds parameters (the strategy's default policy, whose units return
views that FSDP2 warns about: the gradients are right all the same)."""

import lightning.pytorch as pl
import pytest
import torch

from gc_strategy import GCFSDPStrategy, GCFusedStrategy
from gc_strategy.sync.sharded.synchronizer import has_fsdp2_hook
from recipes.bert import BertMaskedLM, MaskedTextDataModule

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_fsdp2_hook(), reason="sharded training needs torch >= 2.7")]


class PerModuleUnits(BertMaskedLM):
    """The recipe without its own units: the strategy's default policy shards it."""

    def configure_model(self) -> None:
        pass


def _train(strategy, module_class=BertMaskedLM):
    """Rank 0's parameters before and after 4 steps of AdamW (each rank its own batches)."""
    pl.seed_everything(0, verbose=False)
    data = MaskedTextDataModule(
        name="synthetic", vocab_size=200, max_length=16, batch_size=4, train_tokens=2000, val_tokens=200, seed=0
    )
    data.setup("fit")
    module = module_class(vocab_size=data.vocab_size, max_length=data.max_length, lr=1e-3, weight_decay=0.01)
    before = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=4,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    return before, {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def test_sharded_bert_equals_replicated_bert():
    start, replicated = _train(GCFusedStrategy(start_method="fork"))
    assert any(not torch.equal(replicated[name], tensor) for name, tensor in start.items())
    for module_class in (BertMaskedLM, PerModuleUnits):
        _, sharded = _train(GCFSDPStrategy(start_method="fork"), module_class)
        assert sharded.keys() == replicated.keys()
        for name, tensor in replicated.items():
            message = f"{module_class.__name__}: {name}"
            torch.testing.assert_close(sharded[name], tensor, rtol=1e-5, atol=1e-5, msg=message)
