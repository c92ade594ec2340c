"""Arguments shared by the benchmark scripts: a bad count or device is an argparse error naming the
option, the value and what is allowed, before any work starts (not a traceback after it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch


def integer_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: the text as an integer, refused below ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is invalid; allowed: an integer >= {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device cuda|cpu``, by default CUDA where there is a GPU; ``cuda`` without one is refused."""

    def available(text: str) -> str:
        if text not in ("cuda", "cpu"):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: cuda, cpu")
        if text == "cuda" and not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("no CUDA device is available here; use --device cpu")
        return text

    available.__name__ = "device"
    parser.add_argument("--device", type=available, default="cuda" if torch.cuda.is_available() else "cpu")
