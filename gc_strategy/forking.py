"""Forked processes and torch's CPU thread pool: the pool is renewed in a forked child before any
thread of the child can use it.

A forked child inherits the parent's thread pool without its threads, so torch marks the pool as
corrupt at the fork and replaces it at the child's first use (``caffe2::pthreadpool()``). That
replacement is not guarded against concurrent callers: where the first users are several threads
starting at once, as the autograd engine's device threads do at FSDP2's first backward (each sets
its number of intra-op threads), one thread may find the pool gone while another replaces it, and
the child aborts with "pool INTERNAL ASSERT FAILED ... Invalid thread pool!". A parent whose main
thread has run an intra-op parallel operation (a notebook that trained a model, a pytest process)
leaves its children in that state, and the ``*_fork`` strategies (Lightning's fork launcher) fork
such children. Setting the number of threads in the child right after the fork, on its one
thread, makes the replacement there.
"""

from __future__ import annotations

import os

import torch

_registered = False


def _renew_thread_pool() -> None:
    torch.set_num_threads(torch.get_num_threads())


def renew_thread_pool_after_fork() -> None:
    """Register, once per process, the renewal of torch's thread pool in every child it forks."""
    global _registered
    if not _registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_renew_thread_pool)
        _registered = True
