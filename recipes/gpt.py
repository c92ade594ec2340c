"""A GPT-style decoder language model (Radford et al., "Language Models are Unsupervised Multitask
Learners", 2019): token and learned position embeddings, ``layers`` pre-norm blocks, a final
LayerNorm and an output projection tied to the token embedding (Press & Wolf, EACL 2017).

Each block is ``x + attention(LN(x))`` then ``x + MLP(LN(x))``; attention is causal multi-head
self-attention through torch's ``scaled_dot_product_attention`` (``is_causal=True``: position ``t``
attends to positions ``<= t`` only, so a token's output never depends on later tokens); the MLP is
``Linear(d, 4d) → GELU → Linear(4d, d)``. With vocabulary ``V``, context ``C``, width ``d`` and ``L``
blocks the parameters number

    V·d + C·d + L·(12·d² + 13·d) + 2·d

(:func:`parameter_count`): per block, the two LayerNorms 4·d, the query/key/value projection
3·d² + 3·d, the attention's output projection d² + d, the MLP 8·d² + 5·d; the tied output adds none.
The default is sized for a CPU; ``layers=12 width=768 heads=12`` with a context of 1024 is GPT-2
small's shape (85M parameters over bytes, 124M over GPT-2's 50,257 tokens).

Training: AdamW, the loss the mean cross-entropy of each next token in nats; validation reports it
with its perplexity ``exp(loss)``. Under ``bf16`` the forward runs under bf16 autocast where the
device has it (a CUDA GPU with bf16); elsewhere in float32.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

from gc_strategy.sync.sharded.synchronizer import fsdp_modules

#: targets of this value (padding at the end of a stream) are left out of the loss
IGNORE = -100


def parameter_count(vocab_size: int, context: int, width: int, layers: int) -> int:
    """The parameters of :class:`GPT` (see the module's docstring)."""
    return vocab_size * width + context * width + layers * (12 * width**2 + 13 * width) + 2 * width


class Block(nn.Module):
    """``x + attention(LN(x))``, then ``x + MLP(LN(x))``."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_attention = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ln_mlp = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(batch, length, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.ln_attention(x)))
        return x + self.drop(self.mlp(self.ln_mlp(x)))


class GPT(nn.Module):
    """The decoder: token ids ``(batch, length)`` to next-token logits ``(batch, length, V)``."""

    def __init__(self, vocab_size: int, context: int, width: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"model.width = {width} must be a multiple of model.heads = {heads}")
        self.context = context
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_final = nn.LayerNorm(width)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: residual projections scaled by 1/sqrt(2·layers)
            for projection in (block.out, block.mlp[2]):
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.context:
            raise ValueError(f"a sequence of {length} tokens is longer than the model's context ({self.context})")
        positions = torch.arange(length, device=ids.device)
        x = self.drop(self.tokens(ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.ln_final(x) @ self.tokens.weight.t()  # the output tied to the token embedding


class GPTLanguageModel(pl.LightningModule):
    def __init__(
        self,
        vocab_size: int,
        context: int,
        width: int = 128,
        layers: int = 2,
        heads: int = 4,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        bf16: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt = GPT(vocab_size, context, width, layers, heads, dropout)

    def configure_model(self) -> None:
        """Under ``gc_fsdp`` (a device mesh), each block its own FSDP2 unit, then the whole decoder,
        which holds the embeddings (the token embedding is the tied output too, so one unit holds
        both uses) and the final LayerNorm."""
        mesh = self.device_mesh
        if mesh is None or fsdp_modules(self.gpt):
            return
        from torch.distributed.fsdp import fully_shard

        for block in self.gpt.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(self.gpt, mesh=mesh["shard"])

    def _losses(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed next-token cross-entropy of ``batch`` (nats) and the tokens it covers."""
        ids, targets = batch
        bf16 = self.hparams.bf16 and ids.is_cuda and torch.cuda.is_bf16_supported()
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = self.gpt(ids)
        total = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return total, (targets != IGNORE).sum()

    def training_step(self, batch, batch_idx):
        total, tokens = self._losses(batch)
        loss = total / tokens
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self._validation = torch.zeros(2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):
        total, tokens = self._losses(batch)
        self._validation += torch.stack([total.detach().double(), tokens.double()])

    def on_validation_epoch_end(self) -> None:
        """The loss over every validation token of every rank (a token-weighted mean, not a mean
        of the batches' means), and its perplexity."""
        total, tokens = self.trainer.strategy.reduce(self._validation, reduce_op="sum")
        loss = (total / tokens.clamp(min=1)).float()
        # the same value on every rank: sync_dist's mean keeps it, and tells Lightning it is global
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
