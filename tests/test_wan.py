"""Wan on Megatron against diffusers' ``WanTransformer3DModel`` (tiny random model, built here).

``diffusers_forward`` outputs and input gradients against diffusers' forward (float64 and fp32,
relative Frobenius error <= 1e-5: diffusers rounds its fp32 islands even in float64) at CP = 1
and on 4 gloo ranks at U2 x R2 (``a2a+p2p``), U4, R4 and TP2 x CP2, for T2V, I2V (512 text tokens,
image branch) and per-token timesteps; every layout equals our own CP = 1 run to 1e-10 in float64.
Swapping two RoPE axes or dropping the TP sum of the q / k norm makes the comparison fail.
"""

import contextlib
import functools
import math
import socket

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers")

TOL = 1e-5
B, C, F, H, W = 2, 4, 4, 4, 6  # latent; tokens (4, 2, 3) = 24 under patch (1, 2, 2)
TEXT_DIM, IMAGE_DIM, D = 32, 24, 64
KINDS = ("t2v", "i2v", "per_token")
DTYPES = {"float64": torch.float64, "float32": torch.float32}
LAYOUTS = {  # name: (tp, cp, cp_comm_type, hierarchical sizes, ranks per simulated node)
    "u2xr2": (1, 4, "a2a+p2p", [2, 2], 2),
    "u4": (1, 4, "a2a", None, 4),
    "r4": (1, 4, "p2p", None, 2),
    "tp2xcp2": (2, 2, "p2p", None, 2),  # TP inside a node, the CP ring across the two
}


def diffusers_model(kind: str, dtype):
    """Tiny random ``WanTransformer3DModel`` (2 layers, 4 heads x 16, text_dim 32); norms and
    biases perturbed so no weight is trivial. Same weights on every process (seeded)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    extra = dict(image_dim=IMAGE_DIM, added_kv_proj_dim=D) if kind == "i2v" else {}
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=C,
        out_channels=C,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=96,
        num_layers=2,
        cross_attn_norm=True,
        eps=1e-6,
        rope_max_seq_len=64,
        **extra,
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.to(dtype)


def inputs(kind: str, dtype):
    """``(hidden_states, timestep, encoder_hidden_states, image or None, upstream gradient)``."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, C, F, H, W, generator=gen, dtype=torch.float64)
    tokens = F * (H // 2) * (W // 2)
    t = (
        torch.rand(B, tokens, generator=gen, dtype=torch.float64) * 1000
        if kind == "per_token"
        else torch.tensor([999.0, 321.5], dtype=torch.float64)
    )
    text = torch.randn(B, 512 if kind == "i2v" else 7, TEXT_DIM, generator=gen, dtype=torch.float64)
    image = (
        torch.randn(B, 5, IMAGE_DIM, generator=gen, dtype=torch.float64) if kind == "i2v" else None
    )
    up = torch.randn(B, C, F, H, W, generator=gen, dtype=torch.float64)
    cast = [v if v is None else v.to(dtype).requires_grad_(True) for v in (x, t, text, image)]
    return cast, up.to(dtype)


def run(forward, kind: str, dtype) -> dict:
    """Output and input gradients of ``forward(x, t, text, image)`` under the loss ``<out, up>``."""
    (x, t, text, image), up = inputs(kind, dtype)
    out = forward(x, t, text, image)
    (out * up).sum().backward()
    res = dict(out=out.detach(), dx=x.grad, dt=t.grad, dtext=text.grad)
    if image is not None:
        res["dimage"] = image.grad
    return {k: v.double().clone() for k, v in res.items()}


def ours(model, kind, dtype) -> dict:
    from megatron_video.models.wan import diffusers_forward

    return run(lambda x, t, text, image: diffusers_forward(model, x, t, text, image), kind, dtype)


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def errors(got: dict, want: dict) -> dict:
    assert got.keys() == want.keys()
    return {k: rel(got[k], want[k]) for k in want}


def _sinusoid_float64(
    timesteps,
    embedding_dim,
    flip_sin_to_cos=False,
    downscale_freq_shift=1,
    scale=1,
    max_period=10000,
):
    """diffusers' ``get_timestep_embedding`` computed in float64 instead of fp32."""
    half = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float64)
    emb = scale * timesteps[:, None].double() * torch.exp(exponent / (half - downscale_freq_shift))
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    return torch.nn.functional.pad(emb, (0, embedding_dim % 2))


