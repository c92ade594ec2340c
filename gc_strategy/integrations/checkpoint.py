"""The synchroniser's state in a checkpoint: nothing beside it where no rank keeps state of its
own, else one file per rank, written by every rank at once.

Without error feedback or compressor state (``compressor="none"``, ``fp16``, ``qsgd`` with no
memory) every rank's synchroniser state is the same small record (step, gradient order, plan), so
the checkpoint holds rank 0's, ``{"format": "shared", "state": ...}``, and nothing else is written,
as with ``ddp``. Error-feedback state is per rank and as large as the gradients, so gathering it
into the file rank 0 writes would make rank 0's memory and that file grow as ``W`` × the model (64
ranks with residual memory for a 1B-parameter model: 256 GB). Instead each rank writes its own
:meth:`~gc_strategy.sync.base.Synchronizer.state_dict` to ``FOLDER/rank<r>.pt`` and the
checkpoint holds a small manifest, ``{"format": "per_rank_files", "world_size": W}``. For a
Lightning checkpoint ``DIR/NAME.ckpt`` the folder is ``DIR.gc_state/NAME.ckpt/``, beside ``DIR``,
so that listing or globbing ``DIR`` finds only checkpoints, as with ``ddp``. On resume each rank reads its
own file; with another world size each rank reads the old ranks' files one at a time into the
running mean of :func:`~gc_strategy.sync.every_step.state.resharded`, so no rank holds more than two states at
once. Checkpoints that hold every rank's state gathered (``{"world_size": W, "ranks": [...]}``), or
whose files sit in ``DIR/NAME.ckpt.gc_state/``, still load. Paths go through fsspec, as Lightning's
own checkpoints do.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from fsspec.core import url_to_fs

from ..sync.base import Synchronizer

MANIFEST_FORMAT = "per_rank_files"
SHARED_FORMAT = "shared"
#: appended to a checkpoint folder's name to name the folder of its checkpoints' per-rank files
FOLDER_SUFFIX = ".gc_state"


def get_filesystem(path: str) -> Any:
    """The fsspec file system of ``path`` (local, or a URL's: ``s3://``, ``gs://``, ...)."""
    return url_to_fs(str(path))[0]


def state_folder(checkpoint_path: Any, saved: bool = False) -> str:
    """Where the per-rank files of the checkpoint ``DIR/NAME`` go: ``DIR.gc_state/NAME``, beside
    ``DIR`` so that ``DIR`` holds only checkpoints (``DIR/.gc_state/NAME`` where ``DIR`` is a root).
    A local path is resolved first, so that a checkpoint reached through a link (Lightning's
    ``save_last="link"``, a linked folder) finds the files of the one it points to. For a ``saved``
    checkpoint, the earlier ``DIR/NAME.gc_state`` where only that exists."""
    path = str(checkpoint_path)
    if "://" not in path:
        path = os.path.realpath(path)
    head, _, name = path.rpartition("/")
    is_root = not head or ("://" in head and "/" not in head.split("://", 1)[1])
    folder = f"{head}/{FOLDER_SUFFIX}/{name}" if is_root else f"{head}{FOLDER_SUFFIX}/{name}"
    if saved and not get_filesystem(folder).exists(folder) and get_filesystem(path).exists(f"{path}.gc_state"):
        return f"{path}.gc_state"
    return folder


def save_rank_states(synchronizer: Synchronizer, folder: str) -> dict[str, Any]:
    """Write this rank's state to ``folder`` where any rank keeps state of its own (call it on every
    rank); returns the manifest, which holds the state itself where no rank does."""
    state = synchronizer.state_dict()
    if not synchronizer.holds_rank_state(state):
        if synchronizer.checkpoint_rank == 0:  # an earlier save to the same path may have left files
            remove_rank_states(folder)
        return {"format": SHARED_FORMAT, "state": state}
    fs = get_filesystem(folder)
    fs.makedirs(folder, exist_ok=True)
    with fs.open(_rank_file(folder, synchronizer.checkpoint_rank), "wb") as f:
        torch.save(state, f)
    return {"format": MANIFEST_FORMAT, "world_size": synchronizer.checkpoint_world_size}


def load_rank_states(synchronizer: Synchronizer, saved: dict[str, Any], folder: str) -> None:
    """Restore this rank's state from a manifest and its ``folder``, or from gathered states
    (``{"world_size": W, "ranks": [state of rank 0, ...]}``, the format of earlier checkpoints);
    with another world size, from the old ranks' states read one at a time."""
    if saved.get("format") == SHARED_FORMAT:
        synchronizer.load_state_dict(saved["state"])
        return
    old_world_size = saved["world_size"]
    if saved.get("format") == MANIFEST_FORMAT:
        state_of = partial(_read, folder)
    else:
        state_of = saved["ranks"].__getitem__
    if old_world_size == synchronizer.checkpoint_world_size:
        synchronizer.load_state_dict(state_of(synchronizer.checkpoint_rank))
    else:
        synchronizer.load_states_of((state_of(rank) for rank in range(old_world_size)), old_world_size)


def remove_rank_states(folder: str) -> None:
    """Remove a checkpoint's per-rank files, and their parent folder once it holds no other's."""
    fs = get_filesystem(folder)
    if fs.exists(folder):
        fs.rm(folder, recursive=True)
    parent = folder.rpartition("/")[0]
    if parent.endswith(FOLDER_SUFFIX) and fs.exists(parent) and not fs.ls(parent):
        fs.rm(parent, recursive=True)


def _rank_file(folder: str, rank: int) -> str:
    return f"{folder}/rank{rank}.pt"


def _read(folder: str, rank: int) -> dict[str, Any]:
    path = _rank_file(folder, rank)
    fs = get_filesystem(path)
    if not fs.exists(path):
        raise FileNotFoundError(
            f"the checkpoint's compression state for rank {rank} is missing: {path} (it is "
            "written beside the checkpoint; copy the folder along with the checkpoint)"
        )
    with fs.open(path, "rb") as f:
        return torch.load(f, weights_only=True)
