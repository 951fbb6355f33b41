"""Wan weights in and out: a diffusers folder <-> a Megatron dist-checkpoint (through ``mapping``).

The checkpoint has the trainer's Megatron-LM layout (training/checkpoint.py):
``<dir>/iter_0000000/`` (a ``megatron.core.dist_checkpointing`` checkpoint of ``{"model": ...}``,
global shapes, so it loads under any TP / PP / CP layout), ``manifest.json`` (size and SHA-256
of every file, the trainer's format), ``diffusers_config.json`` (the full diffusers config and
the parameter dtype) and ``<dir>/latest_checkpointed_iteration.txt``. Conversion runs in one
process (a one-rank gloo group is made if none exists). Weights are never cast: the round trip is
bit-identical. Keys diffusers ignores when loading are ignored here too (not written back).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_video.compat.manifest import MANIFEST_FILE, write_manifest
from megatron_video.compat.manifest import file_manifest as _manifest
from megatron_video.models.wan.interop import (
    CLASS_NAME,
    full_diffusers_config,
    global_param_name,
    load_full_weights,
    read_diffusers_folder,
    wan_config,
)
from megatron_video.models.wan.mapping import ignored_diffusers_key, to_diffusers, to_megatron
from megatron_video.models.wan.model import WanModel
from megatron_video.models.wan.wan_layer_specs import get_wan_layer_spec

__all__ = [
    "diffusers_to_checkpoint",
    "checkpoint_to_diffusers",
    "load_wan_transformer",
    "CONFIG_FILE",
    "STEP",
]

TRACKER_FILE = "latest_checkpointed_iteration.txt"  # as training/checkpoint.py
CONFIG_FILE = "diffusers_config.json"
STEP = 0


def _iter_dir(directory, step: int) -> Path:
    return Path(directory) / f"iter_{step:07d}"


@contextmanager
def _one_process():
    """Megatron parallel state of one process (TP = PP = CP = 1), made here if absent."""
    from megatron.core import parallel_state as ps

    from megatron_video.compat import ensure_cpu_mode, initialize_model_parallel

    if not torch.cuda.is_available():
        ensure_cpu_mode()
    made_pg = not dist.is_initialized()
    if made_pg:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    made_ps = not ps.model_parallel_is_initialized()
    if made_ps:
        initialize_model_parallel(tensor_model_parallel_size=1)
    sizes = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_context_parallel_world_size(),
    )
    try:
        if dist.get_world_size() != 1 or sizes != (1, 1, 1):
            raise ValueError(
                f"conversion runs in one process (world size "
                f"{dist.get_world_size()}, TP/PP/CP {sizes}); the checkpoint it "
                f"writes loads under any layout"
            )
        yield
    finally:
        if made_ps:
            ps.destroy_model_parallel()
        if made_pg:
            dist.destroy_process_group()


def _one_dtype(sd: dict) -> torch.dtype:
    dtypes = {}
    for k, v in sd.items():
        if not ignored_diffusers_key(k):
            dtypes.setdefault(v.dtype, k)
    if len(dtypes) != 1:
        raise ValueError(
            f"weights must have one dtype (got {sorted(map(str, dtypes))}, e.g. "
            f"keys {sorted(dtypes.values())}); convert them to one dtype first"
        )
    return next(iter(dtypes))


def _check_layout(config: dict, tp: int, pp: int) -> None:
    for name, value, of, what in (
        ("tensor_model_parallel_size", tp, "num_attention_heads", "heads"),
        ("pipeline_model_parallel_size", pp, "num_layers", "layers"),
    ):
        if not isinstance(value, int) or value < 1 or config[of] % value:
            raise ValueError(
                f"{name} ({value}) must be a positive divisor of {of} "
                f"({config[of]}): each rank holds whole {what}"
            )


def _params_only(model: WanModel, sd: dict) -> dict:
    names = {global_param_name(model, n) for n, _ in model.named_parameters()}
    return {k: v for k, v in sd.items() if k in names}


def checkpoint_meta(full_config: dict, dtype, tensor_parallel: int, pipeline_parallel: int) -> str:
    """The text of ``CONFIG_FILE``: what ``checkpoint_to_diffusers`` and ``init_from`` read."""
    meta = dict(
        diffusers_config=full_config,
        params_dtype=str(dtype).replace("torch.", ""),
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    return json.dumps(meta, indent=1, sort_keys=True)


def diffusers_to_checkpoint(
    source, output, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1
) -> Path:
    """Write the Megatron dist-checkpoint of the diffusers folder ``source`` under ``output``;
    returns the ``iter_0000000`` folder. ``tensor_model_parallel_size`` /
    ``pipeline_model_parallel_size``: the layout it must load under (checked against the model;
    the checkpoint itself is layout-free). ``ValueError`` names bad keys, shapes, config fields."""
    from megatron.core import dist_checkpointing

    config, sd = read_diffusers_folder(source)
    full = full_diffusers_config(config)
    _check_layout(full, tensor_model_parallel_size, pipeline_model_parallel_size)
    dtype = _one_dtype(sd)
    final = _iter_dir(output, STEP)
    partial = final.with_name(final.name + ".partial")
    with _one_process():
        cfg = wan_config(config, params_dtype=dtype)
        weights = to_megatron(sd, cfg, full)
        model = WanModel(cfg, layer_spec=get_wan_layer_spec(cfg))
        load_full_weights(model, weights)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(partial))
    meta = checkpoint_meta(full, dtype, tensor_model_parallel_size, pipeline_model_parallel_size)
    (partial / CONFIG_FILE).write_text(meta)
    write_manifest(partial)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    tmp = Path(output) / f"{TRACKER_FILE}.tmp{os.getpid()}"
    tmp.write_text(str(STEP))
    os.replace(tmp, Path(output) / TRACKER_FILE)
    return final


def _read_checkpoint_meta(directory) -> tuple:
    tracker = Path(directory) / TRACKER_FILE
    text = tracker.read_text().strip() if tracker.is_file() else ""
    if not text.isdigit():
        raise ValueError(
            f"checkpoint ({directory}) must hold {TRACKER_FILE} with an iteration "
            f"number (got {text!r})"
        )
    path = _iter_dir(directory, int(text))
    try:
        want = json.loads((path / MANIFEST_FILE).read_text())["files"]
        meta = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"checkpoint {path} must hold {MANIFEST_FILE} and {CONFIG_FILE} (a Wan "
            f"checkpoint written by convert): {type(e).__name__}: {e}"
        ) from None
    if _manifest(path) != want:
        raise ValueError(
            f"checkpoint {path}: files differ from {MANIFEST_FILE} (missing, extra, "
            f"truncated or modified)"
        )
    return path, meta


def weights_request(model) -> dict:
    """The model's sharded weights to load from a convert or trainer checkpoint: tensors only
    (the trainer saves no ``_extra_state`` objects)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {k: v for k, v in model.sharded_state_dict().items() if isinstance(v, ShardedTensor)}