@functools.lru_cache(maxsize=None)
def reference(kind: str, dtype_name: str, float64_sinusoid: bool = False) -> dict:
    """diffusers' forward; ``float64_sinusoid``: with its timestep sinusoid in float64 (its one
    fp32 island that the timestep gradient amplifies: ``d sin(t f) / dt`` at t ~ 1000)."""
    from unittest import mock

    from diffusers.models import embeddings

    dtype = DTYPES[dtype_name]
    model = diffusers_model(kind, dtype)
    patch = (
        mock.patch.object(embeddings, "get_timestep_embedding", _sinusoid_float64)
        if float64_sinusoid
        else contextlib.nullcontext()
    )
    with patch:
        return run(
            lambda x, t, text, image: model(x, t, text, image, return_dict=False)[0], kind, dtype
        )


def diffusers_errors(got: dict, kind: str, dtype_name: str) -> dict:
    """Relative errors against diffusers; in float64 the timestep gradient against diffusers
    with a float64 sinusoid (stock diffusers' fp32 sinusoid alone is ~2e-5 off there)."""
    err = errors(got, reference(kind, dtype_name))
    if dtype_name == "float64":
        err["dt"] = errors(got, reference(kind, dtype_name, True))["dt"]
    return err


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron_1():
    """One-process gloo group + Megatron parallel state (TP = CP = 1), torn down if made here."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import ensure_cpu_mode, initialize_model_parallel

    ensure_cpu_mode()
    created_pg = not dist.is_initialized()
    if created_pg:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    created_ps = not ps.model_parallel_is_initialized()
    if created_ps:
        initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    yield
    if created_ps:
        ps.destroy_model_parallel()
    if created_pg:
        dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def _ours_cp1(kind: str, dtype_name: str) -> dict:
    from megatron_video.models.wan import from_diffusers

    dtype = DTYPES[dtype_name]
    return ours(from_diffusers(diffusers_model(kind, dtype)), kind, dtype)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_cp1_matches_diffusers(megatron_1, kind, dtype_name):
    err = diffusers_errors(_ours_cp1(kind, dtype_name), kind, dtype_name)
    assert max(err.values()) <= TOL, err


def test_swapped_rope_axes_fail(megatron_1, monkeypatch):
    """Rows of the h and w axes exchanged (a grid with H' != W'): far off diffusers."""
    from megatron_video.models.wan import from_diffusers, rope

    original = rope.token_thw
    monkeypatch.setattr(rope, "token_thw", lambda ids, g: original(ids, g)[:, [0, 2, 1]])
    got = ours(from_diffusers(diffusers_model("t2v", torch.float64)), "t2v", torch.float64)
    err = errors(got, reference("t2v", "float64"))
    assert err["out"] > 1e-3, err


# ---------------------------------------------------------------------------------------------
# Four gloo ranks
# ---------------------------------------------------------------------------------------------
def _rank_case(layout: str, kind: str, dtype_name: str, drop_tp_sum: bool = False) -> dict:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import initialize_model_parallel
    from megatron_video.models.wan import from_diffusers
    from megatron_video.models.wan import layer as wan_layer

    tp, cp, comm_type, hier, _ = LAYOUTS[layout]
    initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        hierarchical_context_parallel_sizes=hier,
    )
    model_parallel_cuda_manual_seed(0)
    if drop_tp_sum:
        wan_layer.tp_sum = lambda x, group: x
    try:
        dtype = DTYPES[dtype_name]
        model = from_diffusers(diffusers_model(kind, dtype), cp_comm_type=comm_type)
        return ours(model, kind, dtype)
    finally:
        wan_layer.tp_sum = wan_layer.__dict__["_tp_sum_impl"]


CASES = [(layout, kind, dt) for layout in LAYOUTS for kind in KINDS for dt in DTYPES]


@pytest.mark.parametrize("layout,kind,dtype_name", CASES, ids=["-".join(c) for c in CASES])
def test_layouts_match_diffusers_and_cp1(pool4, megatron_1, layout, kind, dtype_name):
    per_rank = pool4.run(_rank_case, layout, kind, dtype_name, ranks_per_node=LAYOUTS[layout][4])
    for rank, got in enumerate(per_rank):
        err = diffusers_errors(got, kind, dtype_name)
        assert max(err.values()) <= TOL, (rank, err)
        if dtype_name == "float64":
            own = errors(got, _ours_cp1(kind, dtype_name))
            assert max(own.values()) <= 1e-10, (rank, own)


def test_dropping_the_tp_sum_of_the_qk_norm_fails(pool4):
    per_rank = pool4.run(_rank_case, "tp2xcp2", "t2v", "float64", True)
    err = errors(per_rank[0], reference("t2v", "float64"))
    assert err["out"] > 1e-3, err
