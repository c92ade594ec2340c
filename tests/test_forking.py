"""A forked child renews torch's thread pool on its one thread, right after the fork
(gc_strategy/forking.py): its first users may be several threads starting at once (FSDP2's first
backward starts the autograd engine's device threads), and torch's own replacement of the pool
inherited from the parent is not safe against them ("Invalid thread pool!")."""

import subprocess
import sys

import pytest

SCRIPT = """
import glob, os, sys
import torch
torch.set_num_threads(3)
(torch.ones(1 << 17) * 2).sum()  # the main thread has used the intra-op pool
if sys.argv[1] == "library":
    import gc_strategy
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the child counts its threads before it runs anything
    os.write(write, str(len(glob.glob(f"/proc/{os.getpid()}/task/*"))).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(read, 16).decode())
"""


def _threads_of_a_forked_child(imports: str) -> int:
    done = subprocess.run([sys.executable, "-c", SCRIPT, imports], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_a_forked_child_renews_the_thread_pool_before_it_runs_anything():
    """A parent with a pool of 3 threads: after ``import gc_strategy`` its forked child holds a
    renewed pool (its 2 workers beside the child's thread) before it runs anything; without the
    library the child holds its one thread, and its first users race to replace the pool."""
    assert _threads_of_a_forked_child("torch") == 1
    assert _threads_of_a_forked_child("library") == 3
