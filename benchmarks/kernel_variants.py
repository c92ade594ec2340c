"""Each variant of the kernel layer's hot operations, timed side by side on one device, with CuPy's
counterparts where CuPy has one.

The kernel layer (``gc_strategy/kernels``) runs plain torch everywhere, numpy on the CPU where it
pays, one-pass Triton kernels on CUDA, and CuPy's kernels where they beat the others on the card
(its variant of packing signs, timed here as the layer runs it). CuPy's counterparts of the other
operations are measured beside them, to find where else a CuPy variant would pay. Every variant's
output is checked against the torch variant's before it is timed (an operation whose variants
disagree stops the run). Times: the median over ``--runs`` of the mean of ``--repeats`` calls,
the device synchronised around each run.

    python benchmarks/kernel_variants.py                      # CUDA, ResNet-50's 25.6 M elements
    python benchmarks/kernel_variants.py --device cpu --elements 1000000
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from cli import add_device_option, integer_at_least
from torch import Tensor

from gc_strategy.kernels import cupy_ops, numpy_ops, torch_ops, triton_bits, triton_select

#: an operation's variants: name -> (function of the input, or None where it has none here)
Variants = dict[str, Callable[[Tensor], Tensor] | None]


def variants_of(device: torch.device, density: float) -> dict[str, tuple[Callable[[int], Tensor], Variants, Callable]]:
    """name -> (input of ``n`` elements, the variants, how to compare two outputs)."""
    cp = cupy_ops.cupy() if device.type == "cuda" else None
    host = device.type == "cpu"
    triton = device.type == "cuda" and triton_bits.usable(torch.empty(1, device=device))

    def signs_input(n: int) -> Tensor:
        return torch.randn(n, device=device)

    def packed_input(n: int) -> Tensor:
        return torch.randint(0, 256, (n // 8,), dtype=torch.uint8, device=device)

    def top(k_of: Callable[[int], int]) -> Callable[[Tensor], Tensor]:
        return lambda magnitudes: magnitudes[torch_ops.top_k(magnitudes, k_of(magnitudes.numel()))]

    def k_of(n: int) -> int:
        return max(1, int(density * n))

    def cupy_top_k(magnitudes: Tensor) -> Tensor:
        k = k_of(magnitudes.numel())
        positions = torch.from_dlpack(cp.argpartition(-cp.from_dlpack(magnitudes), k - 1)[:k])
        return magnitudes[positions]

    same = torch.equal
    chunk = 256

    def chunks_input(n: int) -> Tensor:  # the whole chunks of |x|, as rows
        return signs_input(n - n % chunk).abs_().view(-1, chunk)

    def same_rows(a: Tensor, b: Tensor) -> bool:  # the same columns of each row, in any order
        return torch.equal(a.sort(1).values, b.sort(1).values)

    def same_values(a: Tensor, b: Tensor) -> bool:  # the same k values, in any order
        return torch.equal(a.sort().values, b.sort().values)

    return {
        "pack_signs": (
            signs_input,
            {
                "torch": lambda x: torch_ops.pack_bits(x >= 0, 1),
                "numpy": (lambda x: numpy_ops.pack_bits(x >= 0, 1)) if host else None,
                "triton": triton_bits.pack_signs if triton else None,
                "cupy": cupy_ops.pack_signs if cp else None,
            },
            same,
        ),
        "unpack_bits (1 bit)": (
            packed_input,
            {
                "torch": lambda p: torch_ops.unpack_bits(p, 1, 8 * p.numel()),
                "numpy": (lambda p: numpy_ops.unpack_bits(p, 1, 8 * p.numel())) if host else None,
                "triton": (lambda p: triton_bits.unpack_bits(p, 1, 8 * p.numel())) if triton else None,
                "cupy": (
                    (lambda p: torch.from_dlpack(cp.unpackbits(cp.from_dlpack(p), bitorder="little"))) if cp else None
                ),
            },
            same,
        ),
        f"top_k, {density:g} of n": (
            lambda n: signs_input(n).abs_(),
            {
                "torch": top(k_of),
                "numpy": (lambda m: m[numpy_ops.top_k(m, k_of(m.numel()))]) if host else None,
                "triton": None,
                "cupy": cupy_top_k if cp else None,
            },
            same_values,
        ),
        f"chunk_top_k, {k_of(chunk)} of each {chunk}": (
            chunks_input,
            {
                "torch": lambda m: torch_ops.chunk_top_k(m, k_of(chunk)),
                "numpy": None,
                "triton": (lambda m: triton_select.chunk_top_k(m, k_of(chunk))) if triton else None,
                "cupy": None,
            },
            same_rows,
        ),
        "all_finite": (
            signs_input,
            {
                "torch": torch_ops.all_finite,
                "numpy": numpy_ops.all_finite if host else None,
                "triton": None,
                "cupy": (lambda x: torch.from_dlpack(cp.isfinite(cp.from_dlpack(x)).all())) if cp else None,
            },
            lambda a, b: bool(a) == bool(b),
        ),
    }


def seconds_per_call(function: Callable[[], object], synchronize: Callable[[], None], runs: int, repeats: int) -> float:
    """Median over ``runs`` of the mean time of ``repeats`` calls."""
    function()  # compile, cache, allocate
    samples = []
    for _ in range(runs):
        synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            function()
        synchronize()
        samples.append((time.perf_counter() - start) / repeats)
    return statistics.median(samples)


def measure(
    device: torch.device,
    n: int,
    density: float,
    runs: int,
    repeats: int,
    measured: Callable[[str, dict[str, float]], object] = lambda op, times: None,
) -> dict[str, dict[str, float]]:
    """operation -> variant -> seconds per call (the variants this device has); ``measured`` is
    called with each operation's times as soon as they are taken."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results: dict[str, dict[str, float]] = {}
    for op, (make, variants, agree) in variants_of(device, density).items():
        x = make(n)
        reference = variants["torch"](x)
        results[op] = {}
        for variant, function in variants.items():
            if function is None:
                continue
            if not agree(function(x), reference):
                raise SystemExit(f"{op}: the {variant} variant's output differs from the torch variant's")
            results[op][variant] = seconds_per_call(functools.partial(function, x), synchronize, runs, repeats)
        measured(op, results[op])
    return results


