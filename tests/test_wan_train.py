"""Training Wan (``model.family`` ``wan`` / ``wan_ar``, training/families/wan.py), float64.

* One step of the family's own pieces (``transformer_config`` / ``build_model`` with
  ``model.init_from`` a tiny diffusers folder, ``make_batches`` on latent shards,
  ``make_objective``) on 4 gloo ranks: loss and every parameter gradient (summed over CP as
  Megatron's DDP does, TP shards gathered) at U2xR2, U4, R4 and TP2xCP2 equal CP = 1; ``wan_ar``
  (Balanced SP teacher forcing) at SP = 4 equals SP = 1.
* CP = 1 equals the explicit flow-matching loss on diffusers' own ``WanTransformer3DModel``.
* ``init_from`` a converted dist-checkpoint gives the diffusers folder's weights.
* The config rules: ``ValueError`` naming the field.
"""

import math

import pytest
import torch

pytest.importorskip("diffusers")

from megatron_video.testing.wan import (  # noqa: E402
    save_tiny_wan_transformer,
    tiny_wan_config,
    write_random_latent_shards,
)

LAYOUTS = {  # (TP, U, R, ranks per simulated node)
    "reference": (1, 1, 1, 4),
    "u2xr2": (1, 2, 2, 2),
    "u4": (1, 4, 1, 4),
    "r4": (1, 1, 4, 2),
    "tp2xcp2": (2, 1, 2, 2),
}
CASES = [("wan", k) for k in ("u2xr2", "u4", "r4", "tp2xcp2")] + [
    ("wan_ar", k) for k in ("u2xr2", "u4")
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Latent shards and a tiny diffusers Wan folder of ``tiny_wan_config``'s sizes."""
    root = tmp_path_factory.mktemp("wan_train")
    cfg = tiny_wan_config("wan", root, root / "shards")
    write_random_latent_shards(cfg, root / "shards")
    save_tiny_wan_transformer(root / "transformer", cfg)
    return root


def _config(family: str, root, layout: str):
    tp, U, R, rpn = LAYOUTS[layout]
    cfg = tiny_wan_config(
        family,
        root,
        root / "shards",
        tensor_model_parallel_size=tp,
        context_parallel_size=U * R,
        ulysses_size=U,
        ring_size=R,
        ranks_per_node=rpn,
    )
    cfg.model.init_from = str(root / "transformer")
    return cfg


def _float64(mb):
    for k, v in vars(mb).items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            setattr(mb, k, v.double())
    return mb


def _full_grads(model, groups) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_video.parallel import comm

    out = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        if groups.cp_size > 1:
            comm.all_reduce(g, groups.cp_group, tag="test.grad")
        if getattr(p, "tensor_model_parallel", False) and p.partition_dim >= 0:
            if ps.get_tensor_model_parallel_world_size() > 1:
                g = comm.all_gather_cat(
                    g, ps.get_tensor_model_parallel_group(), dim=p.partition_dim
                )
        out[name] = g
    return out


def _step(family: str, root, layout: str) -> dict:
    """Rank side: one float64 step of the family's pieces under ``layout``."""
    import torch.distributed as dist

    from megatron_video.parallel import comm
    from megatron_video.testing.parallel import video_parallel
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.config import validate
    from megatron_video.training.families import get_family
    from megatron_video.training.families.wan import wan_transformer_config

    cfg = _config(family, root, layout)
    validate(cfg, dist.get_world_size())
    tp, U, R, rpn = LAYOUTS[layout]
    fam = get_family(family)
    with video_parallel(U, R, tp=tp, ranks_per_node=rpn, seed=0) as groups:
        model = fam.build_model(wan_transformer_config(cfg, params_dtype=torch.float64), config=cfg)
        sample = fam.sample_layout(cfg, groups.cp_size)
        coords = RankCoords(cp_rank=groups.cp_rank, ulysses_size=U, ring_size=R)
        batches = fam.make_batches(
            cfg, coords=coords, vae=None, latent_scale=1.0, layout=sample.layout
        )
        objective = fam.make_objective(cfg, groups, sample)
        mb = _float64(next(batches.step_batches(0)))
        args, kwargs = objective.model_call(mb, True)
        share = objective.loss(model(*args, **kwargs), mb)
        share.backward()
        loss = share.detach().clone()
        if groups.cp_size > 1:
            comm.all_reduce(loss, groups.cp_group, tag="test.loss")
        return dict(loss=float(loss), grads=_full_grads(model, groups), mb=mb)


_REFERENCE = {}


def _reference(pool4, family, root) -> dict:
    if family not in _REFERENCE:
        _REFERENCE[family] = pool4.run(_step, family, root, "reference")[0]
    return _REFERENCE[family]


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_step_matches_cp1(pool4, root, family, layout):
    ref = _reference(pool4, family, root)
    assert ref["loss"] > 0
    # one sample CFG-dropped, one not: the text path gets gradients (all dropped, the
    # cross-attention's query side would have ~0 gradients, compared as noise)
    assert bool(ref["mb"].drop.any()) and not bool(ref["mb"].drop.all())
    nonzero = [n for n, g in ref["grads"].items() if float(g.abs().max()) > 0]
    assert len(nonzero) > 0.9 * len(ref["grads"]), "most parameters must receive a gradient"
    per_rank = pool4.run(_step, family, root, layout, ranks_per_node=LAYOUTS[layout][3])
    worst = [0.0, 0.0]
    for rank, got in enumerate(per_rank):
        assert abs(got["loss"] - ref["loss"]) <= 1e-12 * ref["loss"], (rank, got["loss"])
        assert got["grads"].keys() == ref["grads"].keys()
        worst[0] = max(worst[0], abs(got["loss"] - ref["loss"]))
        for name, g in ref["grads"].items():
            err = float((got["grads"][name] - g).abs().max()) / (float(g.abs().max()) + 1e-30)
            assert err <= 1e-9, (rank, name, err)
            worst[1] = max(worst[1], err)
    print(f"{family}/{layout}: |loss diff| {worst[0]:.1e}, max grad rel diff {worst[1]:.1e}")


def test_cp1_loss_is_flow_matching_on_diffusers(pool4, root, monkeypatch):
    """The reference loss equals ``mean((v(x_t, 1000 t, text) - (eps - x0))^2)`` with diffusers'
    own model, ``x_t = (1 - t) x0 + t eps``, the text zeroed where padded or CFG-dropped."""
    from diffusers import WanTransformer3DModel

    from megatron_video.models.embedders import unpatchify

    ref = _reference(pool4, "wan", root)
    cfg, mb = _config("wan", root, "reference"), ref["mb"]
    # diffusers 0.42 needs accelerate (not pinned) to keep its fp32 modules: float64 anyway here
    monkeypatch.setattr(WanTransformer3DModel, "_keep_in_fp32_modules", None)
    model = WanTransformer3DModel.from_pretrained(str(root / "transformer")).double()
    grid, patch = (4, 2, 3), tuple(cfg.model.patch_size)
    x0, eps = (unpatchify(v, patch, grid, 4) for v in (mb.clean, mb.noise))
    t = mb.t.view(-1, 1, 1, 1, 1)
    text = mb.caption_ids * mb.caption_mask[..., None] * (~mb.drop)[:, None, None]
    with torch.no_grad():
        v = model((1 - t) * x0 + t * eps, 1000 * mb.t, text, return_dict=False)[0]
    want = float(((v - (eps - x0)) ** 2).mean())
    assert bool(mb.drop.any()) and not bool(mb.drop.all())  # one sample CFG-dropped, one not
    assert math.isclose(ref["loss"], want, rel_tol=1e-6), (ref["loss"], want)


def _init_from_checkpoint(root, ckpt) -> float:
    """Rank side: the CP = 1 model built from the converted checkpoint; max |weight difference|
    from the one built from the diffusers folder."""
    from megatron_video.testing.parallel import video_parallel
    from megatron_video.training.families import get_family
    from megatron_video.training.families.wan import wan_transformer_config

    fam = get_family("wan")
    out = []
    with video_parallel(1, 2, tp=2, ranks_per_node=2, seed=0):
        for source in (root / "transformer", ckpt):
            cfg = _config("wan", root, "tp2xcp2")
            cfg.model.init_from = str(source)
            tcfg = wan_transformer_config(cfg)
            out.append(
                {
                    n: p.detach().clone()
                    for n, p in fam.build_model(tcfg, config=cfg).named_parameters()
                }
            )
    return max(float((out[0][n] - out[1][n]).abs().max()) for n in out[0])


def test_init_from_converted_checkpoint(pool4, root):
    from megatron_video.models.wan.convert import diffusers_to_checkpoint

    ckpt = root / "ckpt"
    if not ckpt.exists():
        diffusers_to_checkpoint(root / "transformer", ckpt)
    diffs = pool4.run(_init_from_checkpoint, root, ckpt, ranks_per_node=2)
    assert diffs == [0.0] * 4, diffs


# ---------------------------------------------------------------------------------------------
# config rules
# ---------------------------------------------------------------------------------------------
def _validate(family, root, world=4, **fields):
    from megatron_video.training.config import validate

    cfg = _config(family, root, "reference")
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    validate(cfg, world)


@pytest.mark.parametrize(
    "family, fields, message",
    [
        (
            "wan",
            dict(model__lora_rank=8),
            r"model.lora_rank \(8\) is not a field of model.family 'wan'",
        ),
        (
            "wan",
            dict(data__text_embed_dim=None),
            r"data.text_embed_dim \(None\) must be set with data.source 'shards'",
        ),
        (
            "wan",
            dict(model__num_layers=3),
            r"its num_layers \(2\) must equal model.num_layers \(3\)",
        ),
        (
            "wan",
            dict(vae__latent_channels=16),
            r"its in_channels \(4\) must equal vae.latent_channels \(16\)",
        ),
        (
            "wan",
            dict(model__init_from="/nonexistent"),
            r"model.init_from \('/nonexistent'\) must be",
        ),
        (
            "wan_ar",
            dict(model__frames_per_block=3),
            r"model.frames_per_block \(3\)",
        ),
        (
            "wan_ar",
            dict(model__per_token_timesteps=True),
            r"model.per_token_timesteps \(True\) is implied by model.family 'wan_ar'",
        ),
        (
            "wan",
            dict(model__rope_theta=None),
            r"model.rope_theta \(None\) must be 10000.0 for model.family 'wan'",
        ),
    ],
)
def test_bad_config_names_the_field(root, family, fields, message):
    with pytest.raises(ValueError, match=message):
        _validate(family, root, **fields)


def test_other_families_refuse_wan_fields(root):
    """A Wan transformer folder as ``model.init_from``: ``video_dit`` has no such field;
    ``ar_dit`` reads a run folder of its own (``make demo``'s) and names what it needs."""
    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.config import validate

    cfg = tiny_config("video_dit", str(root))
    cfg.model.init_from = str(root / "transformer")
    with pytest.raises(
        ValueError, match=r"model.init_from \('.*'\) is not a field of model.family 'video_dit'"
    ):
        validate(cfg, 1)
    cfg = tiny_config("ar_dit", str(root))
    cfg.model.init_from = str(root / "transformer")
    with pytest.raises(
        ValueError, match=r"model.init_from \('.*'\) must be a megatron-video train"
    ):
        validate(cfg, 1)


# ---------------------------------------------------------------------------------------------
# the command line: precompute with a Wan VAE + UMT5, then train
# ---------------------------------------------------------------------------------------------
def _cli(args, cwd):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(cwd), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "megatron_video.training.cli", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _decode(path):
    import av

    with av.open(str(path)) as c:
        x = torch.stack([torch.from_numpy(f.to_ndarray(format="rgb24")) for f in c.decode(video=0)])
    return (x.float() / 127.5 - 1).permute(3, 0, 1, 2)


def _train_on_shards(config: str, shards: str, out: str) -> list:
    """Rank side: 2 steps of the trainer on ``config`` reading ``shards``; the logged losses."""
    import warnings

    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    over = [f"data.shards={shards}", "train.steps=2", "train.progress=false", f"output={out}"]
    t = Trainer(load_config(config, over), progress=False, cpu=True)
    try:
        metrics = t.run()
        return [h["loss"] for h in metrics["history"]] if t.is_logger else None
    finally:
        t.close()


@pytest.mark.process_launch
def test_precompute_wan_vae_umt5_then_train(pool4, tmp_path):
    """``megatron-video precompute`` with a tiny ``AutoencoderKLWan`` (``vae.diffusers``) and a
    tiny UMT5 (``--text-encoder``), 2 SP halo windows per clip: the latents equal the full-clip
    Wan encoding normalised by its latents_mean / std, the embeddings the UMT5's; then the trainer
    of examples/configs/wan_tiny.yaml on 4 ranks (the pool's: the command line's launch is
    tested in tests/test_examples.py) trains on them."""

    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos
    from megatron_video.data.shards import ShardReader
    from megatron_video.data.text import HFTextEncoder
    from megatron_video.testing.configs import REPO_ROOT
    from megatron_video.testing.wan import save_tiny_umt5, save_tiny_wan_vae
    from megatron_video.training.precompute import wan_vae_encoder

    write_procedural_videos(tmp_path / "src", 4, num_frames=29, height=32, width=32, seed=2)
    prepare_dataset(tmp_path / "src", tmp_path / "ds")
    captions = [p.read_text() for p in sorted((tmp_path / "src").glob("*.txt"))]
    save_tiny_wan_vae(tmp_path / "vae")
    save_tiny_umt5(tmp_path / "umt5", captions)
    config, shards = str(REPO_ROOT / "examples/configs/wan_tiny.yaml"), tmp_path / "shards"
    _cli(
        ["precompute", "--config", config, "--out", str(shards), "--text-encoder"]
        + [str(tmp_path / "umt5"), "--text-len", "16", "--sp-size", "2", "data.source=energon"]
        + [f"data.path={tmp_path / 'ds'}", f"vae.diffusers={tmp_path / 'vae'}"],
        REPO_ROOT,
    )
    encode = wan_vae_encoder(tmp_path / "vae", 4)
    text = HFTextEncoder.from_pretrained(str(tmp_path / "umt5"), 16)
    got = list(ShardReader(str(shards)))
    assert len(got) == 4
    for s in got:
        src = tmp_path / "src" / s["meta"]["source"]
        with torch.no_grad():
            ref = encode(_decode(src)[None])[0]
        emb, mask = text([s["caption"]])
        assert s["latent"].shape == (4, 8, 4, 4) and s["meta"]["encoder"] == "wan_vae"
        assert torch.equal(s["latent"], ref)  # measured bitwise equal in both environments
        assert torch.equal(s["text_mask"], mask[0]) and torch.allclose(s["text_emb"], emb[0])
    run = str(tmp_path / "run")
    losses = pool4.run(_train_on_shards, config, str(shards), run, ranks_per_node=2)[0]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses), losses


