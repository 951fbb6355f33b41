"""Wan in and out on the command line, export to ``WanPipeline``, CP sampling.

``megatron-video convert`` runs the two blocks of docs/wan.md as written: diffusers folder ->
checkpoint (TP = 2) -> folder is bit-identical, and the checkpoint loads under TP 2 on 4 gloo
ranks; bad input exits with status 2 naming the field. The exported transformer loads in
diffusers' ``WanPipeline`` (tiny random VAE, UMT5, tokenizer built here) and generates exactly the
original's frames. ``sample_wan`` (T2V and I2V, with guidance) equals the single-process flow
sampler with diffusers' model as the velocity (float64, 1e-5: diffusers' fp32 islands) and, under
U2 x R2, our CP = 1 run (1e-10).
"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

from megatron_video.testing.doc_blocks import launch_blocks  # noqa: E402
from megatron_video.testing.wan import tiny_wan_pipeline, tiny_wan_transformer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = launch_blocks((ROOT / "docs" / "wan.md").read_text())
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _cli(tokens) -> int:
    from megatron_video.training.cli import main

    assert tokens[0] == "megatron-video", tokens
    return main(tokens[1:])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The documented commands run in a folder holding ``wan_dir`` (a tiny random Wan)."""
    import os

    root = tmp_path_factory.mktemp("wan_cli")
    model = tiny_wan_transformer()
    model.save_pretrained(root / "wan_dir", safe_serialization=True)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        codes = [_cli(BLOCKS[name]) for name in ("wan-convert-in", "wan-convert-out")]
    finally:
        os.chdir(cwd)
    assert codes == [0, 0]
    return root, model


def test_cli_round_trip_is_bit_identical(converted):
    import json

    root, model = converted
    a, b = model.state_dict(), load_file(str(root / "wan_back" / WEIGHTS))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    meta = json.loads((root / "ckpt" / "iter_0000000" / "diffusers_config.json").read_text())
    assert meta["tensor_model_parallel_size"] == 2


def _load_under_tp2(root: str) -> list:
    """Rank's max |checkpoint - from_diffusers| over its TP 2 shards (0 when they load)."""
    import json

    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import initialize_model_parallel
    from megatron_video.models.wan import WanModel, from_diffusers, get_wan_layer_spec
    from megatron_video.models.wan.interop import wan_config

    initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    path = Path(root) / "ckpt" / "iter_0000000"
    full = json.loads((path / "diffusers_config.json").read_text())["diffusers_config"]
    cfg = wan_config(full, params_dtype=torch.float32)
    fresh = WanModel(cfg, layer_spec=get_wan_layer_spec(cfg))
    loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, str(path))["model"]
    fresh.load_state_dict(loaded, strict=False)
    want = dict(from_diffusers(str(Path(root) / "wan_dir")).named_parameters())
    got = dict(fresh.named_parameters())
    assert got.keys() == want.keys()
    sharded = [n for n, p in got.items() if getattr(p, "tensor_model_parallel", False)]
    assert sharded, "nothing is TP-sharded"
    return [max((got[n] - want[n]).abs().max().item() for n in got), len(sharded)]


def test_tp2_checkpoint_loads_under_tp2(converted, pool4):
    root, _ = converted
    for diff, sharded in pool4.run(_load_under_tp2, str(root)):
        assert diff == 0.0 and sharded > 0


