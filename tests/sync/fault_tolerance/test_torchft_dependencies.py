"""What fault tolerance takes from torchft beyond its public API, pinned: a change in any of it
fails here, naming what to read again (gc_strategy/sync/fault_tolerance/).

- ``ProcessGroupGloo._create_pg`` builds gloo's process group through the module's
  ``BaseProcessGroupGloo`` and calls its deprecated ``_set_sequence_number_for_group``, which
  ``quiet_torchft`` makes a no-op there (torchft_setup.py); ``abortable_gloo`` overrides it to hold
  the connections the construction opens (abort.py).
- ``ProcessGroupWrapper.parent`` and ``configure``: a new process group object at every
  reconfiguration, which ``Quorum.start`` takes as "the quorum changed" (quorum.py).
- ``Manager.state_dict`` and ``load_state_dict``: the rounds' counters, which ``Quorum.start``
  puts back where a healing transfer failed on one rank of a group (quorum.py).
- ``HTTPTransport.__init__`` and ``address``: its server (``_server``), whose socket gives the
  advertised port and whose request handler class is made quiet (torchft_setup.py).

Each is read from the installed torchft and compared with the source it was written against
(torchft 0.2). The lighthouse's new quorum id after a failed commit, which makes every group
configure a new process group after an abort (abort.py), is native code: the abort's tests
(test_failure_detection.py) fail where it stops."""

import subprocess
import sys

import pytest
from pinned_source import assert_unchanged

torchft = pytest.importorskip("torchft")

from torchft.checkpointing.http_transport import HTTPTransport  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo, ProcessGroupWrapper  # noqa: E402

#: the first 16 hex digits of the sha256 of each piece's source, as fault tolerance was written against it
PINNED = {
    "ProcessGroupGloo._create_pg": (ProcessGroupGloo._create_pg, "40671a44edfe42a4"),
    "ProcessGroupWrapper.parent": (ProcessGroupWrapper.parent.fget, "7ad1e4350469fd34"),
    "ProcessGroupWrapper.configure": (ProcessGroupWrapper.configure, "f6fb736622be821f"),
    "Manager.state_dict": (Manager.state_dict, "b1454956641120fe"),
    "Manager.load_state_dict": (Manager.load_state_dict, "cd5fd99afbd19452"),
    "HTTPTransport.__init__": (HTTPTransport.__init__, "ad10773ec6b9ee90"),
    "HTTPTransport.address": (HTTPTransport.address, "6885f24ddc205e91"),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_the_torchft_code_fault_tolerance_depends_on_is_unchanged(name):
    where = "gc_strategy/sync/fault_tolerance/ (this file's docstring says what each piece is used for)"
    assert_unchanged("torchft", name, *PINNED[name], where)


RECONFIGURED = """
from datetime import timedelta
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
group = ProcessGroupGloo(timeout=timedelta(seconds=5))
group.configure(f"127.0.0.1:{store.port}/first", "replica", 0, 1)
first = group.parent
group.configure(f"127.0.0.1:{store.port}/second", "replica", 0, 1)
print(group.parent is not first)
"""


def test_a_reconfigured_process_group_is_a_new_object():
    """What ``Quorum.start`` reads as "the quorum changed", on a real store (in a process of its
    own: torchft's threads stay out of the processes later tests fork from this one)."""
    done = subprocess.run([sys.executable, "-c", RECONFIGURED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
