"""Every example config trains a few steps through its final checkpoint and resumes from it.

Each ``examples/configs/*.yaml`` runs as its comment's ``megatron-video train ... --nproc 4
--ranks-per-node 2 --cpu`` does (the trainer on 4 gloo ranks, 2 simulated nodes), scaled down only
in steps (1, then resumed to 2), sampling off and its output folder: the first run saves its final
checkpoint (where ``VideoQABatches`` once had no ``data_state``), the second resumes at step 2 and
runs step 3 only. Full-size configs, if any, live under ``examples/configs/full/`` and are only
validated (parsed, shapes checked), as are the examples of ``VALIDATED_ONLY`` (too slow for this
run; their training is tested elsewhere). The launcher's console (the logging rank only, per-rank logs)
is tested once through the command line.
"""

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The VLM GRPO examples (30-75 s each here, both environments): their trainer's layouts, resume and
# model.init_from from a supervised run are tested in tests/test_grpo_train.py (video_llava) and
# tests/test_grpo_qwen_vl.py (qwen_vl, from an SFT step)
VALIDATED_ONLY = ("qwen_vl_grpo", "video_llava_grpo")
CONFIGS = [
    p
    for p in sorted((ROOT / "examples" / "configs").glob("*.yaml"))
    if p.stem not in VALIDATED_ONLY
]
FULL = sorted((ROOT / "examples" / "configs" / "full").glob("*.yaml"))


def _run(path, overrides):
    import warnings

    from megatron_video.training import checkpoint as ckpt
    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    out = []
    for steps in (1, 2):
        cfg = load_config(path, list(overrides) + [f"train.steps={steps}", "train.sample=false"])
        t = Trainer(cfg, progress=False)
        before, ran, step_fn = ckpt.latest_step(t.checkpoint_dir), [], t.train_step

        def counted(step, *a, **k):
            ran.append(step)
            return step_fn(step, *a, **k)

        t.train_step = counted
        console = io.StringIO()
        try:
            with contextlib.redirect_stdout(console):
                t.run()
        finally:
            t.close()
        said = [ln for ln in console.getvalue().splitlines() if "resumed from" in ln]
        out.append((before, ran, ckpt.latest_step(t.checkpoint_dir), said, t.is_logger))
    return out


def _demo_data(cfg, folder: Path) -> str:
    """demo.yaml reads mp4 files through energon (``megatron-video demo`` prepares 128): 8 here."""
    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos

    d = cfg.data
    write_procedural_videos(
        folder / "videos", 8, num_frames=d.num_frames, height=d.height, width=d.width, seed=d.seed
    )
    prepare_dataset(folder / "videos", folder)
    return str(folder)


def _latent_shards(cfg, folder: Path) -> str:
    """wan_*.yaml read latent shards (``megatron-video precompute`` with a Wan VAE and UMT5,
    tests/test_wan_train.py): 8 random ones of the config's sizes here."""
    from megatron_video.testing.wan import write_random_latent_shards

    if cfg.data.buckets is not None:  # mixed_tiny.yaml: clips of mixed shapes and images
        from megatron_video.testing.mixed import write_tiny_mixed_shards

        return write_tiny_mixed_shards(cfg.model.family, folder, num_samples=12)
    return write_random_latent_shards(cfg, folder, num_samples=8)


def _tiny_wan22_folders(cfg, folder: Path) -> list:
    """Wan from raw video reads a diffusers VAE, a UMT5 and starts from a transformer: the README
    walkthrough's ``python -m megatron_video.testing.tiny_wan22`` makes them (and the clips)."""
    from megatron_video.testing.tiny_wan22 import make_tiny_wan22

    made = make_tiny_wan22(cfg, folder)
    return [
        f"data.path={made['data']}",
        f"data.text_encoder={made['umt5']}",
        f"vae.diffusers={made['vae']}",
        f"model.init_from={made['transformer']}",
    ]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_example_trains_saves_and_resumes(path, pool4, tmp_path):
    from megatron_video.training.config import load_config

    overrides = [f"output={tmp_path / 'run'}"]
    cfg = load_config(path)
    if cfg.vae.diffusers is not None:  # Wan from raw video (wan22_ti2v_tiny.yaml)
        overrides += _tiny_wan22_folders(cfg, tmp_path / "wan22")
    elif cfg.data.source == "energon":
        overrides.append(f"data.path={_demo_data(cfg, tmp_path / 'data')}")
    if cfg.data.source == "shards":
        overrides.append(f"data.shards={_latent_shards(cfg, tmp_path / 'shards')}")
    ckpt1 = tmp_path / "run" / "checkpoints" / "iter_0000001"
    for first, second in pool4.run(_run, str(path), overrides):
        assert first[:4] == (None, [0], 1, [])  # trained 1 step, saved the final checkpoint
        assert second[:3] == (1, [1], 2)  # resumed from it, ran step 2 only, saved it
        # the console rank says where it resumed from
        resumed = [f"[megatron-video] resumed from iteration 1 ({ckpt1})"]
        assert second[3] == (resumed if second[4] else []), second
    if path.stem == "demo":
        _generate_as_documented(tmp_path)


