import os

import pytest
import torch

# One thread per rank: two ranks share this machine's cores, and oversubscription only adds noise.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
