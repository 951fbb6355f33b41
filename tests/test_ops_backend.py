"""megatron_video.ops with the extension forced on, forced off, and absent."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_video import ops
from megatron_video.ops import ENV_VAR, TokenIds, active_backend

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only


def _has_extension() -> bool:
    try:
        import megatron_video._C  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.filterwarnings("ignore:megatron_video._C has no kernels for device type 'meta'")
def test_env_switch_forces_either_path(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert active_backend("cpu") == "reference"
    ids = TokenIds(pos=torch.arange(7))
    ref = ops.block_mask_status(ids, ids, "causal", 3, 2)
    if not _has_extension():
        assert os.environ.get("MEGATRON_VIDEO_BUILD_EXT") == "0", (
            "megatron_video._C should have been built"
        )
        monkeypatch.setenv(ENV_VAR, "extension")
        with pytest.raises(RuntimeError, match="cannot be imported"):
            ops.dense_mask(ids, ids, "causal")
        return
    monkeypatch.setenv(ENV_VAR, "extension")
    assert active_backend("cpu") == "extension"
    assert torch.equal(ops.block_mask_status(ids, ids, "causal", 3, 2), ref)
    monkeypatch.setenv(ENV_VAR, "auto")
    assert active_backend("cpu") == "extension"
    assert active_backend("meta") == "reference"  # no kernels for meta tensors: the reference runs
    monkeypatch.setenv(ENV_VAR, "extension")
    with pytest.raises(RuntimeError, match="no kernels for device meta"):
        active_backend("meta")


def test_bad_env_value(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=r"MEGATRON_VIDEO_OPS \('fast'\) must be one of"):
        active_backend("cpu")


def test_package_works_without_extension():
    """A process where megatron_video._C cannot be imported: references run, one warning is issued."""
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["megatron_video._C"] = None  # makes `import megatron_video._C` raise ImportError
        import torch
        from megatron_video import ops
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ids = ops.TokenIds(side=torch.tensor([0, 1, 0, 1]), block=torch.tensor([0, 0, 1, 1]))
            a = ops.dense_mask(ids, ids, "teacher_forcing")
            s = ops.block_mask_status(ids, ids, "teacher_forcing", 2, 2)
            video = torch.arange(2 * 9 * 4, dtype=torch.float32).reshape(1, 2, 9, 2, 2)
            packed = ops.halo_scatter(video, [[0, 5], [4, 9]])
            back = ops.halo_gather_packed(packed.buffer, packed.shapes, [0, 1])
        assert ops.active_backend("cpu") == "reference"
        assert torch.equal(a, ops.dense_mask_reference(ids, ids, "teacher_forcing"))
        assert torch.equal(s, ops.block_mask_status_reference(ids, ids, "teacher_forcing", 2, 2))
        assert torch.equal(back, video)
        messages = [str(w.message) for w in caught if "megatron_video._C" in str(w.message)]
        assert len(messages) == 1 and "pure-PyTorch references" in messages[0], messages
        print("OK")
    """)
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