@pytest.mark.parametrize(
    "args,match",
    [
        (
            ["--to-diffusers", "ckpt", "--output", "x", "--tensor-model-parallel-size", "2"],
            "--tensor-model-parallel-size applies to --from-diffusers only",
        ),
        (
            ["--from-diffusers", "wan_dir", "--output", "c", "--tensor-model-parallel-size", "3"],
            r"tensor_model_parallel_size \(3\) must be a positive divisor of num_attention_heads",
        ),
        (["--from-diffusers", "nowhere", "--output", "c"], "must be a diffusers model folder"),
        (["--to-diffusers", "nowhere", "--output", "x"], "latest_checkpointed_iteration.txt"),
    ],
    ids=["tp_on_export", "tp_not_dividing_heads", "no_folder", "no_checkpoint"],
)
def test_cli_bad_input_exits_2_naming_the_field(converted, monkeypatch, capsys, args, match):
    import re

    monkeypatch.chdir(converted[0])
    assert _cli(["megatron-video", "convert"] + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-video: error:") and re.search(match, err), err


def _generate(pipe):
    return pipe(
        prompt="a red cat on the moon",
        negative_prompt="blue dog",
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=3.0,
        max_sequence_length=8,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).frames


def test_export_loads_in_wan_pipeline_and_generates(tmp_path):
    import shutil

    from diffusers import WanPipeline

    from megatron_video.models.wan.convert import (
        checkpoint_to_diffusers,
        diffusers_to_checkpoint,
        load_wan_transformer,
    )

    pipe = tiny_wan_pipeline()
    pipe.save_pretrained(tmp_path / "pipe")
    diffusers_to_checkpoint(tmp_path / "pipe" / "transformer", tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "pipe" / "transformer")
    checkpoint_to_diffusers(tmp_path / "ckpt", tmp_path / "pipe" / "transformer")
    transformer = load_wan_transformer(tmp_path / "pipe" / "transformer")
    loaded = WanPipeline.from_pretrained(tmp_path / "pipe", transformer=transformer)
    frames = _generate(loaded)
    assert frames.shape == (1, 5, 3, 16, 16) and frames.isfinite().all()
    assert torch.equal(frames, _generate(pipe))  # exactly the original's video


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------
STEPS, SHIFT, GUIDANCE = 3, 3.0, 2.5


I2V = dict(image_dim=24, added_kv_proj_dim=64)
KINDS = ("t2v", "i2v")


def _sample_inputs(kind: str):
    """``(noise, text, negative text, image or None)``; I2V text is 512 tokens (diffusers' split)."""
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn(2, 4, 4, 4, 6, generator=gen, dtype=torch.float64)  # 24 tokens
    L = 512 if kind == "i2v" else 7
    text = torch.randn(2, L, 32, generator=gen, dtype=torch.float64)
    negative = torch.randn(1, L, 32, generator=gen, dtype=torch.float64)
    image = torch.randn(2, 5, 24, generator=gen, dtype=torch.float64) if kind == "i2v" else None
    return noise, text, negative, image


def _wan(kind: str):
    return tiny_wan_transformer(**(I2V if kind == "i2v" else {})).double()


def _sample_ours(kind: str, hier=None):
    from megatron_video.generation.wan_sampling import sample_wan
    from megatron_video.models.wan import from_diffusers

    model = from_diffusers(_wan(kind), cp_comm_type="a2a+p2p" if hier else "p2p")
    noise, text, negative, image = _sample_inputs(kind)
    with torch.no_grad():
        return sample_wan(
            model,
            noise,
            text,
            image,
            negative_encoder_hidden_states=negative,
            guidance_scale=GUIDANCE,
            num_steps=STEPS,
            shift=SHIFT,
        )


def _sample_rank(kind: str):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import initialize_model_parallel

    initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    model_parallel_cuda_manual_seed(0)
    return _sample_ours(kind, [2, 2])


@pytest.fixture(scope="module")
def sampled_cp1():
    from megatron_video.models.wan.convert import _one_process

    with _one_process():
        return {kind: _sample_ours(kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_sample_wan_equals_single_process_sampler_on_diffusers(sampled_cp1, kind):
    from megatron_video.diffusion.cfg import guided_denoise
    from megatron_video.diffusion.samplers import flow_euler_sampler

    model = _wan(kind)
    noise, text, negative, image = _sample_inputs(kind)

    def velocity(x, t, cond):
        img = None if image is None else torch.cat([image] * (x.shape[0] // image.shape[0]))
        return model(x, t * 1000, cond, encoder_hidden_states_image=img, return_dict=False)[0]

    with torch.no_grad():
        want = flow_euler_sampler(
            lambda x, t, c: guided_denoise(velocity, x, t, c, negative, GUIDANCE),
            noise,
            text,
            num_steps=STEPS,
            shift=SHIFT,
        )
    err = ((sampled_cp1[kind] - want).norm() / want.norm()).item()
    assert err <= 1e-5, err


@pytest.mark.parametrize("kind", KINDS)
def test_sample_wan_u2xr2_equals_cp1(pool4, sampled_cp1, kind):
    for rank, got in enumerate(pool4.run(_sample_rank, kind)):
        err = ((got - sampled_cp1[kind]).norm() / sampled_cp1[kind].norm()).item()
        assert err <= 1e-10, (rank, err)


# ---------------------------------------------------------------------------------------------
# any CP size: 18 tokens (3 latent frames x 2 x 3) at CP 4, padded to 20
# ---------------------------------------------------------------------------------------------
def _sample_uneven(hier=None, leak=False):
    """``sample_wan`` with CFG on 3 latent frames (18 tokens), plain and with a TI2V first-frame
    latent; ``leak``: the padding deliberately unmasked (must differ from CP 1)."""
    from megatron_video.generation import wan_sampling
    from megatron_video.models.wan import from_diffusers

    model = from_diffusers(_wan("t2v"), cp_comm_type="a2a+p2p" if hier else "p2p")
    gen = torch.Generator().manual_seed(4)
    noise = torch.randn(1, 4, 3, 4, 6, generator=gen, dtype=torch.float64)
    text, negative = torch.randn(2, 1, 7, 32, generator=gen, dtype=torch.float64)
    first = torch.randn(1, 4, 1, 4, 6, generator=gen, dtype=torch.float64)
    kw = dict(negative_encoder_hidden_states=negative, guidance_scale=GUIDANCE, num_steps=STEPS)
    if leak:
        import types

        from megatron_video.attention import masks

        real, wan_sampling.masks = (
            wan_sampling.masks,
            types.SimpleNamespace(packed=lambda cu: masks.full()),
        )
    try:
        with torch.no_grad():
            return [
                wan_sampling.sample_wan(model, noise, text, shift=SHIFT, **kw),
                wan_sampling.sample_wan(model, noise, text, image=first, shift=SHIFT, **kw),
            ]
    finally:
        if leak:
            wan_sampling.masks = real


def _sample_uneven_rank(U, R):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import initialize_model_parallel

    hier = [U, R] if U > 1 and R > 1 else None
    kw = dict(hierarchical_context_parallel_sizes=hier) if hier else {}
    initialize_model_parallel(context_parallel_size=U * R, **kw)
    model_parallel_cuda_manual_seed(0)
    return _sample_uneven(hier), _sample_uneven(hier, leak=True)


@pytest.mark.parametrize("U,R", [(2, 2), (1, 4)], ids=["U2xR2", "R4"])
def test_sample_wan_at_a_cp_size_not_dividing_the_tokens_equals_cp1(pool4, U, R):
    from megatron_video.models.wan.convert import _one_process

    with _one_process():
        want = _sample_uneven()
    for rank, (got, leak) in enumerate(pool4.run(_sample_uneven_rank, U, R)):
        for g, lk, w in zip(got, leak, want):
            assert g.shape == w.shape == (1, 4, 3, 4, 6)
            err = ((g - w).norm() / w.norm()).item()
            assert err <= 1e-10, (rank, err)
            assert ((lk - w).norm() / w.norm()).item() > 1e-6, rank  # padding must be masked
