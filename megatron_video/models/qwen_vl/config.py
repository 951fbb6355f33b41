"""Qwen2.5-VL configs: a Hugging Face ``Qwen2_5_VLConfig`` -> Megatron-Core ``TransformerConfig``
of the language model (Qwen2 blocks: RMSNorm, SwiGLU, QKV bias, GQA, M-RoPE), checked field by
field; plus ``tiny_hf_config`` (a random test-size config, built in code: nothing is downloaded).
"""

from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "check_hf_config", "language_config", "tiny_hf_config"]

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
MODEL_TYPE = "qwen2_5_vl"


def tiny_hf_config(**text_overrides):
    """A tiny random-size ``Qwen2_5_VLConfig``: text 2 layers x 64 hidden (4 heads, 2 KV groups,
    M-RoPE sections 2/3/3 of the 8 rotary frequencies), vision depth 2 x 32 hidden (block 1 full
    attention, block 0 windowed), patch 4, temporal patch 2, 2x2 merger, window 16 px."""
    from transformers import Qwen2_5_VLConfig

    text = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    text.update(text_overrides)
    tie = text.pop("tie_word_embeddings", False)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=16,
        out_hidden_size=text["hidden_size"],
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=90,
        video_token_id=91,
        vision_start_token_id=92,
        vision_end_token_id=93,
        tie_word_embeddings=tie,
    )


def _text(hf_config):
    return getattr(hf_config, "text_config", hf_config)


def mrope_section(hf_config):
    """``mrope_section`` (temporal, height, width rotary frequencies) of the text config."""
    rope = getattr(_text(hf_config), "rope_parameters", None) or {}
    return list(rope.get("mrope_section", [16, 24, 24]))


def check_hf_config(hf_config) -> None:
    """``ValueError`` naming the field for a config this model does not implement."""
    arch = list(getattr(hf_config, "architectures", None) or [ARCHITECTURE])
    mtype = getattr(hf_config, "model_type", None)
    if mtype != MODEL_TYPE or ARCHITECTURE not in arch:
        raise ValueError(
            f"config model_type ({mtype!r}) / architectures ({arch}) must be {MODEL_TYPE!r} / "
            f"[{ARCHITECTURE!r}]: only Qwen2.5-VL folders convert to qwen_vl"
        )
    t = _text(hf_config)
    rope = dict(getattr(t, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") not in ("default", "mrope"):
        raise ValueError(
            f"text_config.rope_parameters.rope_type ({rope.get('rope_type')!r}) must be 'default'"
            f" (M-RoPE without scaling)"
        )
    head_dim = t.hidden_size // t.num_attention_heads
    sec = mrope_section(hf_config)
    if sum(sec) * 2 != head_dim:
        raise ValueError(
            f"text_config.rope_parameters.mrope_section ({sec}) must sum to head_dim / 2 "
            f"({head_dim // 2})"
        )
    if getattr(t, "use_sliding_window", False):
        raise ValueError("text_config.use_sliding_window (True) must be False for qwen_vl")
    if t.hidden_act != "silu":
        raise ValueError(f"text_config.hidden_act ({t.hidden_act!r}) must be 'silu' (SwiGLU)")


def language_config(
    hf_config, tp: int = 1, cp: int = 1, cp_comm_type=None, params_dtype=torch.float32, **extra
):
    """The language model's ``TransformerConfig`` (Qwen2 blocks) for a Qwen2.5-VL config."""
    from megatron.core.transformer import TransformerConfig

    from ...compat import cpu_transformer_config_kwargs

    check_hf_config(hf_config)
    t = _text(hf_config)
    kw: Dict[str, Any] = cpu_transformer_config_kwargs() if not torch.cuda.is_available() else {}
    kw.update(
        num_layers=t.num_hidden_layers,
        hidden_size=t.hidden_size,
        ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads,
        num_query_groups=t.num_key_value_heads,
        kv_channels=t.hidden_size // t.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=t.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        mrope_section=mrope_section(hf_config),
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=t.initializer_range,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        cp_comm_type=cp_comm_type,
        params_dtype=params_dtype,
        bias_activation_fusion=False,
    )
    kw.update(extra)
    return TransformerConfig(**kw)


def rope_theta(hf_config) -> float:
    return float((_text(hf_config).rope_parameters or {}).get("rope_theta", 1000000.0))


def tie_word_embeddings(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))
