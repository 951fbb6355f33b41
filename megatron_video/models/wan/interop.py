"""diffusers in: ``from_diffusers`` builds ``WanModel`` from a ``WanTransformer3DModel`` or its
folder, sharded for the current Megatron parallel state; ``diffusers_forward`` runs it as a
drop-in for diffusers' forward under any CP / TP layout (full tensors in and out on every rank).

Folders: ``config.json`` and safetensors weights (one file or a sharded ``*.index.json``); nothing
is unpickled. Config fields diffusers' class does not know raise ``ValueError``.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from megatron_video.layouts.geometry import VideoGeometry
from megatron_video.models.embedders import patchify, token_grid
from megatron_video.models.wan.config import WanConfig
from megatron_video.models.wan.embedders import wan_unpatchify
from megatron_video.models.wan.mapping import to_megatron
from megatron_video.models.wan.model import WanModel
from megatron_video.models.wan.wan_layer_specs import get_wan_layer_spec
from megatron_video.parallel import comm

__all__ = [
    "from_diffusers",
    "diffusers_forward",
    "wan_config",
    "read_diffusers_folder",
    "full_diffusers_config",
    "load_full_weights",
    "global_param_name",
]

CLASS_NAME = "WanTransformer3DModel"


def full_diffusers_config(config: dict) -> dict:
    """diffusers' config with every ``__init__`` default filled in; ``ValueError`` for an unknown
    field or another class (``_class_name``)."""
    from diffusers import WanTransformer3DModel

    cls = config.get("_class_name", CLASS_NAME)
    if cls != CLASS_NAME:
        raise ValueError(f"config _class_name ({cls!r}) must be {CLASS_NAME!r}")
    params = inspect.signature(WanTransformer3DModel.__init__).parameters
    known = {k: p.default for k, p in params.items() if k != "self"}
    unknown = sorted(k for k in config if not k.startswith("_") and k not in known)
    if unknown:
        raise ValueError(
            f"config key {unknown[0]!r} is not a {CLASS_NAME} field (unknown: "
            f"{unknown}); known: {sorted(known)}"
        )
    out = {**known, **{k: v for k, v in config.items() if not k.startswith("_")}}
    out["patch_size"] = list(out["patch_size"])
    out["out_channels"] = out["out_channels"] or out["in_channels"]
    return out


def wan_config(diffusers_config: dict, **overrides) -> WanConfig:
    """``WanConfig`` for the current device and parallel state from a diffusers config."""
    from megatron.core import parallel_state as ps

    from megatron_video.compat import device_transformer_config_kwargs
    from megatron_video.models.wan.config import wan_architecture

    c = full_diffusers_config(diffusers_config)
    kw = device_transformer_config_kwargs(
        torch.cuda.is_available(),
        num_layers=c["num_layers"],
        hidden_size=c["num_attention_heads"] * c["attention_head_dim"],
        num_attention_heads=c["num_attention_heads"],
        kv_channels=c["attention_head_dim"],
        ffn_hidden_size=c["ffn_dim"],
        layernorm_epsilon=c["eps"],
        **wan_architecture(),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        patch_size=tuple(c["patch_size"]),
        in_channels=c["in_channels"],
        out_channels=c["out_channels"],
        text_dim=c["text_dim"],
        freq_dim=c["freq_dim"],
        cross_attn_norm=bool(c["cross_attn_norm"]),
        qk_norm=c["qk_norm"],
        image_dim=c["image_dim"],
        added_kv_proj_dim=c["added_kv_proj_dim"],
        rope_max_seq_len=c["rope_max_seq_len"],
        pos_embed_seq_len=c["pos_embed_seq_len"],
    )
    kw.update(overrides)
    return WanConfig(**kw)


def read_diffusers_folder(path) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """``(config, state dict)`` of a diffusers model folder (safetensors only)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"path ({path}) must be a diffusers model folder with config.json")
    config = json.loads((path / "config.json").read_text())
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        files = sorted(set(json.loads(index[0].read_text())["weight_map"].values()))
    else:
        files = [f.name for f in sorted(path.glob("*.safetensors"))]
    if not files:
        pickled = sorted(f.name for f in path.glob("*.bin"))
        raise ValueError(
            f"path ({path}) holds no safetensors weights"
            + (f" (only {pickled}: pickled weights are refused)" if pickled else "")
        )
    sd = {}
    for name in files:
        for k, v in load_file(str(path / name)).items():
            if k in sd:
                raise ValueError(f"key {k!r} is in more than one weight file of {path}")
            sd[k] = v
    return config, sd


