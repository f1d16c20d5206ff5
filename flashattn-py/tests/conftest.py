"""pytest configuration: seeds torch before every test and makes ``helpers`` importable.

OMP_WAIT_POLICY=PASSIVE (unless set): torch's OpenMP threads otherwise spin between parallel
regions, and on a small machine shared with other work the naive reference computations then
run some 50x slower. It must be set before torch loads its OpenMP runtime, hence before the
import below. flashattn's own kernels use their own (rayon) pool and are unaffected.
"""

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield
