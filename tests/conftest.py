"""Shared fixtures: worker pools of 4 and 8 gloo ranks; the compiled extension (``extension``).

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


@pytest.fixture(scope="module")
def extension():
    """The compiled module; its absence fails the tests using it unless the build was switched off."""
    try:
        import megatron_video._C as ext
    except ImportError as exc:
        if os.environ.get("MEGATRON_VIDEO_BUILD_EXT") == "0":
            pytest.skip(
                "extension not built (MEGATRON_VIDEO_BUILD_EXT=0); reference path covered elsewhere"
            )
        raise AssertionError(f"megatron_video._C is not importable: {exc}") from exc
    return ext
