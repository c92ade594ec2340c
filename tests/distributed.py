"""Run a function on several gloo ranks (forked processes) and collect what each returns."""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        # plain pickling copies tensor data (a torch queue would share memory with a dying process)
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report the worker's own traceback to the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int = 2, *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks; returns results by rank."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, queue)) for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors = []
        for _ in range(world_size):
            try:
                rank, status, value = queue.get(timeout=timeout)
            except queue_module.Empty:
                for p in procs:
                    p.kill()
                raise AssertionError(f"ranks did not finish within {timeout}s (hang?)") from None
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            else:
                results[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                errors.append(f"a rank did not exit within {timeout}s")
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
