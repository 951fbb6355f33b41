"""``megatron-video generate`` on a ``wan_ar`` checkpoint: a tiny model trained one step on the
4-rank pool (CP 2: Ulysses 2), a tiny random UMT5 (``--text-encoder``) and Wan VAE (the
checkpoint's ``vae.diffusers``) saved here. The command, run in this process (CP 1), writes an mp4
of the asked frames (longer than the trained 13), its latents equal the in-process streaming
generator (``Generator.ar_blocks`` on the trainer's model, CP 2) for the same seed and prompts; the
same command on every rank of a 2-rank pool (as under ``torchrun``: CP 2) gives the same
latents, and so does it on 4 ranks (a block's 6 tokens padded to 8, CP 4);
a missing or wrong folder is a ValueError naming ``--text-encoder`` / ``--vae``."""

from __future__ import annotations

import torch

PROMPTS = ("a red cat on the moon", "a blue dog runs")
FRAMES, SWITCH, SEED = 21, 13, 3  # 6 latent frames (blocks of 1); the second prompt from frame 13


def _train_and_stream(tmp):
    """Train 1 step, save; then stream the generate request in-process with the trainer's model."""
    import warnings

    from megatron_video.generation.wan_io import wan_text_conditions
    from megatron_video.testing.wan import tiny_wan_config
    from megatron_video.training.batches.fixed import sample_generator
    from megatron_video.training.config import token_grid_of
    from megatron_video.training.generate import trainer_generator
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = _config(tmp, tiny_wan_config)
    t = Trainer(cfg, progress=False)
    try:
        t.run()
        (cond, second), null = wan_text_conditions(
            f"{tmp}/umt5", cfg.data.caption_len, cfg.data.text_embed_dim, PROMPTS, t.device
        )
        _, Hp, Wp = token_grid_of(cfg)
        C = cfg.vae.latent_channels * 4

        def noise_block(j):  # what generate draws
            return torch.randn(1, Hp * Wp, C, generator=sample_generator(SEED, 10**9 + 1, j))

        t.ddp.eval()
        with torch.no_grad():
            blocks = trainer_generator(t).ar_blocks(
                cond, null, noise_block, 6, switches=[(1 + (SWITCH - 1) // 4, second)]
            )
            return torch.cat([b for _, b, _ in blocks], dim=1)
    finally:
        t.close()


def _config(tmp, tiny_wan_config):
    cfg = tiny_wan_config("wan_ar", tmp, f"{tmp}/shards", context_parallel_size=2, ulysses_size=2)
    cfg.train.steps, cfg.train.sample, cfg.train.save = 1, False, True
    cfg.diffusion.sample_steps, cfg.diffusion.guidance_scale = 2, 2.0
    cfg.vae.diffusers = f"{tmp}/vae"
    cfg.data.i2v_probability = 0.5  # TI2V-trained: generate --image is allowed
    return cfg


def _generate_on_every_rank(argv):
    """``megatron-video generate`` run by every rank of a pool, as ``torchrun`` would: the command
    joins the initialised world (CP over all its ranks). Returns (exit status, stderr, latents)."""
    import contextlib
    import io

    from megatron_video.training import generate
    from megatron_video.training.cli import main

    real, results = generate.generate, []
    generate.generate = lambda *a, **k: results.append(real(*a, **k)) or results[-1]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        generate.generate = real
    return rc, err.getvalue(), results[0].get("tokens") if results else None


def test_generate_wan_ar_end_to_end(pool4, tmp_path, monkeypatch):
    import contextlib
    import io

    import av
    from diffusers import AutoencoderKLWan
    from PIL import Image

    from megatron_video.testing.pool import WorkerPool
    from megatron_video.testing.wan import (
        save_tiny_umt5,
        save_tiny_wan_vae,
        tiny_wan_config,
        write_random_latent_shards,
    )
    from megatron_video.training import generate
    from megatron_video.training.cli import main

    save_tiny_wan_vae(tmp_path / "vae")
    save_tiny_umt5(tmp_path / "umt5", PROMPTS)
    write_random_latent_shards(_config(tmp_path, tiny_wan_config), tmp_path / "shards")
    ref = pool4.run(_train_and_stream, str(tmp_path), ranks_per_node=2)[0]

    results = []
    real = generate.generate
    monkeypatch.setattr(
        generate, "generate", lambda *a, **k: results.append(real(*a, **k)) or results[-1]
    )
    out = tmp_path / "gen" / "video"
    argv = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", PROMPTS[0]]
    argv += ["--frames", str(FRAMES), "--switch", f"{SWITCH}:{PROMPTS[1]}", "--seed", str(SEED)]
    argv += ["--text-encoder", str(tmp_path / "umt5"), "--output", str(out), "--cpu"]
    assert main(argv) == 0
    with av.open(str(out.with_suffix(".mp4"))) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == FRAMES and frames[0].shape == (32, 48, 3)
    assert out.with_suffix(".gif").is_file()
    with Image.open(out.with_suffix(".gif")) as gif:
        assert gif.n_frames == FRAMES
    # the GIF's caption: the prompt in force at each frame (the second from frame SWITCH on)
    assert results[0]["captions"] == [PROMPTS[0]] * SWITCH + [PROMPTS[1]] * (FRAMES - SWITCH)
    got = results[0]["tokens"]
    # fp32: measured 1.1e-6 here and at CP 2 / CP 4 below; the bound is 10x that
    err = float((got - ref).abs().max())
    print(f"generate vs in-process streaming (CP 1 vs CP 2, fp32): max |diff| {err:.2e}")
    assert got.shape == ref.shape == (1, 6 * 2 * 3, 16) and err <= 1e-5, err

    i = argv.index("--output")  # the command under torchrun: CP over the whole world
    cp_argv = argv[: i + 1] + [str(out) + "_cp2"] + argv[i + 2 :]
    pool2 = WorkerPool(2, ranks_per_node=2)
    try:
        (rc, msg, cp2), (rc1, _, other) = pool2.run(_generate_on_every_rank, cp_argv)
    finally:
        pool2.close()
    assert rc == rc1 == 0, msg
    err2 = float((cp2 - got).abs().max())
    print(f"generate at CP 2 (Ulysses 2) vs CP 1 (fp32): max |diff| {err2:.2e}")
    assert cp2.shape == got.shape and err2 <= 1e-5 and other is None, err2  # rank 0 writes
    with av.open(str(out) + "_cp2.mp4") as c:
        assert sum(1 for _ in c.decode(video=0)) == FRAMES
    # a world of 4 does not divide a block's 6 tokens: each block is padded to 8 (the padding
    # masked, never cached), the same latents as CP 1
    cp4_argv = argv[: i + 1] + [str(out) + "_cp4"] + argv[i + 2 :]
    (rc, msg, cp4), *others = pool4.run(_generate_on_every_rank, cp4_argv)
    assert rc == 0 and all(o[0] == 0 for o in others), msg
    err4 = float((cp4 - got).abs().max())
    print(f"generate at CP 4 (6-token blocks padded to 8) vs CP 1 (fp32): max |diff| {err4:.2e}")
    assert cp4.shape == got.shape and err4 <= 1e-5, err4

    # --image: latent frame 0 is the image encoded by diffusers' own VAE (normalised, patchified
    # here), held through block 0; the later frames follow from it
    img = torch.randint(0, 256, (32, 48, 3), generator=torch.Generator().manual_seed(5))
    Image.fromarray(img.to(torch.uint8).numpy()).save(tmp_path / "first.png")
    assert main(argv + ["--image", str(tmp_path / "first.png")]) == 0
    with_image = results[1]["tokens"]
    vae = AutoencoderKLWan.from_pretrained(str(tmp_path / "vae")).eval()
    with torch.no_grad():
        x = img.permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0
        mu = vae.encode(x).latent_dist.mean
    c = vae.config
    mu = (mu - torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)) / torch.tensor(
        c.latents_std
    ).view(1, -1, 1, 1, 1)
    tokens = mu.reshape(1, 4, 1, 1, 2, 2, 3, 2).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(1, 6, 16)
    assert float((with_image[:, :6] - tokens).abs().max()) <= 1e-5
    assert float((with_image[:, 6:] - got[:, 6:]).abs().max()) > 1e-3  # the image matters

    i = argv.index("--text-encoder")  # bad input: named, before the model is built
    for option, bad in {
        "--text-encoder": argv[:i] + argv[i + 2 :],
        "--vae": argv + ["--vae", str(tmp_path / "nowhere")],
        "--image": argv + ["--image", str(tmp_path / "nowhere.png")],
    }.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(bad) == 2, option
        assert option in err.getvalue(), (option, err.getvalue())


def test_image_needs_a_ti2v_trained_wan_ar(tmp_path):
    """``--image`` on ``ar_dit`` or on a ``wan_ar`` checkpoint trained without first-frame
    conditioning (``data.i2v_probability`` 0) is a ValueError naming ``--image``."""
    import pytest

    from megatron_video.testing.wan import tiny_wan_config
    from megatron_video.training.families import get_family
    from megatron_video.training.generate import _check_request

    cfg = tiny_wan_config("wan_ar", tmp_path, tmp_path / "shards")
    cfg.data.i2v_probability = 0.0
    with pytest.raises(ValueError, match=r"--image \('a.png'\): the checkpoint was trained"):
        _check_request(cfg, get_family("wan_ar"), FRAMES, [], "a.png")
    cfg.model.family = "ar_dit"
    with pytest.raises(ValueError, match=r"--image \('a.png'\): model.family 'ar_dit' has no"):
        _check_request(cfg, get_family("ar_dit"), FRAMES, [], "a.png")


def test_bad_window_or_sink_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """``--sink`` / ``--window`` not whole blocks: a ValueError naming the option, raised before
    the text encoder, the VAE or the model is touched."""
    import pytest

    from megatron_video.testing.wan import tiny_wan_config
    from megatron_video.training import generate

    cfg = tiny_wan_config("wan_ar", tmp_path, tmp_path / "shards")
    cfg.model.frames_per_block = 2
    monkeypatch.setattr(generate, "read_checkpoint_config", lambda c: (cfg, tmp_path, 1))

    def built(*a, **k):
        raise AssertionError("checked too late: the model / encoders were loaded")

    monkeypatch.setattr(generate, "_conditions", built)
    monkeypatch.setattr(generate, "_load_model", built)
    for kw, needle in [
        (dict(sink=1), r"--sink \(1\) must be a non-negative multiple of model.frames_per_block"),
        (dict(window=3), r"--window \(3\) must be a non-negative multiple"),
        (dict(window=-2), r"--window \(-2\)"),
    ]:
        with pytest.raises(ValueError, match=needle):
            generate.generate(tmp_path, "a prompt", 29, **kw)
