"""LSTM word language model, as in PyTorch's word_language_model example (the model the
Pufferfish paper trained on WikiText-2): embedding, multi-layer LSTM with dropout, linear decoder
optionally tied to the embedding; reports perplexity."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn


class LSTMLanguageModel(pl.LightningModule):
    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int = 200,
        hidden_dim: int = 200,
        layers: int = 2,
        dropout: float = 0.2,
        tied: bool = False,
        lr: float = 20.0,
        clip: float = 0.25,
    ) -> None:
        super().__init__()
        if tied and embedding_dim != hidden_dim:
            raise ValueError(
                f"model.tied = true needs model.embedding_dim == model.hidden_dim, got {embedding_dim} and {hidden_dim}"
            )
        self.save_hyperparameters()
        self.drop = nn.Dropout(dropout)
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_dim, layers, dropout=dropout if layers > 1 else 0.0, batch_first=True)
        self.decoder = nn.Linear(hidden_dim, vocab_size)
        if tied:
            self.decoder.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if not tied:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.drop(self.embedding(tokens)))
        return self.decoder(self.drop(hidden))

    def _loss(self, batch) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/ppl", torch.exp(loss.detach()), prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=self.hparams.clip, gradient_clip_algorithm="norm")