# ---------------------------------------------------------------------------------------------
# the Megatron-LM entry (examples/pretrain_video_dit.py) without Megatron-LM installed
# ---------------------------------------------------------------------------------------------
def _entry_args(mod, yaml_path, seq_length):
    import argparse

    args = mod.add_video_args(argparse.ArgumentParser()).parse_args(
        ["--video-config", str(yaml_path), "--ranks-per-node", "2"]
    )
    megatron = dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
        micro_batch_size=1,
        global_batch_size=1,
        seed=5,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        seq_length=seq_length,
    )
    for k, v in megatron.items():
        setattr(args, k, v)
    return args


def _pretrain_entry_step(yaml_path, seq_length):
    """Rank side: the entry's model / dataset / forward-step providers, one backward."""
    import warnings

    from megatron.core.transformer import TransformerConfig
    from torch.utils.data import default_collate

    from megatron_video.models.wan.config import gelu_tanh
    from megatron_video.models.wan.model import WanModel
    from megatron_video.testing.configs import load_example
    from megatron_video.testing.parallel import video_parallel

    warnings.filterwarnings("ignore")
    mod = load_example()
    cfg = mod.video_config_from_args(_entry_args(mod, yaml_path, seq_length), world_size=4)
    with video_parallel(2, 2, ranks_per_node=2):
        base = TransformerConfig(  # what --init-method-std 0.011 --use-cpu-initialization ... build
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=96,
            init_method_std=0.011,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            context_parallel_size=4,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
        )
        model = mod.model_provider(True, True, config=base, video_config=cfg)
        mc = model.config
        assert isinstance(model, WanModel) and mc.activation_func is gelu_tanh
        assert (mc.init_method_std, mc.layernorm_epsilon, mc.add_bias_linear) == (0.011, 1e-6, True)
        train, _, _ = mod.train_valid_test_datasets_provider([8, 0, 0])
        out, loss_func = mod.forward_step(iter([default_collate([train[3]])]), model, step=0)
        loss, logs = loss_func(out)
        loss.backward()
        grads = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
        total, count = logs["loss"].tolist()  # Megatron's (sum, count) of the logged loss
        assert count == 1.0
        return total, grads