def _generate_as_documented(tmp_path):
    """docs/generation.md's ``megatron-video generate`` on this demo checkpoint (as ``runs/demo``),
    in this process: an mp4 of the asked 45 frames (the demo trains on 29); bad input exits 2
    naming the option."""
    import contextlib
    import io
    import os

    import av

    from megatron_video.testing.doc_blocks import launch_blocks
    from megatron_video.training.cli import main

    tokens = launch_blocks((ROOT / "docs" / "generation.md").read_text())["generate"]
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "demo").symlink_to(tmp_path / "run")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert tokens[0] == "megatron-video" and main(tokens[1:]) == 0
        with av.open("runs/demo/generated.mp4") as c:
            assert sum(1 for _ in c.decode(video=0)) == 45
        assert Path("runs/demo/generated.gif").is_file()
        i = tokens.index("--frames")
        bad = {
            "--frames": tokens[: i + 1] + ["43"] + tokens[i + 2 :],
            "--switch": [t if not t.startswith("29:") else "45:a circle" for t in tokens],
            "--image": tokens + ["--image", "first.png"],
        }
        for option, argv in bad.items():
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                assert main(argv[1:]) == 2, option
            assert f"{option} (" in err.getvalue(), (option, err.getvalue())
    finally:
        os.chdir(cwd)


# parameters of the released models (diffusers' WanTransformer3DModel of each size), to 0.5 %
WAN_PARAMS = {"wan2.1_t2v_1.3b": 1.419e9, "wan2.1_t2v_14b": 14.289e9, "wan2.2_ti2v_5b": 4.999e9}
WAN_PARAMS["wan22_ti2v_5b_longlive"] = WAN_PARAMS["wan2.2_ti2v_5b"]  # the same model, AR


@pytest.mark.parametrize("name", VALIDATED_ONLY)
def test_validated_only_examples_validate(name):
    """The examples not trained here validate for the world their comment launches (4 ranks),
    without the run they start from (``model.init_from``)."""
    from megatron_video.training.config import load_config, validate

    path = ROOT / "examples" / "configs" / f"{name}.yaml"
    assert "--nproc 4" in path.read_text()
    validate(load_config(path, ["model.init_from=null"]), 4)


@pytest.mark.parametrize("path", FULL, ids=[p.stem for p in FULL])
def test_full_size_config_validates(path):
    """GPU configs (bf16): validated for a GPU world of TP x PP x CP ranks; a Wan config's model
    (diffusers' own, on the meta device) has the released model's parameter count."""
    from megatron_video.training.config import load_config, validate

    cfg = load_config(path)
    p = cfg.parallel
    validate(
        cfg,
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size,
        has_gpu=True,
    )
    if cfg.model.family in ("wan", "wan_ar"):
        from megatron_video.models.wan.mapping import diffusers_reference_shapes
        from megatron_video.training.families.wan import diffusers_config_of

        shapes = diffusers_reference_shapes(diffusers_config_of(cfg))
        n = sum(math.prod(s) for s in shapes.values())
        assert abs(n / WAN_PARAMS[path.stem] - 1) < 5e-3, n
    if cfg.model.family == "qwen_vl":
        _check_qwen_vl_7b(cfg)


# Qwen/Qwen2.5-VL-7B-Instruct's published config.json (its shapes), written out here
QWEN_7B_TEXT = dict(
    hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    intermediate_size=18944, vocab_size=152064,
)  # fmt: skip
QWEN_7B_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
    patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
)  # fmt: skip


