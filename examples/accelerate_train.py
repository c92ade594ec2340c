"""Compressed gradient synchronisation in a 🤗 Accelerate training loop.

A small CNN learns scikit-learn's handwritten digits (1,797 8x8 images, shipped with scikit-learn,
no download; the last 360 are the test set), with any compressor / memory / fusion plan of
gc_strategy in place of DDP:

    accelerate launch --cpu --num_processes 2 examples/accelerate_train.py \\
        --compressor topk --memory residual --option density=0.01 --accumulation 2

Options of the compressor and memory are ``--option key=value`` (repeatable). ``--save DIR`` saves
the full state (model, optimizer, compression state of every rank) with ``accelerator.save_state``
at the end; ``--resume DIR`` starts from one.
"""

from __future__ import annotations

import argparse
import ast

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import gc_strategy.accelerate


def digits(train: bool) -> TensorDataset:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    part = slice(None, -360) if train else slice(-360, None)
    return TensorDataset(images[part], labels[part])


def parse_option(text: str) -> tuple[str, object]:
    key, separator, value = text.partition("=")
    if not separator:
        raise argparse.ArgumentTypeError(f"--option {text!r}: expected key=value, e.g. density=0.01")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--memory", default="residual")
    parser.add_argument("--fusion", default="bucket_mb:25")
    parser.add_argument("--option", type=parse_option, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--save", help="save_state directory at the end")
    parser.add_argument("--resume", help="load_state directory to start from")
    args = parser.parse_args()
    options = dict(args.option or [])
    if "density" not in options and args.compressor in ("topk", "randk", "dgc", "sidco"):
        options["density"] = 0.01

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 16, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(digits(train=True), batch_size=32, shuffle=True)
    model, optimizer, loader = gc_strategy.accelerate.prepare(
        accelerator,
        model,
        optimizer,
        loader,
        compressor=args.compressor,
        memory=args.memory,
        fusion=args.fusion,
        **options,
    )
    if args.resume:
        accelerator.load_state(args.resume)
    for epoch in range(args.epochs):
        progress = tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not accelerator.is_local_main_process)
        for images, labels in progress:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(images), labels)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            progress.set_postfix(loss=f"{loss.item():.3f}")
    if args.save:
        accelerator.save_state(args.save)
    if accelerator.is_main_process:
        test = digits(train=False)
        with torch.no_grad():
            predictions = model(test.tensors[0].to(accelerator.device)).argmax(1).cpu()
        accuracy = (predictions == test.tensors[1]).float().mean().item()
        telemetry = model.gc_synchronizer.telemetry
        print(
            f"test accuracy {100 * accuracy:.1f}%, compression ratio {telemetry.total.compression_ratio:.1f}, "
            f"{telemetry.total.sent_bytes / max(1, telemetry.steps):,.0f} bytes sent per step "
            f"(compressor={args.compressor} memory={args.memory} fusion={args.fusion} options={options})"
        )


if __name__ == "__main__":
    main()
