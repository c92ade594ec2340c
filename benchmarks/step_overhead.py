"""The synchroniser's overhead at world size 1: plain training against synchronised training, on one
GPU (NCCL; what the side stream gains) or on the CPU (gloo; what each compressor's passes cost).

A torchvision ResNet (``--model``, ``--image-size``) or BERT-base (``--model bert-base``, masked
LM on 128 tokens), batch ``--batch``, SGD, the forward under bf16 autocast with ``--autocast
bf16``, trains with: no synchronisation at all (``plain``), torch's DistributedDataParallel
(``ddp``) alone and with torch's fp16, bf16 and PowerSGD (rank 4) communication hooks, and the
gradient synchroniser over fused buckets (``bucket_mb:25``): ``compressor=none`` and
``efsignsgd`` + residual memory, each with its exchanges on the side stream and on the compute
stream (CUDA), and any ``--compressors`` given as ``NAME`` or ``NAME+MEMORY`` with their default
options. One process holds every configuration (same initial weights); they run interleaved round by round, in
a new order each round (A B C ... C A B ...), so that clock and thermal drift hit all alike and no
configuration always follows the same one; a step is timed from its start to the
end of the optimizer step (``torch.cuda.synchronize`` on a GPU). Reported: median step time, its
ratio to ``plain``, and the exposed time (median minus plain's); ``plain, control`` is a second
copy of plain training, so its exposed time is the noise of the measurement. On a GPU,
``--profile`` then traces two steps of each configuration under torch's profiler
(:mod:`step_profile`): the device's busy and idle time within the step, the side stream's time,
the synchroniser's host time, and the CUDA runtime calls (launches, copies, host synchronisations).

    python benchmarks/step_overhead.py --rounds 10 --steps 20                     # ResNet-50 on the GPU
    python benchmarks/step_overhead.py --device cpu --model resnet18 --image-size 32 --batch 32 \
        --configs plain "gc none" --compressors topk+residual qsgd powersgd        # one CPU thread

``--against REV`` also runs every synchronised configuration with the package as it was at git
revision ``REV`` (extracted with ``git archive`` and imported beside this one), interleaved with
the rest in the same process: whether a change of the code changed its step times.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import functools
import importlib
import inspect
import io
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from cli import add_device_option, integer_at_least
from step_profile import profile_steps, table
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from torchvision import models

import gc_strategy
from gc_strategy import build_components

#: name -> (compressor, memory, fusion, side stream); None: no synchroniser
CONFIGS = {
    "plain": None,
    "plain, control": None,
    "ddp": None,
    "ddp fp16 hook": None,
    "ddp bf16 hook": None,
    "ddp powerSGD hook rank 4": None,
    "gc none": ("none", "none", "bucket_mb:25", True),
    "gc none, compute stream": ("none", "none", "bucket_mb:25", False),
    "gc efsignsgd": ("efsignsgd", "residual", "bucket_mb:25", True),
    "gc efsignsgd, compute stream": ("efsignsgd", "residual", "bucket_mb:25", False),
    "gc efsignsgd single bucket": ("efsignsgd", "residual", "single", True),
}


def package_at(revision: str) -> types.ModuleType:
    """The ``gc_strategy`` package as it was at git ``revision``, imported as ``gc_strategy_at_rev``
    from a temporary copy (its ``__init__`` is not run, so nothing registers twice with Lightning)."""
    root = Path(__file__).resolve().parents[1]
    try:
        archive = subprocess.run(
            ["git", "archive", revision, "gc_strategy"], cwd=root, capture_output=True, check=True
        ).stdout
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"--against {revision}: git archive failed: {error.stderr.decode().strip()}") from None
    folder = Path(tempfile.mkdtemp(prefix="gc_strategy_at_rev"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(folder)
    package = types.ModuleType("gc_strategy_at_rev")
    package.__path__ = [str(folder / "gc_strategy")]
    sys.modules[package.__name__] = package
    package.components = importlib.import_module(f"{package.__name__}.components")
    # where GradientSynchronizer lived: sync/every_step/synchronizer.py, earlier sync/every_step.py,
    # gradient_sync.py, engine.py
    homes = ("sync.every_step.synchronizer", "sync.every_step", "gradient_sync", "engine")
    home = next(h for h in homes if (folder / "gc_strategy" / (h.replace(".", "/") + ".py")).exists())
    synchronizer = importlib.import_module(f"{package.__name__}.{home}").GradientSynchronizer
    if "roles" in inspect.signature(synchronizer).parameters:
        package.GradientSynchronizer = synchronizer
    else:  # it took the roles one by one then
        package.GradientSynchronizer = lambda module, c, **options: synchronizer(
            module, c.compressor, c.memory, c.communicator, c.fusion, **options
        )
    return package


def build(
    name: str, roles: tuple | None, reference: nn.Module, package: types.ModuleType = gc_strategy
) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = copy.deepcopy(reference)
    keep = None
    if name.startswith("ddp"):
        on_gpu = next(model.parameters()).is_cuda
        # torch's PowerSGD hook waits on a collective inside a callback that runs on one of gloo's two
        # worker threads: two buckets' callbacks at once take both, and the step never ends. On the
        # CPU its DDP holds the model in one bucket.
        one_bucket = not on_gpu and "powerSGD" in name
        megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
        model = DistributedDataParallel(
            model,
            device_ids=[torch.cuda.current_device()] if on_gpu else None,
            bucket_cap_mb=megabytes if one_bucket else None,
        )
        if name != "ddp":
            model.register_comm_hook(*ddp_hook(name))
    elif roles is not None:
        compressor, memory, fusion, side, *options = roles
        c = package.components.build_components(compressor, memory, fusion=fusion, **(options[0] if options else {}))
        keep = package.GradientSynchronizer(model, c, side_stream=side)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), keep


def ddp_hook(name: str) -> tuple[object, object]:
    """(state, hook) of torch's own communication hook for DDP: fp16, bf16, or PowerSGD rank 4
    (its error feedback and warm start, as it ships; compressing from the third step)."""
    if name == "ddp fp16 hook":
        return None, default_hooks.fp16_compress_hook
    if name == "ddp bf16 hook":
        return None, default_hooks.bf16_compress_hook
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
    return state, powerSGD_hook.powerSGD_hook


def model_and_loss(name: str, batch: int, image_size: int, device: torch.device):
    """The model, and the loss of a fixed random batch for any copy of it: a torchvision ResNet on
    ``image_size`` images, or ``transformers``' BERT-base masked LM on 128 tokens."""
    if name == "bert-base":
        from transformers import BertConfig, BertForMaskedLM

        model = BertForMaskedLM(BertConfig()).to(device)
        ids = torch.randint(0, model.config.vocab_size, (batch, 128), device=device)
        return model, lambda copy_: copy_(input_ids=ids, labels=ids).loss
    model = getattr(models, name)(num_classes=1000).to(device)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    return model, lambda copy_: nn.functional.cross_entropy(copy_(x), y)


