"""Qwen2.5-VL weights in and out: a Hugging Face folder <-> a Megatron dist-checkpoint (through
the mapping table of ``weights``).

The checkpoint has the layout of ``models.wan.convert`` (the trainer's): ``<dir>/iter_0000000/``
(a ``megatron.core.dist_checkpointing`` checkpoint of ``{"model": ...}``, global shapes),
``manifest.json``, ``qwen_vl_config.json`` (the HF config and the parameter dtype), the folder's
tokenizer / processor files under ``hf_files/``, and ``latest_checkpointed_iteration.txt``.
Weights are never cast: folder -> checkpoint -> folder is bit-identical.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Tuple

import torch

from ...compat.manifest import MANIFEST_FILE, write_manifest
from ...compat.manifest import file_manifest as _manifest
from .config import ARCHITECTURE, check_hf_config, language_config, tie_word_embeddings
from .model import QwenVLModel
from .weights import to_hf, to_megatron

__all__ = ["hf_to_checkpoint", "checkpoint_to_hf", "read_hf_folder", "CONFIG_FILE"]

CONFIG_FILE = "qwen_vl_config.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
HF_FILES = "hf_files"
STEP = 0
# processor fields that must agree with the vision config: (file field, vision_config field)
_PROCESSOR_FIELDS = (
    ("patch_size", "patch_size"),
    ("temporal_patch_size", "temporal_patch_size"),
    ("merge_size", "spatial_merge_size"),
)


def _check_processor(path: Path, hf_config) -> None:
    vc = hf_config.vision_config
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        f = path / name
        if not f.is_file():
            continue
        proc = json.loads(f.read_text())
        for field, ours in _PROCESSOR_FIELDS:
            if field in proc and int(proc[field]) != int(getattr(vc, ours)):
                raise ValueError(
                    f"{name} {field} ({proc[field]}) must equal config.json vision_config."
                    f"{ours} ({getattr(vc, ours)}): processor and model disagree"
                )


def read_hf_folder(path) -> Tuple[object, Dict[str, torch.Tensor]]:
    """``(Qwen2_5_VLConfig, state dict)`` of a Hugging Face Qwen2.5-VL folder (safetensors)."""
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"path ({path}) must be a Hugging Face model folder with config.json")
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") != "qwen2_5_vl" or ARCHITECTURE not in raw.get("architectures", []):
        raise ValueError(
            f"config.json model_type ({raw.get('model_type')!r}) / architectures "
            f"({raw.get('architectures')}) must be 'qwen2_5_vl' / [{ARCHITECTURE!r}]"
        )
    hf_config = Qwen2_5_VLConfig.from_pretrained(str(path))
    check_hf_config(hf_config)
    _check_processor(path, hf_config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"path ({path}) holds no safetensors weights (pickled weights refused)")
    sd: Dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            if k in sd:
                raise ValueError(f"key {k!r} is in more than one weight file of {path}")
            sd[k] = v
    return hf_config, sd


def _one_dtype(sd) -> torch.dtype:
    dtypes = sorted({str(v.dtype) for v in sd.values()})
    if len(dtypes) != 1:
        raise ValueError(f"weights ({dtypes}) must share one dtype (weights are never cast)")
    return next(iter(sd.values())).dtype


def _model(hf_config, dtype) -> QwenVLModel:
    model = QwenVLModel(hf_config, language_config(hf_config, params_dtype=dtype))
    return model.to(dtype)


def _copy_hf_files(src: Path, dst: Path) -> None:
    """Tokenizer, processor, chat template and generation files (everything but weights and
    config.json)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != "config.json" and ".safetensors" not in f.name:
            if f.name not in (MANIFEST_FILE, CONFIG_FILE) and not f.name.endswith(".bin"):
                shutil.copy2(f, dst / f.name)


def hf_to_checkpoint(source, output) -> Path:
    """A Megatron dist-checkpoint (layout-free) of a Hugging Face Qwen2.5-VL folder."""
    from megatron.core import dist_checkpointing

    from ..wan.convert import _one_process

    hf_config, sd = read_hf_folder(source)
    dtype = _one_dtype(sd)
    final = Path(output) / f"iter_{STEP:07d}"
    partial = final.with_name(final.name + ".partial")
    with _one_process():
        model = _model(hf_config, dtype)
        model.load_state_dict(to_megatron(sd, hf_config), strict=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(partial))
    meta = {"hf_config": hf_config.to_dict(), "params_dtype": str(dtype).replace("torch.", "")}
    (partial / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    write_manifest(partial)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    _copy_hf_files(Path(source), Path(output) / HF_FILES)
    (Path(output) / TRACKER_FILE).write_text(str(STEP))
    return final


def _read_checkpoint(directory) -> Tuple[Path, dict]:
    tracker = Path(directory) / TRACKER_FILE
    text = tracker.read_text().strip() if tracker.is_file() else ""
    if not text.isdigit():
        raise ValueError(
            f"checkpoint ({directory}) must hold {TRACKER_FILE} with an iteration number "
            f"(got {text!r})"
        )
    path = Path(directory) / f"iter_{int(text):07d}"
    try:
        want = json.loads((path / MANIFEST_FILE).read_text())["files"]
        meta = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"checkpoint {path} must hold {MANIFEST_FILE} and {CONFIG_FILE} (a qwen_vl "
            f"checkpoint written by convert --from-hf): {type(e).__name__}: {e}"
        ) from None
    if _manifest(path) != want:
        raise ValueError(f"checkpoint {path}: files differ from {MANIFEST_FILE}")
    return path, meta


def checkpoint_to_hf(checkpoint, output) -> Path:
    """A folder ``Qwen2_5_VLForConditionalGeneration.from_pretrained`` loads (``config.json``,
    ``model.safetensors``, the tokenizer / processor files) from ``hf_to_checkpoint``'s output."""
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLConfig

    from ..wan.convert import _one_process

    path, meta = _read_checkpoint(checkpoint)
    hf_config = Qwen2_5_VLConfig.from_dict(meta["hf_config"])
    dtype = getattr(torch, str(meta.get("params_dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{CONFIG_FILE} params_dtype ({meta.get('params_dtype')!r}) is no dtype")
    with _one_process():
        model = _model(hf_config, dtype)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
        model.load_state_dict(loaded["model"], strict=True)
        ours = {k: p.detach() for k, p in model.named_parameters()}
    sd = to_hf(ours, hf_config)
    if tie_word_embeddings(hf_config):
        sd.pop("lm_head.weight")  # tied: transformers stores the embedding once
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in sd.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    hf_config.architectures = [ARCHITECTURE]
    hf_config.save_pretrained(str(out))
    files = Path(checkpoint) / HF_FILES
    if files.is_dir():
        for f in sorted(files.iterdir()):
            shutil.copy2(f, out / f.name)
    return out