def _check_qwen_vl_7b(cfg):
    """The shipped 7B config: transformers' ``Qwen2_5_VLConfig`` of the published numbers (the
    file ``model.hf_config`` names) and the Megatron language config built from it."""
    from transformers import Qwen2_5_VLConfig

    from megatron_video.models.qwen_vl.config import language_config, mrope_section, rope_theta
    from megatron_video.training.families.qwen_vl import geometry_of, hf_config_of

    want = Qwen2_5_VLConfig(text_config=QWEN_7B_TEXT, vision_config=QWEN_7B_VISION)
    hf = hf_config_of(cfg)
    for k, v in QWEN_7B_TEXT.items():
        assert getattr(hf.text_config, k) == getattr(want.text_config, k) == v, k
    for k, v in QWEN_7B_VISION.items():
        assert getattr(hf.vision_config, k) == getattr(want.vision_config, k) == v, k
    assert mrope_section(hf) == [16, 24, 24] and rope_theta(hf) == 1e6
    assert (hf.video_token_id, hf.vision_start_token_id, hf.vision_end_token_id) == (
        151656, 151652, 151653,
    )  # fmt: skip
    assert not hf.tie_word_embeddings
    tc = language_config(hf, tp=4, cp=4)
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (28, 3584, 18944)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (28, 4, 128)
    g = geometry_of(cfg)
    assert (g.patch, g.temporal, g.merge) == (14, 2, 2)


@pytest.mark.process_launch
def test_cli_console_is_one_rank_and_ranks_log_to_files(tmp_path):
    """``megatron-video train --cpu --config examples/configs/video_llava.yaml --nproc 4
    --ranks-per-node 2`` (the README's MM-SP example, 2 steps): rank 0 alone on
    the console, the other ranks' output in ``<output>/logs/rank<N>.log``; the expected CPU-only
    warnings once."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "megatron_video.training.cli",
        "train",
        "--cpu",
        "--config",
        str(ROOT / "examples/configs/video_llava.yaml"),
        "--nproc",
        "4",
        "--ranks-per-node",
        "2",
        "--output",
        str(out),
        "train.steps=2",
        "train.progress=false",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    logs = {r: (out / "logs" / f"rank{r}.log") for r in (1, 2, 3)}  # rank 0 logs to the console
    assert not (out / "logs" / "rank0.log").exists()
    assert all(p.is_file() for p in logs.values()), sorted((out / "logs").glob("*"))
    assert console.count("megatron_video CPU mode (no CUDA device)") == 1
    for p in logs.values():  # nothing hidden: each rank's own log has its warnings
        assert "megatron_video CPU mode (no CUDA device)" in p.read_text()
    assert any(re.search(r"Warning: .*not installed", p.read_text()) for p in logs.values())
    # the console: no warning line; the known environment warnings announced in one line
    assert _warning_lines(console) == [], console[-4000:]
    assert console.count("known environment warnings hidden") == 1, console[-4000:]


def _warning_lines(console: str) -> list:
    return [ln for ln in console.splitlines() if re.search(r"Warning\b|warnings\.warn\(", ln)]


def _validate(*extra):
    """A fresh launch from a user's shell: without the console's per-launch variables, which an
    in-process ``main()`` earlier in this pytest process leaves in ``os.environ``."""
    cmd = [sys.executable, "-m", "megatron_video.training.cli", *extra]
    cmd += ["validate", "--config", str(ROOT / "examples/configs/wan_tiny.yaml")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_VIDEO_")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def test_validate_console_is_quiet_and_assumes_the_world_size():
    """``megatron-video validate`` without ``--nproc`` (wan_tiny.yaml: CP 4) checks world size 4
    and says so; no warning line, the hidden ones in one line; ``--verbose`` shows them in full."""
    quiet = _validate()
    assert "assuming world size 4 = TP 1 x PP 1 x CP 4 x DP 1" in quiet, quiet
    assert _warning_lines(quiet) == [] and quiet.count("warnings hidden") == 1, quiet
    loud = _validate("--verbose")
    assert "warnings hidden" not in loud
    assert any("Transformer Engine and Apex are not installed" in ln for ln in _warning_lines(loud))


def _readme_commands():
    """Each ``megatron-video ...`` line of the README's fenced blocks (continuations joined,
    trailing comments dropped), as tokens."""
    import shlex

    lines, fenced, current = [], False, ""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        current += line
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.startswith("megatron-video "):
            lines.append(shlex.split(current.split("#", 1)[0]))
        current = ""
    return lines


README_COMMANDS = _readme_commands()
WALKTHROUGH_CONFIG = "examples/configs/wan22_ti2v_tiny.yaml"


@pytest.mark.parametrize("tokens", README_COMMANDS, ids=[" ".join(t[1:3]) for t in README_COMMANDS])
def test_readme_commands_parse_and_their_configs_validate(tokens):
    """The README's commands have the flags the CLI takes, and every config a ``train`` line names
    validates at the world size it launches (each such config is also trained above); the
    convert lines run in tests/test_wan_io.py (from docs/wan.md), precompute with the Wan VAE and
    UMT5 in tests/test_wan_train.py; ``my.yaml`` stands for the user's own config."""
    from megatron_video.training import cli
    from megatron_video.training.config import load_config, validate

    args = cli._parser().parse_args(tokens[1:])
    config = getattr(args, "config", None)
    if tokens[1] != "train" or config == "my.yaml":  # precompute: tests/test_wan_train.py
        return
    if config == WALKTHROUGH_CONFIG:  # its folders are made and it runs in the walkthrough test
        return
    assert (ROOT / config).is_file(), config
    cfg = load_config(str(ROOT / config), list(getattr(args, "overrides", []) or []))
    p = cfg.parallel
    world = getattr(args, "nproc", None) or (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )
    earlier = README_COMMANDS[: README_COMMANDS.index(tokens)]
    outputs = {
        load_config(str(ROOT / t[3])).output for t in earlier if t[1:3] == ["train", "--config"]
    }
    if cfg.model.init_from in outputs:  # the run an earlier line trains (in order: test above)
        cfg.model.init_from = None
    validate(cfg, world)


