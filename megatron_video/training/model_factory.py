"""Build the Megatron config and model of a training ``Config`` (used by the trainer and by the
Megatron-LM entry ``examples/pretrain_video_dit.py``)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict

import torch
from megatron.core.transformer import TransformerConfig

from megatron_video.compat import device_transformer_config_kwargs
from megatron_video.models.video_dit import VideoDiTConfig

from .config import Config
from .family_spec import get_family

__all__ = ["transformer_config", "video_fields", "video_transformer_config", "build_model"]


def transformer_config(config: Config, has_gpu: bool = False) -> VideoDiTConfig:
    """``VideoDiTConfig`` (a Megatron ``TransformerConfig``) for ``config``.

    ``has_gpu`` chooses the device settings (``compat.device_transformer_config_kwargs``): on a GPU
    weights are initialised on the device and the fusions are on (those needing TE / Apex only where
    installed); on a CPU fusions are off and weights are initialised on the CPU, so every parallel
    layout starts from the same full weights (TP shards are slices of them). The dtype is bf16 when
    ``train.bf16``, else fp32, on either device.
    """
    m, p = config.model, config.parallel
    dtype = torch.bfloat16 if config.train.bf16 else torch.float32
    kw = device_transformer_config_kwargs(
        has_gpu,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        kv_channels=m.hidden_size // m.num_attention_heads,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        qk_layernorm=True,
        add_bias_linear=True,
        init_method_std=m.init_std,
        layernorm_epsilon=1e-6,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=config.train.bf16,
        in_channels=config.vae.latent_channels,
        patch_size=tuple(m.patch_size),
        lora_rank=m.lora_rank,
        rope_theta=m.rope_theta,
        text_max_len=config.data.caption_len,
        text_input_dim=config.data.text_embed_dim,
        layer_type=get_family(m.family).layer_type,
        stdit_variant=m.stdit_variant,
        stdit_full_attention_layers=tuple(m.stdit_full_attention_layers),
        cond_seed=config.train.seed + 17,
    )
    if p.recompute:  # activation checkpointing of every layer; recompute re-runs its collectives
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*scope is deprecated.*")
        return VideoDiTConfig(**kw)


def video_fields(config: Config) -> Dict[str, Any]:
    """The fields ``VideoDiTConfig`` adds to Megatron's ``TransformerConfig``, from ``config``."""
    ours = transformer_config(config, has_gpu=False)
    base = {f.name for f in dataclasses.fields(TransformerConfig)}
    return {
        f.name: getattr(ours, f.name)
        for f in dataclasses.fields(VideoDiTConfig)
        if f.init and f.name not in base
    }


def video_transformer_config(base: TransformerConfig, config: Config) -> VideoDiTConfig:
    """``base`` (the config Megatron-LM built from its command line) plus only the video fields.

    Every Megatron field -- sizes, normalisation, activation, init, precision, recompute, sequence
    parallel, fusions, fp8 -- is taken from ``base`` unchanged (examples/pretrain_video_dit.py);
    ``base.transformer_impl == "transformer_engine"`` selects the TE layer spec where
    TransformerEngine is installed (``layer_backend="te"``).
    """
    if not isinstance(base, TransformerConfig):
        raise ValueError(f"base ({type(base).__name__}) must be a megatron.core TransformerConfig")
    kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(type(base)) if f.init}
    kw = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(VideoDiTConfig)}}
    fields = video_fields(config)
    # Megatron-LM's --transformer-impl picks the layer spec: TE linears and norms where it asks for
    # transformer_engine and TransformerEngine is installed, the local spec otherwise.
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if getattr(base, "transformer_impl", None) == "transformer_engine" and HAVE_TE:
        fields["layer_backend"] = "te"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*scope is deprecated.*")
        return VideoDiTConfig(**{**kw, **fields})


def build_model(
    config: Config,
    tcfg: VideoDiTConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage=None,
):
    """The model of ``config.model.family`` for this pipeline stage (``family_spec.FamilySpec``).
    With packed micro-batches (``data.buckets``, or fixed shapes placed by token:
    ``batches.placed``) and PP > 1 it sets ``tcfg.variable_seq_lengths`` (the one home of that
    rule for both entries): packed micro-batches vary in length, so the stages exchange shapes."""
    from .batches.placed import tokens_placed

    family = get_family(config.model.family)
    packed = config.data.buckets is not None or tokens_placed(config, family)
    if packed and config.parallel.pipeline_model_parallel_size > 1:
        tcfg.variable_seq_lengths = True
    return get_family(config.model.family).build_model(
        tcfg, pre_process, post_process, vp_stage, config=config
    )


def wrap_data_parallel(tcfg, model, fsdp: bool, has_gpu: bool):
    """Megatron's DDP (with its distributed optimizer, ZeRO-1, on GPUs) or, with
    ``parallel.fsdp``, FSDP (ZeRO-3), both over DP x CP. Gradients reduce in
    fp32; the wrapper's ``ddp_config`` tells the optimizer whether it shards its state."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from ..parallel.fsdp import FullyShardedDataParallel

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=has_gpu and not fsdp,
    )
    if fsdp:
        group = ps.get_data_parallel_group(with_context_parallel=True)
        return FullyShardedDataParallel(tcfg, ddp_config, model, group)
    return DistributedDataParallel(tcfg, ddp_config, model)
