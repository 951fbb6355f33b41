"""The training job: resume and determinism on 4 ranks, and the ``megatron-video`` command line.

* Save after step 1, resume in a fresh trainer for two steps: both losses are bitwise the
  uninterrupted run's (the second one depends on the restored Adam moments and LR schedule, so
  a resume that drops the optimizer state fails); a second run with the same seed gives bitwise
  identical losses (AR DiT, CP = 4 as U 2 x R 2 on 2 simulated nodes, activation recomputation
  on). Resuming under another layout is tested in ``test_reliability.py``.
* ``megatron-video train`` with a bad config exits with status 2 and names the field before any
  collective: run as one rank of a 4-rank torchrun world whose other ranks never come, a process
  that tried to form the group would hang instead of exiting.
* ``megatron-video demo`` end to end with tiny sizes: 4 spawned ranks, outputs written.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_video.testing.configs import load_example, tiny_config

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "megatron_video.training.cli"]
AR_CP4 = dict(
    context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2, recompute=True
)


def _config(tmp, output):
    cfg = tiny_config("ar_dit", tmp, **AR_CP4)
    cfg.output = output
    cfg.train.steps = 3
    cfg.train.save = True
    return cfg


def _resume_and_repeat(tmp):
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    losses = {}
    # uninterrupted run, a checkpoint after every step (and at the end)
    cfg = _config(tmp, f"{tmp}/run_a")
    cfg.train.save_interval = 1
    t = Trainer(cfg, progress=False)
    try:
        metrics = t.run()  # collective; only the logging rank returns metrics
        losses["a"] = [h["loss"] for h in metrics["history"]] if t.is_logger else None
    finally:
        t.close()
    # a fresh trainer resumes after step index 0 and runs step indices 1 and 2: the loss of 1 is
    # taken before its update (the restored weights), the loss of 2 after it (restored Adam / LR)
    t = Trainer(_config(tmp, f"{tmp}/run_b"), progress=False)
    try:
        step = t.load(f"{tmp}/run_a/checkpoints", step=1)  # model, optimizer, sample ledger
        losses["resumed"] = (step, [t.train_step(s)["loss"] for s in (step, step + 1)])
        lr = t.optimizer.param_groups[0]["lr"]
    finally:
        t.close()
    # the same seed again, from scratch (two steps: the run time stays what it was)
    t = Trainer(_config(tmp, f"{tmp}/run_c"), progress=False)
    try:
        losses["c"] = [t.train_step(s)["loss"] for s in range(2)]
    finally:
        t.close()
    return losses, lr


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    from megatron_video.training.vae_stage import ensure_vae

    tmp = str(tmp_path_factory.mktemp("training_run"))
    ensure_vae(tiny_config("ar_dit", tmp), progress=False)
    return tmp


def test_resume_bitwise_and_same_seed(pool4, vae_dir):
    per_rank = pool4.run(_resume_and_repeat, vae_dir)
    logger = per_rank[0][0]  # rank 0 (the console) writes the metrics
    a, (step, resumed), c = logger["a"], logger["resumed"], logger["c"]
    assert len(a) == 3 and step == 1
    assert resumed == a[1:], "steps 2 and 3 after resume must be bitwise identical"
    assert c == a[:2], "same seed, same losses (bitwise)"
    assert len({r[1] for r in per_rank}) == 1  # the LR schedule resumed identically everywhere
    ckpts = Path(vae_dir) / "run_a" / "checkpoints"  # Megatron-LM's layout
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (ckpts / "iter_0000003").is_dir()
    assert all(r[0]["c"] == c for r in per_rank)  # the loss is reduced over the CP group


def _cli(args, env_extra=None, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(env_extra or {})
    return subprocess.run(
        CLI + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


BAD_CONFIGS = [
    ("data.num_frames=30", "data.num_frames (30)"),
    ("parallel.ulysses_size=4", "parallel.ulysses_size * parallel.ring_size (4 * 2 = 8)"),
    (
        "model.num_attention_heads=3",
        "model.num_attention_heads (3) / parallel.tensor_model_parallel_size",
    ),
    ("model.frames_per_block=3", "model.frames_per_block (3)"),
]
# one rank of a 4-rank torchrun job whose peers never start: forming the group would hang
TORCHRUN_RANK0_ALONE = dict(
    RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
)


@pytest.mark.process_launch
def test_bad_config_fails_before_collectives(tmp_path):
    """The process: exit status 2, the field named, nothing written."""
    override, field = BAD_CONFIGS[0]
    r = _cli(
        ["train", "--config", "examples/configs/demo.yaml", "--output", str(tmp_path), override],
        env_extra=TORCHRUN_RANK0_ALONE,
        timeout=60,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert field in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("override, field", BAD_CONFIGS)
def test_bad_config_exits_2_naming_the_field(override, field, tmp_path, monkeypatch, capsys):
    """Every rule, through the command line's ``main`` in this process (the trainer, which would
    form the group, must not be reached)."""
    from megatron_video.training import cli, launch, trainer

    for k, v in TORCHRUN_RANK0_ALONE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(trainer, "train", lambda *a, **k: pytest.fail("reached the trainer"))
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("reached the launcher"))
    args = [
        "train",
        "--config",
        str(ROOT / "examples/configs/demo.yaml"),
        "--output",
        str(tmp_path),
    ]
    assert cli.main(args + [override]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "metrics.json").exists()


def test_bad_nproc_layout_fails(tmp_path, monkeypatch, capsys):
    from megatron_video.training import cli, launch

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("reached the launcher"))
    args = ["train", "--config", str(ROOT / "examples/configs/demo.yaml"), "--nproc", "6"]
    assert cli.main(args + ["--output", str(tmp_path)]) == 2
    assert "world size (6)" in capsys.readouterr().err


@pytest.mark.process_launch
def test_short_demo_run(tmp_path):
    out = tmp_path / "demo"
    # the shipped VAE (examples/vae/demo_vae.pt) of the real demo; a tiny DiT on smaller frames
    r = _cli(
        [
            "demo",
            "--cpu",
            "--output",
            str(out),
            "train.steps=2",
            "model.num_layers=2",
            "model.hidden_size=48",
            "diffusion.sample_steps=1",
            "train.progress=false",
            "data.height=16",
            "data.width=16",
            "train.warmup_steps=1",
        ],
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["world_size"] == 4
    assert metrics["parallel"] == {"tp": 1, "pp": 1, "cp": 4, "ulysses": 2, "ring": 2, "dp": 1}
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in metrics["history"])
    assert metrics["sample"]["frames"] == 29
    for name in ("loss.png", "sample.gif", "checkpoints/latest_checkpointed_iteration.txt"):
        assert (out / name).is_file(), name
    assert any((out / "tensorboard").iterdir())


# ---------------------------------------------------------------------------------------------
# the Megatron-LM entries (examples/pretrain_video_*.py) without Megatron-LM installed
# ---------------------------------------------------------------------------------------------
def _entry_args(mod, yaml_path, **megatron):
    import argparse

    args = mod.add_video_args(argparse.ArgumentParser()).parse_args(
        ["--video-config", str(yaml_path), "--video-override", "train.seed=5"]
    )
    base = dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
        micro_batch_size=1,
        global_batch_size=1,
        seed=5,
        num_layers=2,
        hidden_size=48,
        num_attention_heads=4,
    )
    for k, v in {**base, **megatron}.items():
        setattr(args, k, v)
    return args


def _tiny_yaml(tmp):
    import yaml

    from megatron_video.training.config import config_to_dict

    path = Path(tmp) / "tiny.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(tiny_config("ar_dit", tmp))))
    return path


def _megatron_cli_config(cfg):
    """The TransformerConfig core_transformer_config_from_args would build for ``--num-layers 2
    --hidden-size 48 --num-attention-heads 4 --normalization RMSNorm --init-method-std 0.011
    --qk-layernorm --add-bias-linear --context-parallel-size 4 --use-cpu-initialization
    --no-gradient-accumulation-fusion`` (Megatron-LM is not installed here; see README)."""
    from megatron.core.transformer import TransformerConfig

    m = cfg.model
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        normalization="RMSNorm",
        init_method_std=0.011,
        qk_layernorm=True,
        add_bias_linear=True,
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


def _pretrain_entry_step(yaml_path):
    import warnings

    from torch.utils.data import default_collate

    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.parallel.topology import destroy_video_parallel

    warnings.filterwarnings("ignore")
    mod = load_example()
    cfg = mod.video_config_from_args(_entry_args(mod, yaml_path, seq_length=32), world_size=4)
    initialize_model_parallel(
        tensor_model_parallel_size=1,
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
    )
    try:
        base = _megatron_cli_config(cfg)
        model = mod.model_provider(True, True, config=base, video_config=cfg)
        mc = model.config
        # Megatron-LM's choices reach the model unchanged; only the video fields are added
        assert (mc.normalization, mc.init_method_std, mc.layernorm_epsilon) == (
            "RMSNorm",
            0.011,
            1e-5,
        )
        assert mc.lora_rank == cfg.model.lora_rank and mc.in_channels == cfg.vae.latent_channels
        assert mc.params_dtype == torch.float32 and not mc.bf16
        train, valid, test = mod.train_valid_test_datasets_provider([8, 0, 0])
        out, loss_func = mod.forward_step(iter([default_collate([train[3]])]), model, step=0)
        loss, logs = loss_func(out)
        loss.backward()
        grads = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
        total, count = logs["loss"].tolist()  # Megatron's (sum, count) of the logged loss
        assert count == 1.0
        return total, grads, len(train), valid, "megatron.training" in sys.modules
    finally:
        destroy_video_parallel()
        destroy_model_parallel()


def test_megatron_lm_entry_providers(pool4, vae_dir):
    mod = load_example()
    assert "megatron.training" not in sys.modules  # importable without Megatron-LM
    yaml_path = _tiny_yaml(vae_dir)
    cfg = mod.video_config_from_args(_entry_args(mod, yaml_path), world_size=4)
    p = cfg.parallel
    assert (p.context_parallel_size, p.ulysses_size, p.ring_size) == (4, 2, 2)
    assert cfg.train.seed == 5 and mod.sequence_length(cfg) == 32
    with pytest.raises(
        ValueError, match=r"--seq-length \(7\) must be the model's tokens per sample \(32\)"
    ):
        mod.video_config_from_args(_entry_args(mod, yaml_path, seq_length=7))
    with pytest.raises(
        ValueError, match=r"--hidden-size \(64\) must equal the video config's value \(48\)"
    ):
        mod.video_config_from_args(_entry_args(mod, yaml_path, hidden_size=64))
    results = pool4.run(_pretrain_entry_step, str(yaml_path))  # written once, here
    losses = {r[0] for r in results}
    assert len(losses) == 1 and math.isfinite(losses.pop())  # the CP-reduced loss, same everywhere
    assert all(r[1] > 0 and r[2] == 8 and r[3] is None and not r[4] for r in results)


@pytest.mark.parametrize("entry", ["pretrain_video_dit", "pretrain_video_llava"])
def test_megatron_lm_entry_calls_both_pretrain_signatures(entry):
    """main()'s pretrain call matches the signature it finds (<= 0.17 and >= 0.18 forms)."""
    mod = load_example(entry)
    calls = []

    def pretrain_017(
        train_valid_test_dataset_provider,
        model_provider,
        model_type,
        forward_step_func,
        process_non_loss_data_func=None,
        extra_args_provider=None,
        args_defaults={},
    ):
        calls.append(("0.17", model_provider, forward_step_func, extra_args_provider))

    def pretrain_018(
        cfg_container,
        train_valid_test_dataset_provider,
        model_provider,
        model_type,
        forward_step_func,
        process_non_loss_data_func=None,
    ):
        calls.append(("0.18", cfg_container, model_provider, forward_step_func))

    def pretrain_019(
        cfg_container,
        train_valid_test_dataset_provider,
        model_type,
        forward_step_func,
        model_provider=None,
        process_non_loss_data_func=None,
    ):
        calls.append(("0.19", cfg_container, model_provider, forward_step_func))

    parsed = []

    def parse_and_validate_args(
        extra_args_provider=None, ignore_unknown_args=False, args_defaults={}
    ):
        parsed.append(extra_args_provider)
        return "ARGS"

    for fn in (pretrain_017, pretrain_018, pretrain_019):
        mod.run_pretrain(fn, parse_and_validate_args, lambda args: ("CONTAINER", args))
    assert calls[0] == ("0.17", mod.model_provider, mod.forward_step, mod.add_video_args)
    for version, call in zip(("0.18", "0.19"), calls[1:]):
        assert call == (version, ("CONTAINER", "ARGS"), mod.model_provider, mod.forward_step)
    assert parsed == [mod.add_video_args] * 2
    assert mod.train_valid_test_datasets_provider.is_distributed


def test_lone_process_group_leaves_the_environment_alone():
    """A world of one (``train`` / ``generate`` in-process) must not leave ``RANK`` / ``WORLD_SIZE``
    / ``LOCAL_RANK`` behind: a later ``--nproc`` launch from the same process would read them as
    torchrun's and refuse."""
    code = (
        "import os, torch.distributed as dist\n"
        "from megatron_video.training.trainer import init_distributed\n"
        "before = dict(os.environ)\n"
        "assert init_distributed() and dist.get_world_size() == 1\n"
        "dist.destroy_process_group()\n"
        "assert dict(os.environ) == before, set(os.environ) ^ set(before)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
