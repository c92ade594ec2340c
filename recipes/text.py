"""Word-level language-model data: WikiText-2 token files or a synthetic Markov-chain corpus.

WikiText-2 is read from ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens`` in
``data_dir`` as the classic PyTorch word-language-model example does: each line split on spaces plus
``<eos>``; the vocabulary is built from the training file. The token stream is cut into
non-overlapping windows of ``bptt + 1`` tokens (input, target shifted by one), which the distributed
sampler shares between ranks.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from .images import MissingDataset

SPLITS = {"train": "wiki.train.tokens", "valid": "wiki.valid.tokens", "test": "wiki.test.tokens"}


def read_tokens(path: Path) -> list[str]:
    words: list[str] = []
    with open(path, encoding="utf8") as f:
        for line in f:
            words += line.split() + ["<eos>"]
    return words


class Vocabulary:
    def __init__(self, words: list[str]) -> None:
        self.index: dict[str, int] = {}
        for word in ["<unk>", "<eos>", *words]:
            self.index.setdefault(word, len(self.index))

    def __len__(self) -> int:
        return len(self.index)

    def encode(self, words: list[str]) -> torch.Tensor:
        unk = self.index["<unk>"]
        return torch.tensor([self.index.get(w, unk) for w in words], dtype=torch.int64)


class Windows(Dataset):
    """Non-overlapping ``(input, target)`` windows of ``bptt`` tokens from one token stream."""

    def __init__(self, ids: torch.Tensor, bptt: int) -> None:
        self.ids, self.bptt = ids, bptt
        self.count = max(0, (ids.numel() - 1) // bptt)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        start = i * self.bptt
        chunk = self.ids[start : start + self.bptt + 1]
        return chunk[:-1], chunk[1:]


def markov_corpus(tokens: int, vocab: int, seed: int, split: int, successors: int = 3) -> torch.Tensor:
    """A token stream from a fixed random Markov chain: every token has ``successors`` likely next
    tokens (chosen by ``seed``), so a language model can learn it (perplexity far below ``vocab``)."""
    table = torch.randint(0, vocab, (vocab, successors), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1000 + split + 1)
    choices = torch.randint(0, successors, (tokens,), generator=g)
    ids = torch.empty(tokens, dtype=torch.int64)
    current = 0
    for i in range(tokens):
        current = int(table[current, choices[i]])
        ids[i] = current
    return ids


class LanguageModelDataModule(pl.LightningDataModule):
    def __init__(
        self,
        name: str,
        data_dir: str = "data/wikitext-2",
        batch_size: int = 20,
        bptt: int = 35,
        vocab_size: int = 1000,
        train_tokens: int = 200_000,
        val_tokens: int = 20_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if name not in ("wikitext2", "synthetic"):
            raise ValueError(f"data.name = {name!r} is invalid; allowed: 'wikitext2', 'synthetic'")
        self.name, self.data_dir = name, Path(data_dir)
        self.batch_size, self.bptt, self.seed = batch_size, bptt, seed
        self.vocab_size, self.train_tokens, self.val_tokens = vocab_size, train_tokens, val_tokens
        self.vocabulary: Vocabulary | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.name == "synthetic":
            train = markov_corpus(self.train_tokens, self.vocab_size, self.seed, split=0)
            valid = markov_corpus(self.val_tokens, self.vocab_size, self.seed, split=1)
        else:
            missing = [self.data_dir / f for f in SPLITS.values() if not (self.data_dir / f).is_file()]
            if missing:
                raise MissingDataset(
                    f"WikiText-2 not found: expected {', '.join(str(m) for m in missing)} "
                    f"(data.data_dir={self.data_dir}); or use data=synthetic_text"
                )
            words = read_tokens(self.data_dir / SPLITS["train"])
            self.vocabulary = Vocabulary(words)
            self.vocab_size = len(self.vocabulary)
            train = self.vocabulary.encode(words)
            valid = self.vocabulary.encode(read_tokens(self.data_dir / SPLITS["valid"]))
        self.train_set, self.val_set = Windows(train, self.bptt), Windows(valid, self.bptt)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