def _check_against_index(path: Path, request: dict) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = {
        k: tuple(v.global_shape)
        for k, v in dist_checkpointing.load_tensors_metadata(str(path)).items()
    }
    wanted = {
        v.key: tuple(v.global_shape) for v in request.values() if isinstance(v, ShardedTensor)
    }
    # a trainer's checkpoint also holds the optimizer's state and the RNG states: not weights
    saved = {k: v for k, v in saved.items() if not k.startswith(("optimizer.", "rng."))}
    for key in sorted(set(saved) | set(wanted)):
        if key not in saved or key not in wanted or saved[key] != wanted[key]:
            raise ValueError(
                f"checkpoint {path}: key {key!r} has shape {saved.get(key)} in the "
                f"checkpoint, {wanted.get(key)} in the model of its "
                f"{CONFIG_FILE} (config does not match the weights)"
            )


def checkpoint_to_diffusers(checkpoint, output) -> Path:
    """Write a folder ``WanTransformer3DModel.from_pretrained`` loads (``config.json`` +
    ``diffusion_pytorch_model.safetensors``) from a checkpoint of ``diffusers_to_checkpoint`` or of
    ``megatron-video train`` (family ``wan`` / ``wan_ar``)."""
    import diffusers
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    path, meta = _read_checkpoint_meta(checkpoint)
    full = full_diffusers_config(meta.get("diffusers_config", {}))
    dtype = getattr(torch, str(meta.get("params_dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"{CONFIG_FILE} params_dtype ({meta.get('params_dtype')!r}) must name a torch dtype"
        )
    with _one_process():
        cfg = wan_config(full, params_dtype=dtype)
        model = WanModel(cfg, layer_spec=get_wan_layer_spec(cfg))
        request = weights_request(model)
        _check_against_index(path, request)
        loaded = dist_checkpointing.load({"model": request}, str(path))["model"]
        model.load_state_dict(loaded, strict=False)
        shapes = {global_param_name(model, n): tuple(p.shape) for n, p in model.named_parameters()}
        weights = _params_only(
            model, {global_param_name(model, n): p.detach() for n, p in model.named_parameters()}
        )
        sd = to_diffusers(weights, cfg, full, shapes)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in sd.items()},
        str(out / "diffusion_pytorch_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = {"_class_name": CLASS_NAME, "_diffusers_version": diffusers.__version__, **full}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def load_wan_transformer(folder):
    """diffusers' ``WanTransformer3DModel`` of a folder, loaded without ``accelerate``: diffusers
    0.42's ``from_pretrained`` needs it to keep its fp32 modules (``ValueError`` without). Built
    with ``from_config`` and a strict ``load_state_dict`` (safetensors only; weights in the
    folder's dtype, no fp32 islands kept: cast them yourself if the folder is bf16). Pass it to
    ``WanPipeline.from_pretrained(pipeline_dir, transformer=load_wan_transformer(...))``."""
    from diffusers import WanTransformer3DModel

    config, sd = read_diffusers_folder(folder)
    model = WanTransformer3DModel.from_config(full_diffusers_config(config))
    sd = {k: v for k, v in sd.items() if not ignored_diffusers_key(k)}
    try:
        model.to(_one_dtype(sd)).load_state_dict(sd, strict=True)
    except RuntimeError as e:  # names the missing / unexpected keys and shapes
        raise ValueError(f"weights of {folder} do not fit its config.json: {e}") from None
    return model.eval()
