"""The one mapping table between Hugging Face Qwen2.5-VL weights and ours, used both ways.

``mapping_table(hf_config)`` lists ``Entry(ours, hf, kind)`` for every tensor. Names on our side
are ``QwenVLModel``'s (``language_model.*``: Megatron-Core's ``GPTModel`` with local specs;
``visual.*``: the wrapped transformers vision tower); on the HF side the names of
``Qwen2_5_VLForConditionalGeneration.state_dict()`` (transformers 5: ``model.language_model.*``,
``model.visual.*``, ``lm_head.*``; the older on-disk names ``model.layers.*`` / ``visual.*`` are
read too, ``normalize_hf_keys``). ``kind``:

* ``copy`` -- the same tensor;
* ``qkv`` -- Megatron's fused ``linear_qkv`` (weight or bias) interleaved per query group:
  ``[q heads of group 0; k_0; v_0; q heads of group 1; k_1; v_1; ...]`` from HF's ``q_proj``,
  ``k_proj``, ``v_proj`` (so a TP shard holds whole groups);
* ``glu`` -- ``linear_fc1`` = ``[gate_proj; up_proj]`` (Megatron's SwiGLU order);
* ``tied`` -- ``lm_head.weight`` when the embeddings are tied: written as a copy of the word
  embeddings, not read (ours has no output weight then).

Weights are never cast; HF -> ours -> HF is bit-identical.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from .config import check_hf_config, tie_word_embeddings

__all__ = [
    "Entry",
    "mapping_table",
    "to_megatron",
    "to_hf",
    "normalize_hf_keys",
    "tp_shard",
    "tp_gather",
]


@dataclass(frozen=True)
class Entry:
    ours: str
    hf: Tuple[str, ...]
    kind: str = "copy"


def _lm_layer(i: int) -> List[Entry]:
    o = f"language_model.decoder.layers.{i}"
    h = f"model.language_model.layers.{i}"
    a = f"{h}.self_attn"
    return [
        Entry(f"{o}.input_layernorm.weight", (f"{h}.input_layernorm.weight",)),
        Entry(
            f"{o}.self_attention.linear_qkv.weight",
            (f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"),
            "qkv",
        ),
        Entry(
            f"{o}.self_attention.linear_qkv.bias",
            (f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"),
            "qkv",
        ),
        Entry(f"{o}.self_attention.linear_proj.weight", (f"{a}.o_proj.weight",)),
        Entry(f"{o}.pre_mlp_layernorm.weight", (f"{h}.post_attention_layernorm.weight",)),
        Entry(
            f"{o}.mlp.linear_fc1.weight",
            (f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight"),
            "glu",
        ),
        Entry(f"{o}.mlp.linear_fc2.weight", (f"{h}.mlp.down_proj.weight",)),
    ]


def _vision(vc) -> List[Entry]:
    names = ["patch_embed.proj.weight"]
    for i in range(vc.depth):
        b = f"blocks.{i}"
        names += [f"{b}.norm1.weight", f"{b}.norm2.weight"]
        for lin in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            names += [f"{b}.{lin}.weight", f"{b}.{lin}.bias"]
    names += ["merger.ln_q.weight"]
    names += [f"merger.mlp.{j}.{p}" for j in (0, 2) for p in ("weight", "bias")]
    return [Entry(f"visual.{n}", (f"model.visual.{n}",)) for n in names]


def mapping_table(hf_config) -> List[Entry]:
    """Every tensor of the Qwen2.5-VL model of ``hf_config``."""
    check_hf_config(hf_config)
    t = hf_config.text_config
    out = [
        Entry(
            "language_model.embedding.word_embeddings.weight",
            ("model.language_model.embed_tokens.weight",),
        )
    ]
    for i in range(t.num_hidden_layers):
        out += _lm_layer(i)
    out.append(
        Entry(
            "language_model.decoder.final_layernorm.weight", ("model.language_model.norm.weight",)
        )
    )
    if tie_word_embeddings(hf_config):
        out.append(
            Entry("language_model.embedding.word_embeddings.weight", ("lm_head.weight",), "tied")
        )
    else:
        out.append(Entry("language_model.output_layer.weight", ("lm_head.weight",)))
    return out + _vision(hf_config.vision_config)


def _groups(hf_config):
    t = hf_config.text_config
    d = t.hidden_size // t.num_attention_heads
    return t.num_key_value_heads, t.num_attention_heads // t.num_key_value_heads, d


def _fuse_qkv(q, k, v, hf_config):
    G, hpg, d = _groups(hf_config)
    rest = q.shape[1:]
    parts = [q.reshape(G, hpg * d, *rest), k.reshape(G, d, *rest), v.reshape(G, d, *rest)]
    return torch.cat(parts, dim=1).reshape(G * (hpg + 2) * d, *rest)


def _split_qkv(fused, hf_config):
    G, hpg, d = _groups(hf_config)
    rest = fused.shape[1:]
    q, k, v = fused.reshape(G, (hpg + 2) * d, *rest).split([hpg * d, d, d], dim=1)
    return (
        q.reshape(G * hpg * d, *rest).clone(),
        k.reshape(G * d, *rest).clone(),
        v.reshape(G * d, *rest).clone(),
    )


_LEGACY = (
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?!visual\.|language_model\.)"), "model.language_model."),
)


def normalize_hf_keys(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """HF names as transformers 5 holds them in memory (older checkpoints store the language model
    as ``model.*`` and the vision tower as ``visual.*``)."""
    out = {}
    for k, v in state.items():
        for pat, rep in _LEGACY:
            if pat.match(k):
                k = pat.sub(rep, k, count=1)
                break
        out[k] = v
    return out


def _check_keys(have, want, side: str):
    missing, unknown = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unknown:
        raise ValueError(
            f"{side} state dict: missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
            f"unknown {unknown[:6]}{'...' if len(unknown) > 6 else ''} (the keys must be "
            f"exactly those of the mapping table, models/qwen_vl/weights.py)"
        )


def to_megatron(hf_state: Dict[str, torch.Tensor], hf_config) -> Dict[str, torch.Tensor]:
    """Our full (unsharded) state dict from an HF Qwen2.5-VL state dict."""
    hf_state = normalize_hf_keys(hf_state)
    table = mapping_table(hf_config)
    want = {k for e in table if e.kind != "tied" for k in e.hf}
    have = {k for k in hf_state if not (k == "lm_head.weight" and tie_word_embeddings(hf_config))}
    _check_keys(have, want, "HF")
    out = {}
    for e in table:
        if e.kind == "tied":  # the word embeddings' copy: not read
            continue
        src = [hf_state[k] for k in e.hf]
        if e.kind == "qkv":
            out[e.ours] = _fuse_qkv(*src, hf_config)
        elif e.kind == "glu":
            out[e.ours] = torch.cat(src, dim=0)
        else:
            out[e.ours] = src[0].clone()
    return out


def to_hf(state: Dict[str, torch.Tensor], hf_config) -> Dict[str, torch.Tensor]:
    """The HF state dict (``Qwen2_5_VLForConditionalGeneration`` names) from our full one."""
    table = mapping_table(hf_config)
    _check_keys(set(state), {e.ours for e in table}, "qwen_vl")
    out = {}
    for e in table:
        src = state[e.ours]
        if e.kind == "qkv":
            out.update(zip(e.hf, _split_qkv(src, hf_config)))
        elif e.kind == "glu":
            out.update(zip(e.hf, (x.clone() for x in src.chunk(2, dim=0))))
        else:
            out[e.hf[0]] = src.clone()
    return out


def tp_shard(name: str, full: torch.Tensor, param, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's slice of our full tensor ``name`` for the parameter ``param``."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    if name.endswith("linear_fc1.weight"):  # each rank holds [its gate rows; its up rows]
        return torch.cat([h.chunk(tp, dim=0)[rank] for h in full.chunk(2, dim=0)])
    return full.chunk(tp, dim=param.partition_dim)[rank]


def tp_gather(name: str, local: torch.Tensor, param, group) -> torch.Tensor:
    """Our full tensor ``name`` from every TP rank's ``local`` slice (inverse of ``tp_shard``)."""
    from ...parallel import comm

    tp = group.size() if group is not None else 1
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return local
    if name.endswith("linear_fc1.weight"):
        g, u = local.chunk(2, dim=0)
        return torch.cat([comm.all_gather_cat(g, group, dim=0), comm.all_gather_cat(u, group)])
    return comm.all_gather_cat(local, group, dim=param.partition_dim)