def global_param_name(model: WanModel, name: str) -> str:
    """Parameter name with the pipeline stage's local layer index replaced by the global one."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def load_full_weights(model: WanModel, full: Dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors into this rank's parameters (TP shard, pipeline stage)."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = global_param_name(model, name)
            if key not in full:
                raise ValueError(f"weights have no tensor for parameter {key!r}")
            value = full[key]
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                value = value.chunk(tp, dim=p.partition_dim)[rank]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"key {key!r}: shape {tuple(value.shape)} (this rank's shard) "
                    f"must be {tuple(p.shape)}"
                )
            p.copy_(value)


def from_diffusers(
    path_or_module, layer_spec=None, *, dtype: Optional[torch.dtype] = None, **config_overrides
) -> WanModel:
    """``WanModel`` with the weights of a diffusers ``WanTransformer3DModel`` (module or folder),
    built for the current Megatron parallel state (TP shards, PP stage, CP size). ``dtype``:
    parameter dtype (default: the module's, float32 for a folder)."""
    from megatron.core import parallel_state as ps

    if isinstance(path_or_module, torch.nn.Module):
        config = dict(path_or_module.config)
        sd = {k: v.detach() for k, v in path_or_module.state_dict().items()}
        dtype = dtype or next(path_or_module.parameters()).dtype
    else:
        config, sd = read_diffusers_folder(path_or_module)
        dtype = dtype or torch.float32
    cfg = wan_config(config, params_dtype=dtype, **config_overrides)
    full = to_megatron(sd, cfg, full_diffusers_config(config))
    model = WanModel(
        cfg,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        layer_spec=layer_spec if layer_spec is not None else get_wan_layer_spec(cfg),
    )
    load_full_weights(model, {k: v.to(dtype) for k, v in full.items()})
    if torch.cuda.is_available():
        model.cuda()
    return model


def _cp_group(model: WanModel):
    groups = model.decoder.layers[0].groups
    return None if groups is None else groups.cp_group


def _check_inputs(model: WanModel, x, timestep, text, image, padded: bool = False) -> VideoGeometry:
    """The inputs' geometry, checked before any collective. ``padded`` (the samplers,
    ``wan_sampling.sample_wan``): the tokens are padded to a multiple of the CP size, so any CP
    size of at most the tokens is accepted; otherwise the CP size must divide them."""
    cfg = model.config
    if not (model.pre_process and model.post_process):
        raise ValueError(
            "diffusers_forward needs pipeline_model_parallel_size 1 (this stage is "
            "not both first and last); pipelined training goes through the trainer"
        )
    if x.dim() != 5 or x.shape[1] != cfg.in_channels:
        raise ValueError(
            f"hidden_states ({tuple(x.shape)}) must be [B, C = {cfg.in_channels}, F, H, W]"
        )
    geometry = VideoGeometry(*token_grid(tuple(x.shape[2:]), cfg.patch_size))
    B, S = x.shape[0], geometry.tokens
    P, _ = model.cp()
    if padded and P > S:
        raise ValueError(
            f"context_parallel_size ({P}) must be at most the tokens ({S} = {geometry.frames} x "
            f"{geometry.height} x {geometry.width}): every CP rank holds at least one real token"
        )
    if S % P and not padded:
        raise ValueError(
            f"tokens ({S} = {geometry.frames} x {geometry.height} x "
            f"{geometry.width}) must be divisible by context_parallel_size ({P})"
        )
    if tuple(timestep.shape) not in ((B,), (B, S)):
        raise ValueError(
            f"timestep ({tuple(timestep.shape)}) must be [B] = [{B}] or per token "
            f"[B, tokens] = [{B}, {S}]"
        )
    if text.dim() != 3 or text.shape[0] != B:
        raise ValueError(
            f"encoder_hidden_states ({tuple(text.shape)}) must be [B = {B}, L, text_dim]"
        )
    if image is not None and (image.dim() != 3 or image.shape[0] != B):
        raise ValueError(
            f"encoder_hidden_states_image ({tuple(image.shape)}) must be "
            f"[B = {B}, L_img, image_dim]"
        )
    if P > 1:
        shapes = {"hidden_states": x, "timestep": timestep, "encoder_hidden_states": text}
        if image is not None:
            shapes["encoder_hidden_states_image"] = image
        comm.check_same_shape(shapes, _cp_group(model), where="diffusers_forward")
    return geometry


def diffusers_forward(
    model: WanModel,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """diffusers' ``WanTransformer3DModel.forward(...).sample`` on ``model`` (PP = 1): the full
    inputs (``[B, C, F, H, W]``, ``[B]`` or ``[B, tokens]``, ``[B, L, text_dim]``, optional
    ``[B, L_img, image_dim]``), identical on every rank, are cut to this rank's contiguous CP
    shard; the full ``[B, C_out, F, H, W]`` comes back on every rank. Differentiable: the cut's
    backward gathers, the gather's backward keeps this rank's slice, and the uncut inputs' (text,
    image, a per-sample timestep) gradients are summed over CP, so with the same loss on every
    rank every input gradient equals the single-process one."""
    geometry = _check_inputs(
        model, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image
    )
    cfg, group = model.config, _cp_group(model)
    P, rank = model.cp()
    s = geometry.tokens // P
    cut = slice(rank * s, (rank + 1) * s)

    def replicate(x):
        return None if x is None or group is None else comm.copy_to_group(x, group, "wan.input")

    def maybe(x, y):
        return x if y is None else y

    tokens = patchify(maybe(hidden_states, replicate(hidden_states)), cfg.patch_size)[:, cut]
    t = maybe(timestep, replicate(timestep) if timestep.is_floating_point() else None)
    if t.dim() == 2:
        t = t[:, cut]
    text = maybe(encoder_hidden_states, replicate(encoder_hidden_states))
    image = maybe(encoder_hidden_states_image, replicate(encoder_hidden_states_image))
    out = model(tokens, t, text, geometry, image)
    if group is not None:
        out = comm.gather_from_group(out, group, dim=1, tag="wan.output")
    return wan_unpatchify(
        out, (geometry.frames, geometry.height, geometry.width), cfg.patch_size, cfg.out_channels
    )
