"""Image data: CIFAR-10 (torchvision's python-pickle batches), ImageNet (ImageFolder) or synthetic.

``synthetic`` draws each image as its class's fixed random prototype plus noise, so a model can
really learn it (for throughput runs and offline demos); it is only used when asked for by name.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = "test_batch"


class MissingDataset(FileNotFoundError):
    """A data set is not where the configuration says; the message tells what to do."""


class CIFARBatches(Dataset):
    """CIFAR-10's python version: pickled dicts with ``data`` (N x 3072 uint8, channel-major 32x32)
    and ``labels``. (torchvision's ``CIFAR10`` reads the same files but insists on their published
    checksums; this reader also takes other data in the same format, such as the tests' tiny files.)"""

    def __init__(self, folder: Path, files: tuple[str, ...], transform) -> None:
        from PIL import Image

        images, labels = [], []
        for name in files:
            with open(folder / name, "rb") as f:
                batch = pickle.load(f, encoding="latin1")
            images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
            labels += list(batch["labels"])
        self.images, self.labels, self.transform, self._to_image = (
            np.concatenate(images),
            labels,
            transform,
            Image.fromarray,
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(self._to_image(self.images[i])), self.labels[i]


def synthetic_images(n: int, size: int, classes: int, seed: int, split: int, noise: float = 1.0) -> TensorDataset:
    """``n`` images ``[3, size, size]``: the label's prototype (fixed by ``seed``) plus Gaussian noise
    (drawn from ``seed`` and ``split``, so train and validation samples differ)."""
    prototypes = torch.randn(classes, 3, size, size, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1000 + split + 1)
    labels = torch.randint(0, classes, (n,), generator=g)
    images = prototypes[labels] + noise * torch.randn(n, 3, size, size, generator=g)
    return TensorDataset(images, labels)


class ImageDataModule(pl.LightningDataModule):
    def __init__(
        self,
        name: str,
        data_dir: str = "data",
        download: bool = False,
        batch_size: int = 32,
        num_workers: int = 0,
        image_size: int = 32,
        num_classes: int = 10,
        train_samples: int = 6400,
        val_samples: int = 640,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if name not in ("cifar10", "imagenet", "synthetic"):
            raise ValueError(f"data.name = {name!r} is invalid; allowed: 'cifar10', 'imagenet', 'synthetic'")
        self.name, self.data_dir, self.download = name, Path(data_dir), download
        self.batch_size, self.num_workers, self.image_size = batch_size, num_workers, image_size
        self.num_classes, self.train_samples, self.val_samples, self.seed = (
            num_classes,
            train_samples,
            val_samples,
            seed,
        )

    def prepare_data(self) -> None:
        if self.name == "cifar10" and self.download:
            from torchvision.datasets import CIFAR10

            CIFAR10(self.data_dir, train=True, download=True)
            CIFAR10(self.data_dir, train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        self.train_set, self.val_set = self._datasets()

    def check_present(self) -> None:
        """Raise :class:`MissingDataset` where the data set's files are not there (and are not to be
        downloaded): before any work, rather than in each rank's set-up."""
        message = None if self.name == "cifar10" and self.download else self._missing()
        if message is not None:
            raise MissingDataset(message)

    def _missing(self) -> str | None:
        """What is missing of the data set's files, or None."""
        if self.name == "cifar10":
            folder = self.data_dir / "cifar-10-batches-py"
            if not all((folder / f).is_file() for f in (*CIFAR_TRAIN, CIFAR_TEST)):
                return (
                    f"CIFAR-10 not found: expected the python batches in {folder} (data.data_dir={self.data_dir}); "
                    "set data.download=true to fetch them, or use data=synthetic_images"
                )
        elif self.name != "synthetic":
            train_dir, val_dir = self.data_dir / "train", self.data_dir / "val"
            if not (train_dir.is_dir() and val_dir.is_dir()):
                return (
                    f"ImageNet not found: expected class folders in {train_dir} and {val_dir} "
                    f"(data.data_dir={self.data_dir}); or use data=synthetic_images"
                )
        return None

    def _datasets(self) -> tuple[Dataset, Dataset]:
        if self.name == "synthetic":
            return (
                synthetic_images(self.train_samples, self.image_size, self.num_classes, self.seed, split=0),
                synthetic_images(self.val_samples, self.image_size, self.num_classes, self.seed, split=1),
            )
        from torchvision import transforms

        missing = self._missing()
        if missing is not None:
            raise MissingDataset(missing)
        if self.name == "cifar10":
            folder = self.data_dir / "cifar-10-batches-py"
            normalize = transforms.Normalize(CIFAR_MEAN, CIFAR_STD)
            train_tf = transforms.Compose(
                [
                    transforms.RandomCrop(32, padding=4),
                    transforms.RandomHorizontalFlip(),
                    transforms.ToTensor(),
                    normalize,
                ]
            )
            val_tf = transforms.Compose([transforms.ToTensor(), normalize])
            return CIFARBatches(folder, CIFAR_TRAIN, train_tf), CIFARBatches(folder, (CIFAR_TEST,), val_tf)
        from torchvision.datasets import ImageFolder

        train_dir, val_dir = self.data_dir / "train", self.data_dir / "val"
        normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        train_tf = transforms.Compose(
            [
                transforms.RandomResizedCrop(self.image_size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                normalize,
            ]
        )
        val_tf = transforms.Compose(
            [
                transforms.Resize(int(self.image_size * 256 / 224)),
                transforms.CenterCrop(self.image_size),
                transforms.ToTensor(),
                normalize,
            ]
        )
        return ImageFolder(train_dir, train_tf), ImageFolder(val_dir, val_tf)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers, drop_last=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
