"""Tiny random Wan 2.2 TI2V folders for a config (nothing downloaded), as the README's "Train
Wan" walkthrough makes them::

    python -m megatron_video.testing.tiny_wan22 --config examples/configs/wan22_ti2v_tiny.yaml \
        --out runs/wan22_tiny

writes under ``--out``: ``transformer/`` (a diffusers ``WanTransformer3DModel`` of the config's
sizes), ``vae/`` (an ``AutoencoderKLWan`` with Wan 2.2's keys: 16x spatial incl. its 2x2 patch,
4x temporal, ``z_dim`` = ``vae.latent_channels``), ``umt5/`` (a UMT5 encoder of width
``data.text_embed_dim`` and a WordLevel tokenizer trained on the captions) and ``data/`` (raw
procedural mp4 clips of the config's frames / height / width with captions, prepared as an energon
dataset, as ``megatron-video prepare`` does). The pieces are ``testing.wan``'s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["make_tiny_wan22"]


def make_tiny_wan22(config, out, num_clips: int = 8) -> dict:
    """The four folders for ``config`` (a ``TrainConfig``) under ``out``; returns ``{name: path}``
    (``transformer``, ``vae``, ``umt5``, ``data``)."""
    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos

    from .wan import save_tiny_umt5, save_tiny_wan_transformer, save_tiny_wan_vae

    out, d = Path(out), config.data
    paths = {k: out / k for k in ("transformer", "vae", "umt5", "data")}
    write_procedural_videos(
        out / "videos",
        num_clips,
        num_frames=d.num_frames,
        height=d.height,
        width=d.width,
        seed=d.seed,
    )
    prepare_dataset(out / "videos", paths["data"])
    captions = [p.read_text() for p in sorted((out / "videos").glob("*.txt"))]
    save_tiny_umt5(paths["umt5"], captions, d_model=d.text_embed_dim)
    save_tiny_wan_vae(paths["vae"], z_dim=config.vae.latent_channels, wan22=True)
    save_tiny_wan_transformer(paths["transformer"], config)
    return {k: str(v) for k, v in paths.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_video.testing.tiny_wan22", description=__doc__.split("::")[0]
    )
    ap.add_argument("--config", required=True, help="a wan / wan_ar YAML (its sizes)")
    ap.add_argument("--out", required=True, help="folder to write transformer/ vae/ umt5/ data/ in")
    ap.add_argument("--clips", type=int, default=8, help="raw clips to write (default 8)")
    ap.add_argument("--verbose", action="store_true", help="show known environment warnings")
    args = ap.parse_args(argv)
    from megatron_video.training.console import quiet_known_warnings

    quiet_known_warnings(args.verbose)  # as megatron-video: the known ones in one line
    from megatron_video.training.config import load_config

    for name, path in make_tiny_wan22(load_config(args.config), args.out, args.clips).items():
        print(f"[tiny_wan22] {name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
