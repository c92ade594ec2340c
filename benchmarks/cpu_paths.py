"""The CPU paths of the hot operations against the plain torch code they replace.

On the CPU the library takes numpy's or a sliced form of several operations, where it measured faster
than the direct torch call. The docstrings name the choices and point here. The script times each
pair on one thread, on a bucket of ``--elements`` fp32 values (6.6M: ResNet-18's larger 25 MB bucket),
and prints the median of ``--repeats`` runs of each.

    python benchmarks/cpu_paths.py --elements 6600000 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from cli import integer_at_least

from gc_strategy.bucket import Bucket, all_finite
from gc_strategy.kernels import pack_bits, top_k


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def pairs(n: int) -> list[tuple[str, str, Callable, str, Callable]]:
    """(operation, the library's CPU path, its code, the torch code it replaces, that code)."""
    g = torch.randn(n)
    a = g.abs()
    mantissa, exponent = torch.empty(n), torch.empty(n, dtype=torch.int32)
    uniform = torch.empty(n)
    sparse = torch.where(torch.rand(n) < 0.01, g, torch.zeros(()))
    bits = (g > 0).to(torch.uint8)
    sizes = [n // 8] * 7 + [n - 7 * (n // 8)]
    bucket = Bucket(
        0, [f"t{i}" for i in range(8)], [torch.Size([s]) for s in sizes], torch.float32, torch.device("cpu")
    )
    yes, no = torch.randn(8), torch.randn(8)
    out = torch.empty(n)
    mask = g > 0
    return [
        (
            "frexp",
            "numpy frexp",
            lambda: np.frexp(a.numpy(), mantissa.numpy(), exponent.numpy()),
            "torch.frexp",
            lambda: torch.frexp(a),
        ),
        (
            "fill where zero",
            "numpy putmask",
            lambda: np.putmask(exponent.numpy(), a.numpy() == 0, 127),
            "masked_fill",
            lambda: exponent.masked_fill_(a == 0, 127),
        ),
        (
            "uniform draws",
            "numpy PCG64",
            lambda: np.random.default_rng(0).random(out=uniform.numpy(), dtype=np.float32),
            "torch generator",
            lambda: uniform.uniform_(generator=torch.Generator().manual_seed(0)),
        ),
        (
            "nonzero positions",
            "numpy flatnonzero",
            lambda: np.flatnonzero(np.not_equal(sparse.numpy(), 0)),
            "torch.nonzero",
            lambda: torch.nonzero(sparse),
        ),
        (
            "top 1% exact",
            "sampled threshold + argpartition",
            lambda: top_k(a, n // 100),
            "torch.topk",
            lambda: torch.topk(a, n // 100, sorted=False),
        ),
        (
            "1-bit pack",
            "numpy packbits",
            lambda: pack_bits(bits, 1),
            "shift-and-sum",
            lambda: (bits.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1),
        ),
        (
            "per-tensor sums",
            "one sum per slice",
            lambda: bucket.sum_per_tensor(g),
            "index_add",
            lambda: torch.zeros(8).index_add_(0, bucket.tensor_ids(g.device), g),
        ),
        (
            "per-tensor select",
            "bit patterns per slice",
            lambda: bucket.select_per_tensor(mask, yes, no, out=out),
            "torch.where",
            lambda: torch.where(mask, bucket.per_element(yes), bucket.per_element(no)),
        ),
        ("finite check", "aminmax", lambda: all_finite(g), "isfinite().all()", lambda: torch.isfinite(g).all()),
        (
            "u ← g + m·u",
            "one add with out=",
            lambda: torch.add(g, out, alpha=0.9, out=out),
            "scale, then add",
            lambda: out.mul_(0.9).add_(g),
        ),
        ("a bucket-sized temporary", "a kept workspace", lambda: out.copy_(g), "a fresh tensor", lambda: g.clone()),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=integer_at_least(1024), default=6_600_000)
    parser.add_argument("--repeats", type=integer_at_least(1), default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.elements:,} fp32 elements, one thread, median of {args.repeats}, torch {torch.__version__}\n")
    print("| operation | CPU path | ms | torch code | ms | ratio |")
    print("|---|---|---:|---|---:|---:|")
    for operation, ours, fast, theirs, slow in pairs(args.elements):
        a, b = median_ms(fast, args.repeats), median_ms(slow, args.repeats)
        print(f"| {operation} | {ours} | {a:.2f} | {theirs} | {b:.2f} | {b / a:.1f}x |")


if __name__ == "__main__":
    main()
