"""ResNet classification recipe: torchvision resnet18/50/101, CIFAR stem for 32x32 inputs or the
ImageNet form, SGD with momentum and cosine learning-rate decay."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

ARCHS = ("resnet18", "resnet50", "resnet101")


def build_resnet(arch: str, num_classes: int, cifar_stem: bool) -> nn.Module:
    """torchvision's ResNet; with ``cifar_stem`` the 7x7/2 conv + max-pool become one 3x3/1 conv
    (the usual form for 32x32 images)."""
    from torchvision import models

    if arch not in ARCHS:
        raise ValueError(f"model.arch = {arch!r} is invalid; allowed: {', '.join(ARCHS)}")
    model = getattr(models, arch)(num_classes=num_classes)
    if cifar_stem:
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


class ResNetClassifier(pl.LightningModule):
    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 10,
        cifar_stem: bool = True,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_resnet(arch, num_classes, cifar_stem)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val/loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val/acc", (logits.argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        total = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, int(total)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