@pytest.mark.parametrize("family, seq_length", [("wan", 24), ("wan_ar", 48)])
def test_megatron_lm_entry_providers(pool4, root, tmp_path, family, seq_length):
    """``examples/pretrain_video_dit.py`` accepts ``wan`` / ``wan_ar`` (``--seq-length`` the
    model's tokens: 4 x 2 x 3, twice that for teacher forcing): weights from ``model.init_from``,
    the CP-reduced loss the same on every rank, gradients everywhere."""
    import yaml

    from megatron_video.testing.configs import load_example
    from megatron_video.training.config import config_to_dict

    path = tmp_path / f"{family}.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(_config(family, root, "u2xr2"))))
    mod = load_example()
    with pytest.raises(ValueError, match=r"--ffn-hidden-size \(128\) must equal"):
        args = _entry_args(mod, path, seq_length)
        args.ffn_hidden_size = 128
        mod.video_config_from_args(args)
    results = pool4.run(_pretrain_entry_step, str(path), seq_length, ranks_per_node=2)
    losses = {r[0] for r in results}
    assert len(losses) == 1 and math.isfinite(losses.pop())
    assert all(r[1] > 0 for r in results)


# ---------------------------------------------------------------------------------------------
# the trainer with pipeline parallelism (Megatron's schedule, fp32)
# ---------------------------------------------------------------------------------------------
PP_CASES = {
    "reference": dict(),
    "pp2xcp2": dict(
        pipeline_model_parallel_size=2, context_parallel_size=2, ulysses_size=2, ranks_per_node=4
    ),
}


