"""A folder of text files as a language model's corpus, read offline: byte by byte (a vocabulary
of 256, no tokenizer to download), or through a local ``tokenizers`` file (``tokenizer_path``).

Files: every regular file under ``data_dir`` whose name ends in one of ``suffixes``, in the order of
their paths. Without ``data_dir``, the Python standard library's source files of the running
interpreter (``*.py`` under ``sysconfig``'s ``stdlib``; no installed packages): real text that every
machine has, standing in for the user's own corpus.

Split by file, deterministically: a file is for validation when the first byte of the SHA-256 of
its path (relative to the folder) is below ``validation_fraction``·256, so the split depends on the
file alone, not on the order in which files are found, and stays when files are added. Each split's
files are concatenated into one stream, cut into consecutive windows of ``context`` input tokens
(target: the same window shifted by one token); the last window is padded, its padded targets left
out of the loss, so that an epoch reads every token of the stream once as an input. A validation
reads the first ``val_tokens`` of its stream (all of it where null).

``name: synthetic`` is a token stream from a fixed random Markov chain over bytes instead (a named
option for runs without files, never a fallback).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from .gpt import IGNORE
from .images import MissingDataset
from .text import markov_corpus

NAMES = ("files", "synthetic")
BYTES = 256


def standard_library() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(folder: Path, suffixes: list[str]) -> list[Path]:
    """The corpus's files under ``folder``, in the order of their paths (installed packages left out
    of the standard library)."""
    found = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).parts
        if "site-packages" in relative or "dist-packages" in relative:
            continue
        if path.is_file() and path.name.endswith(tuple(suffixes)):
            found.append(path)
    return found


def is_validation(relative: str, fraction: float) -> bool:
    """Whether the file at ``relative`` (a path relative to the corpus folder) is for validation."""
    return hashlib.sha256(relative.encode()).digest()[0] < fraction * 256


class Windows(Dataset):
    """Consecutive ``(input, target)`` windows of ``context`` tokens over one stream, the last one
    padded (inputs with 0, targets with :data:`IGNORE`)."""

    def __init__(self, ids: torch.Tensor, context: int) -> None:
        self.ids, self.context = ids, context
        self.count = -(-(ids.numel() - 1) // context) if ids.numel() > 1 else 0

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.context
        chunk = self.ids[start : start + self.context + 1]
        inputs = torch.zeros(self.context, dtype=torch.int64)
        targets = torch.full((self.context,), IGNORE, dtype=torch.int64)
        inputs[: chunk.numel() - 1] = chunk[:-1]
        targets[: chunk.numel() - 1] = chunk[1:]
        return inputs, targets


class CorpusDataModule(pl.LightningDataModule):
    def __init__(
        self,
        name: str = "files",
        data_dir: str | None = None,
        suffixes: tuple[str, ...] = (".py", ".txt", ".md"),
        tokenizer_path: str | None = None,
        validation_fraction: float = 0.1,
        context: int = 128,
        batch_size: int = 16,
        train_tokens: int = 200_000,
        val_tokens: int | None = 20_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if name not in NAMES:
            raise ValueError(f"data.name = {name!r} is invalid; allowed: {', '.join(map(repr, NAMES))}")
        if not 0 < validation_fraction < 1:
            raise ValueError(f"data.validation_fraction = {validation_fraction} is invalid; allowed: 0 < it < 1")
        self.name, self.seed = name, seed
        self.folder = Path(data_dir) if data_dir else standard_library()
        self.suffixes, self.validation_fraction = list(suffixes), validation_fraction
        self.tokenizer_path = tokenizer_path
        self.context, self.batch_size = context, batch_size
        self.train_tokens, self.val_tokens = train_tokens, val_tokens
        self.vocab_size = BYTES
        self._tokenizer = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            if not Path(tokenizer_path).is_file():
                raise MissingDataset(f"data.tokenizer_path = {tokenizer_path!r}: no such file")
            self._tokenizer = Tokenizer.from_file(tokenizer_path)
            self.vocab_size = self._tokenizer.get_vocab_size()

    def check_present(self) -> None:
        """Raise :class:`MissingDataset` where the corpus's folder is missing or gives no training or
        no validation file: before any work, rather than in each rank's set-up."""
        if self.name == "files":
            self.split()

    def split(self) -> tuple[list[Path], list[Path]]:
        """The training and the validation files."""
        if not self.folder.is_dir():
            raise MissingDataset(f"data.data_dir = {str(self.folder)!r} is not a folder; or use data=synthetic_bytes")
        files = corpus_files(self.folder, self.suffixes)
        if not files:
            raise MissingDataset(
                f"data.data_dir = {str(self.folder)!r} holds no file ending in {', '.join(self.suffixes)} "
                "(data.suffixes); or use data=synthetic_bytes"
            )
        fraction = self.validation_fraction
        validation = [f for f in files if is_validation(f.relative_to(self.folder).as_posix(), fraction)]
        held_out = set(validation)
        train = [f for f in files if f not in held_out]
        if not train or not validation:
            raise MissingDataset(
                f"data.data_dir = {str(self.folder)!r}: its {len(files)} file(s) give no "
                f"{'training' if not train else 'validation'} file at data.validation_fraction = "
                f"{self.validation_fraction}; add files or change the fraction"
            )
        return train, validation

    def encode(self, files: list[Path]) -> torch.Tensor:
        """The files' tokens, one stream."""
        if self._tokenizer is None:
            data = b"".join(f.read_bytes() for f in files)
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        texts = [f.read_text(encoding="utf8", errors="replace") for f in files]
        return torch.tensor([i for e in self._tokenizer.encode_batch(texts) for i in e.ids], dtype=torch.int64)

    def setup(self, stage: str | None = None) -> None:
        if self.name == "synthetic":
            train = markov_corpus(self.train_tokens, BYTES, self.seed, split=0)
            valid = markov_corpus(self.val_tokens, BYTES, self.seed, split=1)
        else:
            train_files, validation_files = self.split()
            train, valid = self.encode(train_files), self.encode(validation_files)
            if self.val_tokens is not None:  # each validation reads the stream's first val_tokens
                valid = valid[: self.val_tokens + 1]
        self.train_set, self.val_set = Windows(train, self.context), Windows(valid, self.context)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