VARIANTS = ("torch", "numpy", "triton", "cupy")
HEADER = f"| operation | {' | '.join(VARIANTS)} | fastest |\n|---|" + "---|" * (len(VARIANTS) + 1)


def row(op: str, times: dict[str, float]) -> str:
    cells = [f"{1000 * times[v]:.3f}" if v in times else "-" for v in VARIANTS]
    return f"| {op} | {' | '.join(cells)} | {min(times, key=times.get)} |"


def table(results: dict[str, dict[str, float]]) -> str:
    return "\n".join([HEADER, *(row(op, times) for op, times in results.items())])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_option(parser)
    parser.add_argument("--elements", type=integer_at_least(8), default=25_557_032, help="default: ResNet-50's")
    parser.add_argument("--density", type=float, default=0.01, help="top_k's fraction kept")
    parser.add_argument("--runs", type=integer_at_least(1), default=5)
    parser.add_argument("--repeats", type=integer_at_least(1), default=10)
    args = parser.parse_args()
    if not 0 < args.density <= 1:
        parser.error(f"--density {args.density} is invalid; allowed: a number in (0, 1]")
    device = torch.device(args.device)
    torch.manual_seed(0)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    cupy = cupy_ops.cupy()
    print(
        f"\n{args.elements:,} elements, {where}, torch {torch.__version__}, "
        f"CuPy {cupy.__version__ if cupy else 'absent'}; ms per call, median of {args.runs} runs "
        f"of {args.repeats} calls\n"
    )
    print(HEADER, flush=True)  # each row as it is measured: a part cut at its time limit keeps them
    measure(device, args.elements, args.density, args.runs, args.repeats, lambda op, t: print(row(op, t), flush=True))


if __name__ == "__main__":
    main()
