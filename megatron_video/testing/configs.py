"""Tiny job configs and example-entry loading shared by the training tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["tiny_config", "load_example", "REPO_ROOT", "TINY_TRAIN"]

REPO_ROOT = Path(__file__).resolve().parents[2]
_TINY_EXTRAS = {"stdit": dict(stdit_full_attention_layers=[1])}  # per-family extras of tiny_config


# the train section of the tiny test configs: 2 quick steps, no outputs (testing.wan uses it too)
TINY_TRAIN = dict(
    steps=2,
    lr=1e-3,
    warmup_steps=0,
    sample=False,
    progress=False,
    tensorboard=False,
    save=False,
    resume=False,
)


def tiny_config(family: str, tmp: str, **parallel):
    """A tiny job: 13 raw frames (4 latent frames) of 16x16 (2x2 latent), 2 layers of width 48."""
    from megatron_video.training.config import config_from_dict

    model = dict(
        family=family,
        num_layers=2,
        hidden_size=48,
        num_attention_heads=4,
        lora_rank=8,
        patch_size=[1, 1, 1],
        frames_per_block=1,
    )
    model.update(_TINY_EXTRAS.get(family, {}))
    return config_from_dict(
        dict(
            model=model,
            parallel=dict(parallel),
            data=dict(num_frames=13, height=16, width=16, num_samples=64),
            vae=dict(base_channels=4, train_steps=1, batch_size=1, cache_dir=f"{tmp}/cache"),
            diffusion=dict(cfg_dropout=0.5, sample_steps=3),
            train=dict(TINY_TRAIN, micro_batch_size=1, global_batch_size=4),
            output=f"{tmp}/run",
        )
    )


def load_example(name: str = "pretrain_video_dit"):
    """Import ``examples/<name>.py`` of this checkout as a module (the Megatron-LM entries)."""
    path = REPO_ROOT / "examples" / f"{name}.py"
    if not path.is_file():
        raise ValueError(
            f"name ({name!r}): {path} does not exist (examples/ ships with the "
            "source checkout, not with an installed wheel)"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
