"""BERT masked-language-model pre-training (Devlin et al., NAACL 2019) with ``transformers``'
``BertForMaskedLM`` built from a configuration (no weights are downloaded).

Data: plain text files ``train.txt`` and ``valid.txt`` in ``data_dir`` (one passage per line), or a
synthetic Markov-chain token stream. The text is tokenized with a WordPiece tokenizer trained on
``train.txt`` with ``tokenizers`` (or loaded from ``tokenizer_path``, a ``tokenizer.json``), the
token stream is cut into blocks ``[CLS] ... [SEP]`` of ``max_length`` tokens, and
``transformers.DataCollatorForLanguageModeling`` masks 15% of the tokens as BERT does (of those,
80% become ``[MASK]``, 10% a random token, 10% stay).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from gc_strategy.sync.sharded.synchronizer import fsdp_modules

from .images import MissingDataset
from .text import markov_corpus

#: BERT sizes: tiny for CPU runs and tests; base and large as in the paper
SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
FILES = {"train": "train.txt", "valid": "valid.txt"}


class BertMaskedLM(pl.LightningModule):
    def __init__(
        self, vocab_size: int, max_length: int, size: str = "tiny", lr: float = 5e-4, weight_decay: float = 0.01
    ) -> None:
        super().__init__()
        if size not in SIZES:
            raise ValueError(f"model.size = {size!r} is invalid; allowed: {', '.join(SIZES)}")
        from transformers import BertConfig

        self.save_hyperparameters()
        config = BertConfig(vocab_size=vocab_size, max_position_embeddings=max_length, **SIZES[size])
        self.bert = masked_lm_loss(config)

    def configure_model(self) -> None:
        """Under ``gc_fsdp`` (a device mesh), FSDP2 units as for any transformer: each encoder layer,
        then the whole model, which holds the embeddings and the prediction head (whose decoder
        weight is tied to the word embeddings, and so must share their unit). A unit per Linear
        (the strategy's default policy) would return views (a Linear's output on a batch of
        sequences), which FSDP2 warns about."""
        mesh = self.device_mesh
        if mesh is None or fsdp_modules(self.bert):
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.bert.bert.encoder.layer:
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(self.bert, mesh=mesh["shard"])

    def _loss(self, batch) -> torch.Tensor:
        return self.bert(**batch)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/mlm_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/mlm_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def masked_lm_loss(config) -> torch.nn.Module:
    """``BertForMaskedLM`` whose forward returns the loss alone where labels are given (its
    parameters and their names unchanged): the logits it would return beside it are a view, which
    FSDP2 warns about in the output of a unit. Without labels, the usual output (the logits)."""
    from transformers import BertForMaskedLM

    class BertMaskedLMLoss(BertForMaskedLM):
        def forward(self, **batch):
            output = super().forward(**batch)
            return output if output.loss is None else output.loss

    return BertMaskedLMLoss(config)


class Blocks(Dataset):
    """``[CLS] t_1 ... t_{L-2} [SEP]`` blocks cut from one token stream."""

    def __init__(self, ids: torch.Tensor, max_length: int, cls_id: int, sep_id: int) -> None:
        body = max_length - 2
        count = ids.numel() // body
        blocks = ids[: count * body].view(count, body)
        self.blocks = torch.cat([torch.full((count, 1), cls_id), blocks, torch.full((count, 1), sep_id)], 1)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


def wordpiece_tokenizer(train_file: Path, vocab_size: int):
    """A BERT WordPiece tokenizer (lower-cased) trained on ``train_file`` with ``tokenizers``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train([str(train_file)], trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL))
    return tokenizer


def word_level_tokenizer(words: int):
    """Tokens ``w0 .. w{words-1}`` after the special tokens: the vocabulary of the synthetic corpus."""
    from tokenizers import Tokenizer, models

    vocab = {token: i for i, token in enumerate(SPECIAL + [f"w{i}" for i in range(words)])}
    return Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))


class MaskedTextDataModule(pl.LightningDataModule):
    def __init__(
        self,
        name: str,
        data_dir: str = "data/corpus",
        tokenizer_path: str | None = None,
        vocab_size: int = 4000,
        max_length: int = 64,
        batch_size: int = 16,
        mlm_probability: float = 0.15,
        train_tokens: int = 200_000,
        val_tokens: int = 20_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if name not in ("corpus", "synthetic"):
            raise ValueError(f"data.name = {name!r} is invalid; allowed: 'corpus', 'synthetic'")
        if max_length < 3:
            raise ValueError(f"data.max_length = {max_length!r} is invalid; allowed: an integer >= 3")
        if not 0 < mlm_probability < 1:
            raise ValueError(f"data.mlm_probability = {mlm_probability!r} is invalid; allowed: a number in (0, 1)")
        self.name, self.data_dir = name, Path(data_dir)
        self.tokenizer_path = Path(tokenizer_path) if tokenizer_path else None
        self.vocab_size, self.max_length, self.batch_size = vocab_size, max_length, batch_size
        self.mlm_probability, self.seed = mlm_probability, seed
        self.train_tokens, self.val_tokens = train_tokens, val_tokens
        self.tokenizer = None

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokenizer and the train / valid token streams."""
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        if self.name == "synthetic":
            core = word_level_tokenizer(self.vocab_size)
            streams = [
                markov_corpus(n, self.vocab_size, self.seed, split) + len(SPECIAL)
                for split, n in enumerate((self.train_tokens, self.val_tokens))
            ]
        else:
            missing = [self.data_dir / f for f in FILES.values() if not (self.data_dir / f).is_file()]
            if self.tokenizer_path is not None and not self.tokenizer_path.is_file():
                missing.append(self.tokenizer_path)
            if missing:
                raise MissingDataset(
                    f"text corpus not found: expected {', '.join(str(m) for m in missing)} "
                    f"(data.data_dir={self.data_dir}); or use data=synthetic_tokens"
                )
            core = (
                Tokenizer.from_file(str(self.tokenizer_path))
                if self.tokenizer_path
                else wordpiece_tokenizer(self.data_dir / FILES["train"], self.vocab_size)
            )
            streams = []
            for split in ("train", "valid"):
                lines = [
                    line
                    for line in (self.data_dir / FILES[split]).read_text(encoding="utf8").splitlines()
                    if line.strip()
                ]
                ids = [i for encoding in core.encode_batch(lines, add_special_tokens=False) for i in encoding.ids]
                streams.append(torch.tensor(ids, dtype=torch.int64))
        self.tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=core,
            **dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIAL)),
        )
        self.vocab_size = len(self.tokenizer)
        return streams[0], streams[1]

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        from transformers import DataCollatorForLanguageModeling

        train, valid = self._load()
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        self.train_set = Blocks(train, self.max_length, cls_id, sep_id)
        self.val_set = Blocks(valid, self.max_length, cls_id, sep_id)
        if len(self.train_set) == 0:
            raise ValueError(
                f"the training text holds {train.numel()} tokens, fewer than one block of "
                f"data.max_length = {self.max_length}"
            )
        self.collate = DataCollatorForLanguageModeling(self.tokenizer, mlm_probability=self.mlm_probability)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=self.collate
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=self.collate)
