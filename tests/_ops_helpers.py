"""Set-up shared by the ``megatron_video.ops`` tests (test_ops_halo, test_ops_masks, test_ops_cuda)."""
import os

import pytest
import torch

from megatron_video.ops import TokenIds


@pytest.fixture(scope="module", autouse=True)
def extension():
    """The compiled module; its absence fails these tests unless the build was switched off."""
    try:
        import megatron_video._C as ext
    except ImportError as exc:
        if os.environ.get("MEGATRON_VIDEO_BUILD_EXT") == "0":
            pytest.skip("extension not built (MEGATRON_VIDEO_BUILD_EXT=0); reference path covered elsewhere")
        raise AssertionError(f"megatron_video._C is not importable: {exc}") from exc
    return ext


def rank_major_teacher_forcing_ids(P: int, F: int, S: int, nb: int) -> TokenIds:
    """Model-sized token ids: rank-major teacher forcing over ``P`` ranks, ``F`` frames of ``S``
    tokens, ``nb`` frames per block (each rank's clean half, then its noisy half)."""
    side, frame = [], []
    for r in range(P):
        fr = torch.arange(r * F // P, (r + 1) * F // P).repeat_interleave(S).tolist()
        side += [0] * len(fr) + [1] * len(fr)
        frame += fr * 2
    return TokenIds.from_frames(torch.tensor(frame), nb, side=torch.tensor(side), pos=torch.arange(len(side)))