def compressor_config(spec: str) -> tuple[str, tuple]:
    """``NAME[+MEMORY][:OPTION=INTEGER,...]`` -> (configuration name, roles, compressor options)."""
    roles, _, listed = spec.partition(":")
    compressor, _, memory = roles.partition("+")
    options = {}
    for item in filter(None, listed.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key] = int(value)
        except ValueError:
            raise ValueError(f"option {item!r} is invalid; allowed: OPTION=INTEGER") from None
    return f"gc {spec}", (compressor, memory or "none", "bucket_mb:25", True, options)


def exposure_table(times: dict[str, list[list[float]]]) -> str:
    """Per configuration (``times``: seconds of each step, by round): the median step, its ratio
    to plain's and the exposed time (the difference of the medians), and the range of the
    exposed time over the rounds (each round's median against plain's in that round)."""
    plain = [statistics.median(steps) for steps in times["plain"]] if "plain" in times else None
    overall = statistics.median(step for steps in times["plain"] for step in steps) if plain is not None else None
    lines = [
        "| configuration | median step (ms) | / plain | exposed (ms) | rounds' range (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, rounds in times.items():
        median = statistics.median(step for steps in rounds for step in steps)
        if plain is None:
            lines.append(f"| {name} | {1000 * median:.2f} | - | - | - |")
            continue
        per_round = [1000 * (statistics.median(steps) - base) for steps, base in zip(rounds, plain)]
        lines.append(
            f"| {name} | {1000 * median:.2f} | {median / overall:.3f} | {1000 * (median - overall):.2f} | "
            f"{min(per_round):.2f} to {max(per_round):.2f} |"
        )
    return "\n".join(lines)


class Stopped(Exception):
    """Raised by SIGTERM in the warm-up or the rounds."""


def stop(signum: int, frame: object) -> None:
    raise Stopped


def progress(line: str) -> None:
    """A line on stderr at once: where a run cut at its time limit had got to."""
    print(line, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_option(parser)
    parser.add_argument("--model", default="resnet50", choices=["resnet18", "resnet50", "resnet101", "bert-base"])
    parser.add_argument("--image-size", type=integer_at_least(1), default=224)
    parser.add_argument("--batch", type=integer_at_least(1), default=64)
    parser.add_argument("--threads", type=integer_at_least(1), default=1, help="CPU threads (--device cpu)")
    parser.add_argument("--rounds", type=integer_at_least(1), default=10)
    parser.add_argument("--steps", type=integer_at_least(1), default=20)
    parser.add_argument("--warmup", type=integer_at_least(0), default=10)
    parser.add_argument(
        "--seconds",
        type=integer_at_least(0),
        default=0,
        help="start no round after this many seconds from the start, warm-up included (0: no limit; one round runs)",
    )
    parser.add_argument(
        "--configs",
        nargs="*",
        choices=list(CONFIGS),
        help="default: all (on the CPU, which has no side stream, all but the compute-stream rows)",
    )
    parser.add_argument(
        "--compressors",
        nargs="*",
        default=[],
        metavar="NAME[+MEMORY][:OPTION=INTEGER,...]",
        help="more synchronised configurations, e.g. topk+residual qsgd topk+residual:chunk=256",
    )
    parser.add_argument("--profile", action="store_true", help="trace two steps of each configuration (GPU only)")
    parser.add_argument("--against", metavar="REV", help="also run the synchronised configurations at git REV")
    parser.add_argument(
        "--autocast", choices=["none", "bf16"], default="none", help="run the forward under bf16 autocast"
    )
    args = parser.parse_args()
    begun = time.perf_counter()
    if args.profile and args.device != "cuda":
        parser.error("--profile traces the device's work; it needs --device cuda")
    if args.configs is None:
        args.configs = [name for name in CONFIGS if args.device == "cuda" or "compute stream" not in name]
    configs = {name: CONFIGS[name] for name in args.configs}
    for spec in args.compressors:
        try:
            name, roles = compressor_config(spec)
            build_components(*roles[:2], **roles[4])  # names, memories and options checked before any work
        except ValueError as error:
            parser.error(f"--compressors {spec}: {error}")
        configs[name] = roles
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(args.threads)
    # one process: an in-process store, no port to find free (a fixed one may be taken), and gloo on
    # the loopback interface, with no host name to resolve
    if not cuda:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    reference, loss_of = model_and_loss(args.model, args.batch, args.image_size, torch.device(args.device))
    runs = {name: build(name, roles, reference) for name, roles in configs.items()}
    if args.against:
        at_rev = package_at(args.against)
        for name, roles in list(configs.items()):
            if roles is not None:
                configs[f"{args.against}: {name}"] = roles
                runs[f"{args.against}: {name}"] = build(name, roles, reference, at_rev)
    times: dict[str, list[list[float]]] = {name: [] for name in configs}
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            loss = loss_of(model)
        loss.backward()
        optimizer.step()

    def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
        synchronize()
        start = time.perf_counter()
        train(model, optimizer)
        synchronize()
        return time.perf_counter() - start

    host: dict[str, list[float]] = {name: [] for name, (_, _, keep) in runs.items() if keep is not None}
    signal.signal(signal.SIGTERM, stop)  # ``timeout``'s: the rounds done are still reported
    rounds, profile = 0, args.profile
    try:
        started = time.perf_counter()
        for model, optimizer, _ in runs.values():
            for _ in range(args.warmup):
                step(model, optimizer)
        warmed = time.perf_counter() - started
        progress(f"{len(runs)} configurations warmed up ({args.warmup} steps each) in {warmed:.1f} s")
        started = time.perf_counter()
        while rounds < args.rounds and not (rounds and args.seconds and time.perf_counter() - begun > args.seconds):
            order = list(runs)
            random.Random(rounds).shuffle(order)  # no configuration always follows the same one
            for name in order:
                model, optimizer, keep = runs[name]
                times[name].append([])
                for _ in range(args.steps):
                    times[name][-1].append(step(model, optimizer))
                    if keep is not None:  # the synchroniser's host time in this step
                        host[name].append(keep.telemetry.last.encode_s + keep.telemetry.last.decode_s)
            rounds += 1
        progress(f"{rounds} rounds in {time.perf_counter() - started:.1f} s")
    except Stopped:
        progress(f"stopped by SIGTERM after {rounds} rounds; the round under way is left out")
        if not rounds:
            sys.exit(1)
        times = {name: samples[:rounds] for name, samples in times.items()}
        profile = False  # no time left to trace
    device = torch.cuda.get_device_name() if cuda else f"CPU, {args.threads} thread(s)"
    inputs = "128 tokens" if args.model == "bert-base" else f"{args.image_size}x{args.image_size}"
    print(
        f"\n{args.model}, {inputs}, batch {args.batch}, autocast {args.autocast}, {device}, "
        f"torch {torch.__version__}; "
        f"{rounds} rounds x {args.steps} steps, in a new order each round\n"
    )
    print(exposure_table(times))
    if profile:
        profiles = profile_steps({name: functools.partial(train, *runs[name][:2]) for name in configs})
        host_ms = {name: 1000 * statistics.median(samples) for name, samples in host.items()}
        print("\nTwo steps of each under torch's profiler, medians in ms (see benchmarks/step_profile.py)\n")
        print(table(profiles, host_ms))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
