"""``megatron_video.testing``: the float64 oracles against torch's attention, the mask oracles
against their rules, ``model_parallel`` set-up and tear-down, and the rules on test imports (no
test module imports another; nothing outside ``megatron_video.testing`` imports it)."""

import ast
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_video.testing.masks import allowed, teacher_forcing_oracle, tile_status_oracle
from megatron_video.testing.oracles import attention_with_grads, random_qkv, softmax_attention

ROOT = Path(__file__).resolve().parents[1]


def test_oracle_equals_sdpa_and_zeroes_dead_rows():
    q, k, v, dout = random_qkv(2, 7, 4, 2, 8, seed=0, sk=9)
    allow = torch.rand(7, 9, generator=torch.Generator().manual_seed(1)) < 0.6
    allow[:, 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2),
        attn_mask=allow,
        scale=0.3,
    ).transpose(1, 2)
    out, lse = softmax_attention(q, k, v, allow, 0.3, return_lse=True)
    assert out.dtype == torch.float64 and (out - ref).abs().max() < 1e-12
    allow[3] = False  # a row with no visible key: zeros, -inf, zero gradients, never NaN
    out, dq, dk, dv = attention_with_grads(q, k, v, dout, allow, 0.3)
    _, lse = softmax_attention(q, k, v, allow, 0.3, return_lse=True)
    assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3])) and torch.isneginf(lse[..., 3]).all()
    assert torch.equal(dq[:, 3], torch.zeros_like(dq[:, 3]))
    assert not any(bool(t.isnan().any()) for t in (out, dq, dk, dv))
    sb = softmax_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), allow, 0.3, layout="sbhd"
    )
    assert (sb - out.transpose(0, 1).reshape(7, 2, 32)).abs().max() < 1e-12
    with pytest.raises(ValueError, match=r"layout \('bhsd'\)"):
        softmax_attention(q, k, v, layout="bhsd")


def test_mask_oracles_follow_their_rules():
    ids = torch.arange(10)
    assert torch.equal(allowed("causal", 10), torch.ones(10, 10, dtype=torch.bool).tril())
    assert allowed("block_causal", 10, block=3)[2, 5].item() is False
    assert allowed("block_causal", 10, block=3)[5, 3].item() is True
    packed = allowed("packed", ids, cu=[0, 4, 8])
    assert packed[1, 3] and not packed[4, 3] and not packed[8:].any() and not packed[:, 8:].any()
    assert allowed("packed_block", ids, cu=[0, 4, 8], inner_block=2)[5, 7].item() is False
    win = allowed("window", 10, window=2)
    assert win[5, 5] and win[5, 4] and not win[5, 3] and not win[4, 5]
    with pytest.raises(ValueError, match=r"kind \('diagonal'\)"):
        allowed("diagonal", 4)
    tf = teacher_forcing_oracle(2, 1, 1)  # [c0 c1 n0 n1]
    assert tf.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [1, 0, 0, 1]]
    assert tile_status_oracle(tf, 2, 2).tolist() == [[1, 0], [1, 1]]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_model_parallel_sets_up_and_destroys_even_on_error():
    from megatron.core import parallel_state as ps

    from megatron_video.testing.parallel import model_parallel, video_parallel

    created = not dist.is_initialized()
    if created:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    try:
        with model_parallel(seed=3):
            assert ps.model_parallel_is_initialized()
            assert ps.get_tensor_model_parallel_world_size() == 1
        assert not ps.model_parallel_is_initialized()
        with pytest.raises(RuntimeError, match="boom"):
            with video_parallel(1, 1, ranks_per_node=1) as groups:
                assert groups.cp_size == 1
                raise RuntimeError("boom")
        assert not ps.model_parallel_is_initialized()
    finally:
        if created:
            dist.destroy_process_group()


def test_testing_imports_without_pytest_or_megatron():
    code = (
        "import sys; import megatron_video.testing, megatron_video.testing.oracles, "
        "megatron_video.testing.masks, megatron_video.testing.parallel, "
        "megatron_video.testing.configs; "
        "print(sorted(m for m in ('pytest', 'megatron', 'hypothesis') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_no_test_module_imports_another_and_only_testing_imports_testing():
    local = {p.stem for p in (ROOT / "tests").glob("*.py")}
    bad = [
        (p.name, m)
        for p in sorted((ROOT / "tests").glob("*.py"))
        for m in _imports(p)
        if m.split(".")[0] in local | {"tests"}
    ]
    assert not bad, f"test modules import other test modules (use megatron_video.testing): {bad}"
    pkg = ROOT / "megatron_video"
    users = [
        (str(p.relative_to(ROOT)), m)
        for p in sorted(pkg.rglob("*.py"))
        if "testing" not in p.relative_to(pkg).parts
        for m in _imports(p)
        if m == "megatron_video.testing" or m.startswith("megatron_video.testing.")
    ]
    assert not users, f"library modules import megatron_video.testing: {users}"


def test_live_tensors_counts_a_storage_resized_in_place_once():
    """FSDP frees a gathered weight's storage with ``resize_(0)`` and re-allocates it in place (a
    new data pointer, no op reporting either): with ``resized`` the peak is the exact one."""
    import torch

    from megatron_video.testing.live_memory import LiveTensors

    def step():
        w = torch.empty(1000)  # 4,000 bytes, "gathered"
        st = w.untyped_storage()
        st.resize_(0)  # freed in place
        z = torch.zeros(1000)  # 4,000 bytes, perhaps where w was
        st.resize_(4000)  # gathered again: a new pointer
        w.fill_(1.0)  # an op returns it: seen again
        x = torch.ones(250)  # 1,000 bytes
        return w, z, x

    with LiveTensors(resized=True) as exact:
        step()
    with LiveTensors() as plain:
        step()
    assert exact.peak == 9000
    assert plain.peak >= exact.peak  # the default may count a re-allocated storage twice
