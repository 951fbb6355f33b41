"""Shared fixtures: worker pools of 4 and 8 gloo ranks.

The pools are session-scoped: started once (from a forkserver with torch and megatron preloaded)
and shared by every test module; each ``pool.run`` resets Megatron / topology state afterwards, and
a pool that saw a failure or a timeout is killed and restarted on its next use.
"""
import os

import pytest
import torch

from megatron_video.testing import WorkerPool

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def pool4():
    """4 ranks simulated as 2 nodes x 2 ranks (override per call with ``ranks_per_node=``)."""
    pool = WorkerPool(4, ranks_per_node=2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool8():
    """8 ranks simulated as 2 nodes x 4 ranks (override per call with ``ranks_per_node=``)."""
    pool = WorkerPool(8, ranks_per_node=4)
    yield pool
    pool.close()