def test_readme_lists_commands():
    assert {t[1] for t in README_COMMANDS} >= {"train", "validate", "convert", "precompute"}


@pytest.mark.process_launch
def test_readme_wan_walkthrough(tmp_path):
    """The README's "Train Wan" block run as written, line by line, in a folder holding a copy of
    its config (each command a process of its own): tiny Wan 2.2 TI2V folders -> convert in ->
    train ``wan_ar`` from raw video at U2xR2 with TI2V (2 steps) -> resume (step 3) -> export;
    the export then runs a denoising step in diffusers' ``WanImageToVideoPipeline`` (Wan 2.2
    TI2V's ``expand_timesteps``) with the walkthrough's VAE and UMT5."""
    import os
    import shutil

    from megatron_video.testing.doc_blocks import launch_lines

    lines = launch_lines((ROOT / "README.md").read_text())["wan-walkthrough"]
    (tmp_path / Path(WALKTHROUGH_CONFIG).parent).mkdir(parents=True)
    shutil.copy(ROOT / WALKTHROUGH_CONFIG, tmp_path / WALKTHROUGH_CONFIG)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    consoles = []
    for tokens in lines:
        assert tokens[0] in ("python", "megatron-video"), tokens
        cmd = [sys.executable, *tokens[1:]] if tokens[0] == "python" else [sys.executable, "-m"]
        if tokens[0] == "megatron-video":
            cmd += ["megatron_video.training.cli", *tokens[1:]]
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        consoles.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, (tokens, consoles[-1][-4000:])
    for tokens, console in zip(lines, consoles):  # the known warnings in one line, none shown
        assert _warning_lines(console) == [], (tokens, console[-4000:])
    trains = [c for t, c in zip(lines, consoles) if t[1] == "train"]
    assert len(trains) == 2 and "resumed from iteration 2" in trains[1], trains[1][-4000:]
    run = tmp_path / "runs" / "wan22_tiny" / "run"
    history = json.loads((run / "metrics.json").read_text())["history"]
    assert len(history) == 3 and all(math.isfinite(h["loss"]) for h in history), history
    _export_runs_in_diffusers(tmp_path / "runs" / "wan22_tiny")


def _export_runs_in_diffusers(root: Path) -> None:
    """One TI2V denoising step of ``WanImageToVideoPipeline`` (``expand_timesteps=True``) with the
    exported transformer at the trained size: 5 frames of 64 x 64, finite."""
    import torch
    import transformers
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from PIL import Image

    from megatron_video.models.wan.convert import load_wan_transformer

    tok = transformers.AutoTokenizer.from_pretrained(str(root / "umt5"))
    enc = transformers.UMT5EncoderModel.from_pretrained(str(root / "umt5")).eval()
    pipe = WanImageToVideoPipeline(
        tokenizer=tok,
        text_encoder=enc,
        vae=AutoencoderKLWan.from_pretrained(str(root / "vae")).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        transformer=load_wan_transformer(str(root / "export")).eval(),
        expand_timesteps=True,
    )
    ids = tok(["a red cat"], padding="max_length", max_length=16, return_tensors="pt")
    with torch.no_grad():  # the prompt encoded here: diffusers' own prompt cleaning needs ftfy
        emb = enc(ids.input_ids, attention_mask=ids.attention_mask).last_hidden_state
    frames = pipe(
        image=Image.new("RGB", (64, 64), (200, 30, 30)),
        prompt_embeds=emb,
        guidance_scale=1.0,
        height=64,
        width=64,
        num_frames=5,
        num_inference_steps=1,
        max_sequence_length=16,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert frames.shape == (1, 5, 64, 64, 3) and bool(np.isfinite(frames).all())
