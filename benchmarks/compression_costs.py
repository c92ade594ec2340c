"""Compression cost of every compressor on real gradients, layer-wise vs fused vs the plan
``fusion=auto`` picks, next to the memory-bandwidth floor (the GPU mode of the benchmark harness).

For each model (torchvision ResNet-50 and ResNet-101 on 224x224 images, ``transformers`` BERT-base
masked LM on 128 tokens; batch ``--batch``), one backward gives the gradients; each compressor (with
its usual memory and options) then encodes, exchanges and decodes every bucket of a plan in one
process (the collectives are then no-ops: the time is the compression alone), timed with device
synchronisation, median of ``--runs``. Plans: ``layerwise`` (one tensor per bucket), ``single`` (one
bucket), ``bucket_mb:25``, and the plan ``fusion=auto:2`` chooses after profiling this model here
(``--plans``: some of them; "buckets" counts those of the last).

Floor = bytes the method must move / copy bandwidth measured here: read the gradient (4n), read and
write the error-feedback memory when it has one (8n), write the payload, write the decoded result (4n).

    python benchmarks/compression_costs.py --device cuda
    python benchmarks/compression_costs.py --device cpu --models resnet50 --compressors fp16 topk --image-size 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cli import add_device_option, integer_at_least
from torch import nn

from gc_strategy import COMPRESSORS, GradientSynchronizer, build_components
from gc_strategy.sync.paths.profiler import time_exchange

#: memory and options each compressor is usually run with
USUAL = {
    "topk": ("residual", {"density": 0.01}),
    "randk": ("residual", {"density": 0.01}),
    "dgc": ("dgc", {"density": 0.01}),
    "threshold": ("residual", {}),
    "sidco": ("residual", {"density": 0.01}),
    "qsgd": ("none", {"levels": 127}),
    "onebit": ("residual", {}),
    "efsignsgd": ("residual", {}),
    "powersgd": ("none", {"rank": 4, "start_iter": 0}),
    "acpsgd": ("none", {"rank": 4, "start_iter": 0}),
}
PLANS = ("layerwise", "single", "bucket_mb:25", "auto:2")


def model_and_loss(name: str, batch: int, image_size: int, device: torch.device):
    """The model and a function computing a loss on a fixed random batch."""
    generator = torch.Generator().manual_seed(0)
    if name == "bert-base":
        from transformers import BertConfig, BertForMaskedLM

        model = BertForMaskedLM(BertConfig()).to(device)
        ids = torch.randint(0, model.config.vocab_size, (batch, 128), generator=generator).to(device)
        return model, lambda: model(input_ids=ids, labels=ids).loss
    from torchvision import models

    model = getattr(models, name)(num_classes=1000).to(device)
    x = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
    y = torch.randint(0, 1000, (batch,), generator=generator).to(device)
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def buckets_of(model: nn.Module, loss, compressor: str, fusion: str) -> tuple[list, list]:
    """The buckets a synchroniser with ``fusion`` forms (after its plan is final) and their raw
    gradients, from a plain backward once the synchroniser is gone (its buffers hold averages)."""
    memory, options = USUAL.get(compressor, ("none", {}))
    c = build_components(compressor, memory, fusion=fusion, **options)
    synchronizer = GradientSynchronizer(model, c)
    steps = 0
    while steps < 2 or (
        synchronizer.tuner is not None and synchronizer.tuner.phase != "done"
    ):  # order (+ auto's planning)
        model.zero_grad()
        loss().backward()
        steps += 1
    synchronizer.close()
    model.zero_grad()
    loss().backward()
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()}
    flats = [
        torch.cat([grads[name].flatten() for name in bucket.names]).to(bucket.dtype) for bucket in synchronizer.buckets
    ]
    return list(synchronizer.buckets), flats


def time_plan(compressor: str, buckets: list, flats: list, runs: int) -> tuple[float, int]:
    """Median seconds of compressing every bucket once, and the payload bytes."""
    memory, options = USUAL.get(compressor, ("none", {}))
    c = build_components(compressor, memory, **options)
    c.bind(None)
    c.compressor.begin_step(1 << 30)  # steady state
    totals, sent = [], 0
    for run in range(runs + 1):  # the first run warms up
        total, sent = 0.0, 0
        for bucket, flat in zip(buckets, flats):
            timed = time_exchange(flat, bucket, c)
            total += timed.encode_s + timed.comm_s + timed.decode_s + timed.between_s
            sent += timed.sent_bytes
        if run:
            totals.append(total)
    return statistics.median(totals), sent


def profile_plan(compressor: str, buckets: list, flats: list, rows: int = 8) -> str:
    """The kernels one compression of every bucket runs, by total device (or CPU) time: where the
    time goes, to compare with the bytes floor."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if flats[0].is_cuda else [])
    time_plan(compressor, buckets, flats, runs=1)  # warm up outside the profile
    with profile(activities=activities) as prof:
        time_plan(compressor, buckets, flats, runs=1)
    sort = "self_cuda_time_total" if flats[0].is_cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device copy (read + write counted)."""
    source = torch.empty(64 * 2**20, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() * 4 / statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_option(parser)
    parser.add_argument(
        "--models",
        nargs="+",
        default=["resnet50", "resnet101", "bert-base"],
        choices=["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "bert-base"],
    )
    parser.add_argument(
        "--compressors", nargs="+", default=[n for n in COMPRESSORS.names() if n != "none"], choices=COMPRESSORS.names()
    )
    parser.add_argument("--batch", type=integer_at_least(1), default=8)
    parser.add_argument("--image-size", type=integer_at_least(1), default=224)
    parser.add_argument("--runs", type=integer_at_least(1), default=5)
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS, help="default: all")
    parser.add_argument("--profile", action="store_true", help="print each compressor's top kernels on one bucket")
    args = parser.parse_args()
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    print(f"device {device}, copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)\n")
    for model_name in args.models:
        torch.manual_seed(0)
        model, loss = model_and_loss(model_name, args.batch, args.image_size, device)
        elements = sum(p.numel() for p in model.parameters())
        tensors = sum(1 for _ in model.parameters())
        print(f"### {model_name}: {tensors} tensors, {elements:,} elements\n")
        print(f"| compressor | {' | '.join(f'{plan} (ms)' for plan in args.plans)} | buckets | floor (ms) |")
        print(f"|---|{'---|' * len(args.plans)}---|---|")
        profiles = []
        for compressor in args.compressors:
            cells, sent = [], 0
            for plan in args.plans:
                buckets, flats = buckets_of(model, loss, compressor, plan)
                seconds, sent = time_plan(compressor, buckets, flats, args.runs)
                cells.append(f"{1000 * seconds:.2f}")
            memory = USUAL.get(compressor, ("none", {}))[0]
            moved = 4 * elements + (8 * elements if memory != "none" else 0) + sent + 4 * elements
            print(
                f"| {compressor} | {' | '.join(cells)} | {len(buckets)} | {1000 * moved / bandwidth:.2f} |", flush=True
            )
            if args.profile:
                profiles.append((compressor, profile_plan(compressor, *buckets_of(model, loss, compressor, "single"))))
        print()
        for compressor, table in profiles:
            print(f"#### {model_name} {compressor}, one bucket\n\n```\n{table}\n```\n")


if __name__ == "__main__":
    main()
