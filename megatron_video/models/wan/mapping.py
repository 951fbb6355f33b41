"""The one mapping between diffusers' ``WanTransformer3DModel`` weights and ours, used both ways.

``mapping_table(config)`` lists ``Entry(megatron, diffusers, kind)`` for every tensor: ``kind``
``"copy"`` (same tensor), ``"heads"`` (our fused projection interleaves the diffusers tensors
per attention head: ``[q_h; k_h; v_h]`` for ``linear_qkv``, ``[k_h; v_h]`` for ``linear_kv``, so a
TP shard holds whole heads) or ``"patch"`` (the Conv3d kernel ``[D, C, pt, ph, pw]`` flattened to
our linear over patch tokens). ``to_megatron`` / ``to_diffusers`` apply it; keys are checked
against a meta-device diffusers model (missing, unknown, shape), except those diffusers itself
ignores when loading (``_keys_to_ignore_on_load_unexpected``), which are skipped the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

__all__ = [
    "Entry",
    "mapping_table",
    "to_megatron",
    "to_diffusers",
    "diffusers_reference_shapes",
    "ignored_diffusers_key",
]


@dataclass(frozen=True)
class Entry:
    megatron: str
    diffusers: Tuple[str, ...]
    kind: str = "copy"


def _linear(ours: str, theirs: str, kind: str = "copy", parts=None) -> List[Entry]:
    parts = parts or (theirs,)
    return [
        Entry(f"{ours}.{p}", tuple(f"{t}.{p}" for t in parts), kind) for p in ("weight", "bias")
    ]


def _layer(i: int, cfg) -> List[Entry]:
    o, d = f"decoder.layers.{i}", f"blocks.{i}"
    out = [Entry(f"{o}.modulation.scale_shift_table", (f"{d}.scale_shift_table",))]
    sa, ca = f"{o}.self_attention", f"{o}.cross_attention"
    out += _linear(
        f"{sa}.linear_qkv", "", "heads", (f"{d}.attn1.to_q", f"{d}.attn1.to_k", f"{d}.attn1.to_v")
    )
    out += [
        Entry(f"{sa}.q_layernorm.weight", (f"{d}.attn1.norm_q.weight",)),
        Entry(f"{sa}.k_layernorm.weight", (f"{d}.attn1.norm_k.weight",)),
    ]
    out += _linear(f"{sa}.linear_proj", f"{d}.attn1.to_out.0")
    if cfg.cross_attn_norm:
        out += _linear(f"{o}.pre_cross_attn_layernorm", f"{d}.norm2")
    out += _linear(f"{ca}.linear_q", f"{d}.attn2.to_q")
    out += _linear(f"{ca}.linear_kv", "", "heads", (f"{d}.attn2.to_k", f"{d}.attn2.to_v"))
    out += [
        Entry(f"{ca}.q_layernorm.weight", (f"{d}.attn2.norm_q.weight",)),
        Entry(f"{ca}.k_layernorm.weight", (f"{d}.attn2.norm_k.weight",)),
    ]
    if cfg.added_kv_proj_dim is not None:
        out += _linear(
            f"{ca}.linear_kv_img", "", "heads", (f"{d}.attn2.add_k_proj", f"{d}.attn2.add_v_proj")
        )
        out += [Entry(f"{ca}.k_img_layernorm.weight", (f"{d}.attn2.norm_added_k.weight",))]
    out += _linear(f"{ca}.linear_proj", f"{d}.attn2.to_out.0")
    out += _linear(f"{o}.mlp.linear_fc1", f"{d}.ffn.net.0.proj")
    out += _linear(f"{o}.mlp.linear_fc2", f"{d}.ffn.net.2")
    return out


def mapping_table(cfg) -> List[Entry]:
    """Every tensor of the model of ``cfg`` (a ``WanConfig``), global layer indices."""
    ce = "condition_embedder"
    out = [
        Entry("patch_embedding.weight", ("patch_embedding.weight",), "patch"),
        Entry("patch_embedding.bias", ("patch_embedding.bias",)),
    ]
    for name in (
        "time_embedder.linear_1",
        "time_embedder.linear_2",
        "time_proj",
        "text_embedder.linear_1",
        "text_embedder.linear_2",
    ):
        out += _linear(f"{ce}.{name}", f"{ce}.{name}")
    if cfg.image_dim is not None:
        ie = f"{ce}.image_embedder"
        out += _linear(f"{ie}.norm1", f"{ie}.norm1") + _linear(f"{ie}.norm2", f"{ie}.norm2")
        out += _linear(f"{ie}.ff.linear_1", f"{ie}.ff.net.0.proj")
        out += _linear(f"{ie}.ff.linear_2", f"{ie}.ff.net.2")
        if cfg.pos_embed_seq_len is not None:
            out.append(Entry(f"{ie}.pos_embed", (f"{ie}.pos_embed",)))
    for i in range(cfg.num_layers):
        out += _layer(i, cfg)
    out += _linear("head.proj_out", "proj_out")
    out.append(Entry("head.scale_shift_table", ("scale_shift_table",)))
    return out


def _heads_in(parts, heads: int) -> torch.Tensor:
    """Interleave ``n`` tensors ``[H*hd, ...]`` per head -> ``[H*n*hd, ...]``."""
    views = [p.reshape(heads, -1, *p.shape[1:]) for p in parts]
    return torch.stack(views, dim=1).reshape(-1, *parts[0].shape[1:])


def _heads_out(x: torch.Tensor, n: int, heads: int):
    return [
        t.reshape(-1, *x.shape[1:]).clone() for t in x.reshape(heads, n, -1, *x.shape[1:]).unbind(1)
    ]


def diffusers_reference_shapes(diffusers_config: dict) -> Dict[str, tuple]:
    """``{key: shape}`` of the state dict diffusers' ``WanTransformer3DModel`` has for this config
    (built on the meta device: no memory, no weights)."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(diffusers_config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def ignored_diffusers_key(key: str) -> bool:
    """Whether diffusers ignores ``key`` when loading (``_keys_to_ignore_on_load_unexpected``)."""
    from diffusers import WanTransformer3DModel

    patterns = WanTransformer3DModel._keys_to_ignore_on_load_unexpected or []
    return any(re.search(p, key) for p in patterns)


