"""A function on several gloo ranks forked from this process: the one helper that the advisor's
measurements (:mod:`gc_strategy.tools.contention`), the benchmarks and the tests run ranks with."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes forked from this one, one thread
    each, in one gloo process group; their results in rank order. ``fn`` may be a closure over
    objects built before the call (the fork copies them). A rank that raises makes this raise a
    ``RuntimeError`` naming it, with its traceback; a wait of ``timeout`` seconds with no rank
    reporting raises one naming the ranks that did not. The other ranks are then stopped rather
    than left waiting in a collective."""
    context = torch.multiprocessing.get_context("fork")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        processes = [
            context.Process(target=_rank, args=(rank, world_size, init_file, fn, args, queue))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        results, failed = {}, None
        try:
            for _ in processes:
                try:
                    rank, error, value = queue.get(timeout=timeout)
                except Empty:
                    waiting = sorted(set(range(world_size)) - set(results))
                    failed = f"ranks {waiting} reported nothing within {timeout:g} s"
                    break
                if error is not None:
                    failed = f"rank {rank} failed: {error}"
                    break
                results[rank] = pickle.loads(value)
        finally:
            for process in processes:
                process.join(60 if failed is None else 0)
                if process.is_alive():
                    process.kill()
                    process.join()
    if failed is not None:
        raise RuntimeError(failed)
    return [results[rank] for rank in range(world_size)]


def _rank(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        # plain pickling copies tensor data (a torch queue would share memory with a dying process)
        result = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to run_ranks, which raises it with the rank
        queue.put((rank, traceback.format_exc(), None))
        return
    queue.put((rank, None, result))
    dist.barrier()  # a rank that tore its sockets down while a peer still connects a group would fail that peer
    dist.destroy_process_group()
