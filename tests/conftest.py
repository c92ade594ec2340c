import os
import sys
from pathlib import Path

import pytest
import torch

# the helpers and workers in this folder (models.py, ft_worker.py, ...), for the tests in its subfolders
sys.path.insert(0, str(Path(__file__).resolve().parent))

# One thread per rank: two ranks share this machine's cores, and oversubscription only adds noise.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
