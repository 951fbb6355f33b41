"""Builders for a small video-language model: ``MMSPLLaVAModel`` with ``FrameViT``, local specs.

Used by the example config (``examples/configs/video_llava.yaml``), the MM-SP benchmark and the
tests; sizes are arguments, so the same builder makes toy and real-sized models.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["VideoLLaVASizes", "video_llava_configs", "video_llava_model"]


@dataclass
class VideoLLaVASizes:
    vocab_size: int = 64
    max_sequence_length: int = 256
    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = 2
    ffn_hidden_size: int = 64
    vision_layers: int = 1
    vision_hidden_size: int = 16
    vision_heads: int = 2
    img_size: int = 8
    patch_dim: int = 4
    image_token_index: int = -200


def _mlp_submodules(spec):
    """``MLPSubmodules`` of Megatron's MLP spec: a ``ModuleSpec`` (0.16) or a ``partial`` of
    ``MLP.as_mlp_submodule`` with ``submodules=`` (0.19)."""
    if hasattr(spec, "submodules"):
        return spec.submodules
    return spec.keywords["submodules"]


def video_llava_configs(
    sizes: VideoLLaVASizes,
    tp: int = 1,
    cp: int = 1,
    cp_comm_type=None,
    init_std: float = 0.02,
    pp: int = 1,
    has_gpu: bool = False,
    **config_kwargs,
):
    """``(language, vision, projector)`` ``TransformerConfig``s of ``video_llava_model``."""
    from megatron.core.transformer import TransformerConfig

    from ..compat import cpu_transformer_config_kwargs

    common = dict(cpu_transformer_config_kwargs() if not has_gpu else {})
    common.update(
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        init_method_std=init_std,
        **config_kwargs,
    )
    s = sizes
    lcfg = TransformerConfig(
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        num_attention_heads=s.num_attention_heads,
        num_query_groups=s.num_query_groups,
        ffn_hidden_size=s.ffn_hidden_size,
        context_parallel_size=cp,
        cp_comm_type=cp_comm_type,
        pipeline_model_parallel_size=pp,
        **common,
    )
    vcfg = TransformerConfig(
        num_layers=s.vision_layers,
        hidden_size=s.vision_hidden_size,
        num_attention_heads=s.vision_heads,
        ffn_hidden_size=2 * s.vision_hidden_size,
        **common,
    )
    vcfg.vision_model_type = "clip"  # LLaVAModel's token count rule: patches + 1 class token
    pcfg = TransformerConfig(
        num_layers=1,
        hidden_size=s.hidden_size,
        num_attention_heads=tp,
        ffn_hidden_size=s.hidden_size,
        **common,
    )
    return lcfg, vcfg, pcfg


def video_llava_model(
    sizes: VideoLLaVASizes,
    tp: int = 1,
    cp: int = 1,
    cp_comm_type=None,
    two_d_attention: bool = True,
    init_std: float = 0.02,
    pp: int = 1,
    pre_process: bool = True,
    post_process: bool = True,
    language_config=None,
    **config_kwargs,
):
    """An ``MMSPLLaVAModel``: ``FrameViT`` encoder, MLP projector, GPT with RoPE (local specs).

    ``two_d_attention=False`` keeps Megatron's own local core attention in the LLM (CP = 1 only):
    the independent reference the MM-SP tests compare against. Megatron's parallel state must be
    initialised with the same ``tp`` / ``cp`` / ``pp``; with ``pp > 1`` pass this stage's
    ``pre_process`` / ``post_process`` (the encoder lives on the first stage, as in Megatron).
    ``language_config``: use this language ``TransformerConfig`` (e.g. the trainer's) instead of a
    new one.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_mlp_module_spec,
    )
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    from ..models.specs import with_2d_attention
    from .encoders import FrameViT
    from .llava import MMSPLLaVAModel

    s = sizes
    lcfg, vcfg, pcfg = video_llava_configs(
        sizes, tp, cp, cp_comm_type, init_std, pp, torch.cuda.is_available(), **config_kwargs
    )
    if language_config is not None:
        lcfg = language_config
    vspec = copy.deepcopy(get_vit_layer_with_local_spec())
    vspec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    lspec = get_gpt_layer_local_spec()
    if two_d_attention:
        lspec = with_2d_attention(lspec)
    encoder = FrameViT(vcfg, vspec, s.img_size, s.img_size, s.patch_dim) if pre_process else None
    return MMSPLLaVAModel(
        lcfg,
        lspec,
        language_vocab_size=s.vocab_size,
        language_max_sequence_length=s.max_sequence_length,
        vision_transformer_config=vcfg,
        vision_transformer_layer_spec=vspec,
        drop_vision_class_token=True,
        vision_projection_config=pcfg,
        vision_projection_layer_spec=_mlp_submodules(get_mlp_module_spec(use_te=False)),
        language_position_embedding_type="rope",
        img_h=s.img_size,
        img_w=s.img_size,
        patch_dim=s.patch_dim,
        image_token_index=s.image_token_index,
        vision_model=encoder,
        pre_process=pre_process,
        post_process=post_process,
        add_encoder=pre_process,
    )