def _check_keys(sd: dict, expected: Dict[str, tuple], where: str, ignore) -> None:
    unknown = sorted(k for k in sd if k not in expected and not ignore(k))
    missing = sorted(k for k in expected if k not in sd)
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r} ({len(unknown)} unknown: "
            f"{unknown[:5]}); the mapping (models/wan/mapping.py) has no entry for it"
        )
    if missing:
        raise ValueError(
            f"{where}: missing key {missing[0]!r} ({len(missing)} missing: {missing[:5]})"
        )
    for k, shape in expected.items():
        if tuple(sd[k].shape) != tuple(shape):
            raise ValueError(
                f"{where}: key {k!r} has shape {tuple(sd[k].shape)}, the config "
                f"gives {tuple(shape)}"
            )


def to_megatron(
    diffusers_sd: Dict[str, torch.Tensor],
    cfg,
    diffusers_config: dict,
) -> Dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors from a diffusers state dict; ``ValueError`` naming the
    key for unknown / missing keys and shape mismatches."""
    _check_keys(
        diffusers_sd,
        diffusers_reference_shapes(diffusers_config),
        "diffusers weights",
        ignored_diffusers_key,
    )
    H = cfg.num_attention_heads
    out = {}
    for e in mapping_table(cfg):
        parts = [diffusers_sd[k] for k in e.diffusers]
        if e.kind == "heads":
            out[e.megatron] = _heads_in(parts, H)
        elif e.kind == "patch":
            out[e.megatron] = parts[0].reshape(parts[0].shape[0], -1).clone()
        else:
            out[e.megatron] = parts[0]
    return out


def to_diffusers(
    megatron_sd: Dict[str, torch.Tensor],
    cfg,
    diffusers_config: dict,
    megatron_shapes: Dict[str, tuple],
) -> Dict[str, torch.Tensor]:
    """The diffusers state dict from full Megatron tensors (checked against ``megatron_shapes``,
    the model's full shapes, by key)."""
    _check_keys(megatron_sd, megatron_shapes, "Megatron weights", lambda k: False)
    ref = diffusers_reference_shapes(diffusers_config)
    H = cfg.num_attention_heads
    out = {}
    for e in mapping_table(cfg):
        x = megatron_sd[e.megatron]
        if e.kind == "heads":
            out.update(zip(e.diffusers, _heads_out(x, len(e.diffusers), H)))
        elif e.kind == "patch":
            out[e.diffusers[0]] = x.reshape(ref[e.diffusers[0]]).clone()
        else:
            out[e.diffusers[0]] = x
    _check_keys(out, ref, "converted diffusers weights", lambda k: False)
    return out