def _trainer_step(family: str, root, parallel: dict) -> dict:
    """Rank side: the trainer's forward-backward of step 0 (4 samples), loss and reduced grads."""
    import warnings

    from megatron_video.models.wan.interop import global_param_name
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = tiny_wan_config(family, root, root / "shards", **parallel)
    cfg.model.init_from = str(root / "transformer")
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 4
    trainer = Trainer(cfg, progress=False)
    try:
        loss = trainer.forward_backward(0)
        grads = {
            global_param_name(trainer.model, n): p.main_grad.detach().clone()
            for n, p in trainer.model.named_parameters()
        }
        return dict(loss=loss, grads=grads)
    finally:
        trainer.close()


@pytest.mark.parametrize("family", ["wan", "wan_ar"])
def test_trainer_pipeline_parallel_matches(pool4, root, family):
    """PP = 2 x CP = 2 through ``Trainer``: the last stage's loss and every stage's gradients (the
    replicated condition embedder on both) equal the single-rank step (fp32)."""
    from torch.testing import assert_close

    ref = pool4.run(_trainer_step, family, root, PP_CASES["reference"])[0]
    per_rank = pool4.run(_trainer_step, family, root, PP_CASES["pp2xcp2"], ranks_per_node=4)
    stages = set()
    for rank, got in enumerate(per_rank):
        if got["loss"] is not None:
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), rank
        stages.add(frozenset(got["grads"]))
        for name, g in got["grads"].items():
            scale = float(ref["grads"][name].abs().max()) + 1e-8
            assert_close(g, ref["grads"][name], rtol=2e-4, atol=2e-5 * scale, msg=name)
    assert len(stages) == 2 and set().union(*stages) == set(ref["grads"])  # two stages, all params


