"""``megatron-video``: train video DiTs with megatron_video on Megatron-Core.

Subcommands ``train``, ``demo``, ``train-vae``, ``validate``, ``prepare``, ``precompute``,
``buckets``, ``convert``, ``plan``, ``generate`` (``megatron-video SUBCOMMAND --help``). A bad
configuration exits with status 2 naming the field, before any process or process group is started.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

import yaml

from .config import config_to_dict, load_config, validate

__all__ = ["main", "demo_config_path"]

DEMO_ARGS = dict(nproc=4, ranks_per_node=2, output="runs/demo")


def demo_config_path() -> Path:
    """``examples/configs/demo.yaml`` of the source checkout this package runs from."""
    import megatron_video

    path = Path(megatron_video.__file__).resolve().parents[1] / "examples" / "configs" / "demo.yaml"
    if not path.is_file():
        raise ValueError(
            f"demo config ({path}) not found: run `megatron-video demo` from an editable "
            f"install of the repository (pip install -e .)"
        )
    return path


CPU_HELP = "enter CPU mode for Megatron-Core on a machine without CUDA (logged; no-op on a GPU)"


def _common(p, config_required: bool) -> None:
    p.add_argument(
        "--config", required=config_required, help="YAML config (examples/configs/*.yaml)"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. train.steps=20 parallel.ulysses_size=2",
    )


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train a model (standalone --nproc ranks or under torchrun)")
    _common(t, True)
    t.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="spawn this many local ranks (gloo on CPU); default 1, or torchrun's world",
    )
    t.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="simulated ranks per node for the U x R placement (default: all on one node)",
    )
    t.add_argument("--output", default=None, help="run directory (default: the config's output)")
    t.add_argument("--cpu", action="store_true", help=CPU_HELP)


def _add_demo(sub) -> None:
    d = sub.add_parser(
        "demo", help="the embedded demo: causal AR DiT, Balanced SP, 4 CPU ranks as 2x2"
    )
    d.add_argument("overrides", nargs="*", metavar="section.key=value")
    d.add_argument(
        "--output", default=DEMO_ARGS["output"], help="run directory (default runs/demo)"
    )
    d.add_argument("--cpu", action="store_true", help=CPU_HELP)


def _add_train_vae(sub) -> None:
    v = sub.add_parser("train-vae", help="train (and cache) the small causal video VAE")
    _common(v, False)
    v.add_argument("--output", default=None, help="weights file (default: the cache path)")


def _add_prepare(sub) -> None:
    pr = sub.add_parser(
        "prepare", help="videos + captions -> an energon dataset (WebDataset + .nv-meta)"
    )
    pr.add_argument("paths", nargs="+", metavar="SRC DST", help="SRC DST, or DST with --procedural")
    pr.add_argument(
        "--manifest", default=None, help='JSONL of {"video": path under SRC, "caption": ...}'
    )
    pr.add_argument("--samples-per-shard", type=int, default=64)
    pr.add_argument(
        "--procedural",
        type=int,
        default=None,
        metavar="N",
        help="write N procedural mp4 clips (the embedded default data) and prepare them",
    )
    pr.add_argument(
        "--config", default=None, help="config whose data section sizes the procedural clips"
    )
    pr.add_argument("--overrides", nargs="*", default=[], metavar="section.key=value")


def _add_precompute(sub) -> None:
    pc = sub.add_parser(
        "precompute", help="energon dataset -> latent shards (VAE once, SP-folded windows)"
    )
    _common(pc, True)
    pc.add_argument(
        "--out", required=True, help="output folder of latent shards (data.shards for training)"
    )
    pc.add_argument(
        "--sp-size", type=int, default=1, help="encode each clip as this many halo windows"
    )
    pc.add_argument(
        "--text-encoder",
        default=None,
        help="local HF folder (tokenizer + T5/UMT5 encoder): store caption embeddings too",
    )
    pc.add_argument(
        "--text-len", type=int, default=64, help="tokens per caption for --text-encoder"
    )


def _add_buckets(sub) -> None:
    b = sub.add_parser(
        "buckets", help="map a prepared dataset's clips to the data.buckets grid; print a summary"
    )
    _common(b, True)
    b.add_argument("--out", default=None, help="write the per-clip plans (JSON) to this file")


def _add_validate(sub) -> None:
    c = sub.add_parser(
        "validate", help="check a config without running it; print the resolved config"
    )
    _common(c, True)
    c.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="world size to check against (default: the one the config implies, DP 1)",
    )
    c.add_argument("--ranks-per-node", type=int, default=None)


def _add_convert(sub) -> None:
    cv = sub.add_parser(
        "convert",
        help="Wan weights: diffusers folder <-> Megatron dist-checkpoint (docs/wan.md); "
        "Qwen2.5-VL: Hugging Face folder <-> checkpoint (docs/mmsp.md)",
    )
    way = cv.add_mutually_exclusive_group(required=True)
    way.add_argument(
        "--from-diffusers", metavar="DIR", help="WanTransformer3DModel folder (safetensors)"
    )
    way.add_argument(
        "--to-diffusers", metavar="CKPT", help="checkpoint written by convert --from-diffusers"
    )
    way.add_argument(
        "--from-hf", metavar="DIR", help="Qwen2.5-VL Hugging Face folder (safetensors)"
    )
    way.add_argument("--to-hf", metavar="CKPT", help="checkpoint written by convert --from-hf")
    cv.add_argument("--output", required=True, help="checkpoint folder, or diffusers folder")
    for name in ("tensor", "pipeline"):
        cv.add_argument(
            f"--{name}-model-parallel-size",
            type=int,
            default=None,
            help=f"{name} parallel size the checkpoint must load under (checked; default 1)",
        )


def _add_plan(sub) -> None:
    from .planning import add_plan_arguments

    add_plan_arguments(
        sub.add_parser("plan", help="predict step time / memory / MFU of every parallel layout")
    )


def _add_generate(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="stream a video from an AR checkpoint, block by block with a KV cache "
        "(docs/generation.md)",
    )
    g.add_argument("--checkpoint", required=True, help="run folder of `train` (or its checkpoints)")
    g.add_argument("--prompt", required=True, help="the caption")
    g.add_argument("--frames", type=int, required=True, help="raw frames: 1 + 4 (F - 1), F blocks")
    g.add_argument(
        "--switch",
        action="append",
        default=[],
        metavar="FRAME:PROMPT",
        help="from raw frame FRAME (a block start) on, PROMPT (repeatable; KV re-cache)",
    )
    g.add_argument("--image", default=None, help="first-frame image (TI2V families only)")
    g.add_argument("--output", default="generated", help="writes OUTPUT.mp4 and OUTPUT.gif")
    g.add_argument("--sink", type=int, default=0, help="latent frames always attended (sink)")
    g.add_argument(
        "--window",
        type=int,
        default=None,
        help="latent frames attended before a block (default: the trained length less a block)",
    )
    g.add_argument(
        "--recache",
        choices=("block_causal", "longlive"),
        default="block_causal",
        help="KV re-cache at a --switch: block_causal (ours: sink + window re-encoded block by "
        "block) or longlive (LongLive v1.0: the last window + one block in one bidirectional "
        "pass, the sink's old-prompt keys / values kept)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--text-encoder", default=None, help="wan_ar: local UMT5 / T5 folder (encoder + tokenizer)"
    )
    g.add_argument(
        "--vae", default=None, help="wan_ar: local AutoencoderKLWan folder (default vae.diffusers)"
    )
    g.add_argument("--cpu", action="store_true", help=CPU_HELP)


SUBCOMMANDS = (
    _add_train,
    _add_demo,
    _add_train_vae,
    _add_prepare,
    _add_precompute,
    _add_buckets,
    _add_validate,
    _add_convert,
    _add_plan,
    _add_generate,
)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="megatron-video",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show Megatron's / diffusers' known environment warnings in full (default: one line)",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return ap


def _load(path, overrides: List[str], output: Optional[str], ranks_per_node: Optional[int]):
    extra = []
    if output is not None:
        extra.append(f"output={output}")
    if ranks_per_node is not None:
        extra.append(f"parallel.ranks_per_node={ranks_per_node}")
    return load_config(path, list(overrides) + extra)


def _train(config, nproc: Optional[int], cpu: bool = False) -> int:
    from .launch import launch, under_torchrun

    if under_torchrun():
        if nproc is not None:
            raise ValueError("--nproc cannot be used under torchrun (torchrun starts the ranks)")
        import os

        import torch

        validate(config, int(os.environ["WORLD_SIZE"]), torch.cuda.is_available())
        from .trainer import train

        train(config, cpu=cpu)
        return 0
    nproc = 1 if nproc is None else nproc
    if nproc < 1:
        raise ValueError(f"--nproc ({nproc}) must be >= 1")
    import torch

    validate(config, nproc, torch.cuda.is_available())  # the run: this machine's device rules
    return launch(config, nproc, config.parallel.ranks_per_node, cpu=cpu)


def _implied_world_size(config) -> int:
    """``validate`` without ``--nproc``: TP x PP x CP (data parallel 1), said on the console."""
    p = config.parallel
    n = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    print(
        f"[megatron-video] validate: no --nproc; assuming world size {n} = TP "
        f"{p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} x CP "
        f"{p.context_parallel_size} x DP 1 (the config's; --nproc N checks another)",
        file=sys.stderr,
    )
    return n


DEMO_CLIPS = 128  # procedural mp4 clips of the demo's energon dataset (it repeats over epochs)


def _ensure_demo_data(config) -> None:
    """The demo reads real mp4 files through energon: prepare them once (``prepare --procedural``)."""
    d = config.data
    if d.source != "energon":
        return
    if d.path == "runs/demo/data":  # the shipped default follows --output
        d.path = str(Path(config.output) / "data")
    if (Path(d.path) / ".nv-meta" / "dataset.yaml").is_file():
        return
    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos

    print(
        f"[megatron-video] writing {DEMO_CLIPS} procedural mp4 clips and preparing the energon dataset "
        f"{d.path} (once)",
        flush=True,
    )
    src = Path(d.path) / "videos"
    write_procedural_videos(
        src, DEMO_CLIPS, num_frames=d.num_frames, height=d.height, width=d.width, seed=d.seed
    )
    prepare_dataset(src, d.path)


def _prepare(args) -> int:
    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos

    if args.procedural is not None:
        if len(args.paths) != 1:
            raise ValueError(f"prepare --procedural takes DST only (got {args.paths})")
        if args.procedural < 1:
            raise ValueError(f"--procedural ({args.procedural}) must be >= 1")
        dst = Path(args.paths[0])
        d = load_config(args.config, args.overrides).data
        src = dst / "videos"
        write_procedural_videos(
            src,
            args.procedural,
            num_frames=d.num_frames,
            height=d.height,
            width=d.width,
            seed=d.seed,
        )
    else:
        if len(args.paths) != 2:
            raise ValueError(f"prepare takes SRC DST (got {args.paths})")
        src, dst = Path(args.paths[0]), Path(args.paths[1])
    summary = prepare_dataset(
        src, dst, manifest=args.manifest, samples_per_shard=args.samples_per_shard
    )
    print(
        f"[megatron-video] energon dataset {dst}: {summary['samples']} samples in {len(summary['shards'])} "
        f"shards; {len(summary['skipped'])} unreadable videos skipped"
    )
    for f, why in summary["skipped"]:
        print(f"[megatron-video]   skipped {f}: {why}")
    return 0


def _buckets(args) -> int:
    """Every clip of ``data.path`` mapped by ``bucket_grid(config)`` (docs/data.md)."""
    import dataclasses
    import json

    from megatron_video.data.energon_video import dataset_records

    from .config import bucket_grid

    config = load_config(args.config, args.overrides)
    config.data.validate()
    if not config.data.path:
        raise ValueError("data.path (None) must name a dataset from `megatron-video prepare`")
    grid, errors = bucket_grid(config), []
    plans = grid.plan_many(dataset_records(config.data.path), errors)
    rows = grid.histogram(plans)
    for r in rows:
        stats = (
            f" ({r['images']} images), tokens mean {r['mean_tokens']:.0f} max "
            f"{r['max_tokens']}, frame area kept {100 * r['mean_kept']:.1f} %"
        )
        print(
            f"[megatron-video] bucket {r['bucket']} {r['pixels_hw'][0]}x{r['pixels_hw'][1]} px "
            f"(latent {r['latent_hw'][0]}x{r['latent_hw'][1]}): {r['clips']} clips"
            + (stats if r["clips"] else "")
        )
    for key, why in errors:
        print(f"[megatron-video]   left out {key}: {why}")
    if args.out:
        blob = dict(buckets=rows, clips=[dataclasses.asdict(p) for p in plans], skipped=errors)
        Path(args.out).write_text(json.dumps(blob, indent=1))
    return 0


def _convert_qwen_vl(args) -> int:
    from megatron_video.models.qwen_vl.convert import checkpoint_to_hf, hf_to_checkpoint

    given = [k for k in ("tensor", "pipeline") if getattr(args, f"{k}_model_parallel_size")]
    if given:
        raise ValueError(
            f"--{given[0]}-model-parallel-size applies to --from-diffusers only (a qwen_vl "
            f"checkpoint loads under any layout)"
        )
    if args.to_hf is not None:
        out = checkpoint_to_hf(args.to_hf, args.output)
        print(f"[megatron-video] Hugging Face Qwen2.5-VL folder written to {out}")
    else:
        out = hf_to_checkpoint(args.from_hf, args.output)
        print(f"[megatron-video] Megatron dist-checkpoint written to {out}")
    return 0


def _convert(args) -> int:
    from megatron_video.models.wan.convert import checkpoint_to_diffusers, diffusers_to_checkpoint

    if args.from_hf is not None or args.to_hf is not None:
        return _convert_qwen_vl(args)

    sizes = dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    if args.to_diffusers is not None:
        given = sorted(k for k, v in sizes.items() if v is not None)
        if given:
            raise ValueError(
                f"--{given[0].replace('_', '-')} applies to --from-diffusers only (a checkpoint "
                f"loads under any layout)"
            )
        out = checkpoint_to_diffusers(args.to_diffusers, args.output)
        print(f"[megatron-video] diffusers WanTransformer3DModel folder written to {out}")
        return 0
    sizes = {k: 1 if v is None else v for k, v in sizes.items()}
    out = diffusers_to_checkpoint(args.from_diffusers, args.output, **sizes)
    print(f"[megatron-video] Megatron dist-checkpoint written to {out}")
    return 0


def _generate(args) -> int:
    """``generate`` in this process: a world of one, or every rank under torchrun."""
    import torch.distributed as dist

    from megatron_video.compat import destroy_model_parallel
    from megatron_video.generation.video_out import parse_switch
    from megatron_video.parallel.topology import destroy_video_parallel

    from .generate import generate
    from .trainer import init_distributed

    switches = [parse_switch(s) for s in args.switch]
    owns = init_distributed()
    try:
        r = generate(
            args.checkpoint,
            args.prompt,
            args.frames,
            switches=switches,
            image=args.image,
            output=args.output,
            sink=args.sink,
            window=args.window,
            recache=args.recache,
            seed=args.seed,
            text_encoder=args.text_encoder,
            vae=args.vae,
        )
    finally:
        destroy_video_parallel()
        destroy_model_parallel()
        if owns and dist.is_initialized():
            dist.destroy_process_group()
    if "mp4" in r:
        print(f"[megatron-video] wrote {r['mp4']} ({r['written_frames']} frames) and {r['gif']}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    import os

    from .console import quiet_known_warnings

    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in argv  # anywhere on the line, before or after the subcommand
    argv = (["--verbose"] if verbose else []) + [a for a in argv if a != "--verbose"]
    quiet_known_warnings(verbose, console=os.environ.get("RANK", "0") == "0")
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            config = _load(args.config, args.overrides, args.output, args.ranks_per_node)
            return _train(config, args.nproc, args.cpu)
        if args.command == "demo":
            config = _load(
                demo_config_path(), args.overrides, args.output, DEMO_ARGS["ranks_per_node"]
            )
            _ensure_demo_data(config)
            return _train(config, DEMO_ARGS["nproc"], args.cpu)
        if args.command == "train-vae":
            from .vae_stage import train_vae, vae_cache_path

            config = load_config(args.config, args.overrides)
            out = Path(args.output) if args.output else vae_cache_path(config)
            print(f"[megatron-video] VAE written to {train_vae(config, out)}")
            return 0
        if args.command == "precompute":
            from .precompute import precompute_latents

            config = load_config(args.config, args.overrides)
            text = None
            if args.text_encoder:
                from megatron_video.data.text import HFTextEncoder

                text = HFTextEncoder.from_pretrained(args.text_encoder, args.text_len)
            r = precompute_latents(
                config, args.out, sp_size=args.sp_size, text_encoder=text, progress=True
            )
            print(
                f"[megatron-video] {r['samples']} latent samples in {len(r['shards'])} shards "
                f"under {args.out} "
                f"({r['skipped']} unreadable clips skipped); train with data.source=shards "
                f"data.shards={args.out}"
            )
            for key, why in r.get("left_out", []):
                print(f"[megatron-video]   left out {key}: {why}")
            return 0
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "buckets":
            return _buckets(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "plan":
            from .planning import plan_command

            return plan_command(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "validate":
            config = _load(args.config, args.overrides, None, args.ranks_per_node)
            nproc = args.nproc
            if nproc is None:
                nproc = _implied_world_size(config)
            validate(config, nproc)  # for the machines it will run on: no device rule here
            print(yaml.safe_dump(config_to_dict(config), sort_keys=False))
            return 0
    except ValueError as e:
        print(f"megatron-video: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
