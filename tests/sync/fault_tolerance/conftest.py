import contextlib
import os
import signal

import pytest
from ft_groups import STARTED

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse's log (native, past pytest's capture): warnings only


@pytest.fixture(autouse=True)
def _groups_end_with_their_test():
    yield
    while STARTED:  # every process of each group, by its process group id (torchrun's workers too)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(STARTED.pop().pid, signal.SIGKILL)


@pytest.fixture
def lighthouse():
    """torchft's lighthouse on loopback: a quorum as soon as the live groups asked (or after 0.5 s)."""
    coordination = pytest.importorskip("torchft.coordination")
    server = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=500)
    yield server.address()
    server.shutdown()