def test_checkpoint_of_other_shapes_is_refused(root):
    """``init_from`` a converted checkpoint: its ``diffusers_config.json`` against the config."""
    from megatron_video.models.wan.convert import diffusers_to_checkpoint

    ckpt = root / "ckpt"
    if not ckpt.exists():
        diffusers_to_checkpoint(root / "transformer", ckpt)
    with pytest.raises(
        ValueError,
        match=r"model.init_from \('.*ckpt'\): its ffn_dim \(96\) must equal "
        r"model.ffn_hidden_size \(128\)",
    ):
        _validate("wan", root, model__init_from=str(ckpt), model__ffn_hidden_size=128)


# ---------------------------------------------------------------------------------------------
# a trained checkpoint goes back to diffusers
# ---------------------------------------------------------------------------------------------
def _train_or_load(root, run, init_from):
    """Rank side, TP2 x CP2: train 2 steps from the tiny folder and save (``init_from`` None),
    or build the model from ``init_from``; this rank's parameters."""
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = _config("wan", root, "tp2xcp2")
    cfg.output = str(run)
    cfg.train.steps, cfg.train.save = 2, init_from is None
    if init_from is not None:
        cfg.model.init_from, cfg.train.steps = str(init_from), 0
    trainer = Trainer(cfg, progress=False)
    try:
        if init_from is None:
            trainer.run()
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()


def test_trained_checkpoint_exports_to_diffusers(pool4, root, tmp_path):
    """``megatron-video train`` (family wan, TP2 x CP2) -> ``convert --to-diffusers`` of its
    checkpoint -> a folder diffusers loads (strict) whose weights, loaded back under the same
    layout, equal the trained ones on every rank (bit-identical)."""
    from megatron_video.models.wan.convert import checkpoint_to_diffusers, load_wan_transformer

    trained = pool4.run(_train_or_load, root, tmp_path / "run", None, ranks_per_node=2)
    out = checkpoint_to_diffusers(tmp_path / "run" / "checkpoints", tmp_path / "exported")
    load_wan_transformer(out)  # strict: every key and shape diffusers expects
    back = pool4.run(_train_or_load, root, tmp_path / "run2", out, ranks_per_node=2)
    start = pool4.run(
        _train_or_load, root, tmp_path / "run3", root / "transformer", ranks_per_node=2
    )
    for rank, (t, b, s) in enumerate(zip(trained, back, start)):
        assert t.keys() == b.keys()
        assert all(torch.equal(t[n], b[n]) for n in t), rank
        assert not all(torch.equal(t[n], s[n]) for n in t), rank  # training changed the weights
