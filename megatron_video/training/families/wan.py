"""The Wan families: ``wan`` (T2V, full attention) and ``wan_ar`` (causal AR, Balanced SP teacher
forcing, LongLive's setting), both diffusers' ``WanTransformer3DModel`` as ``models.wan.WanModel``.

Trained with flow matching (timesteps shifted by ``diffusion.flow_shift``, Wan's ``shift``) on
precomputed Wan-VAE latents and UMT5 caption embeddings (``data.source: shards`` with
``data.text_embed_dim``; ``megatron-video precompute`` with ``vae.diffusers`` and
``--text-encoder``) or on raw clips encoded inside the SP partition (``data.source: energon``
with ``vae.diffusers`` and ``data.text_encoder``; ``families.wan_raw``). ``model.init_from``
loads a diffusers folder or a converted checkpoint (``models.wan.convert``). Batches and layouts
are ``DiffusionFamily``'s; the objectives are
``training.objectives.WanFlowObjective`` / ``WanTeacherForcing``.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from megatron.core.transformer import TransformerConfig

from megatron_video.models.wan.config import WanConfig, wan_architecture
from megatron_video.models.wan.model import WanModel
from megatron_video.models.wan.wan_layer_specs import get_wan_layer_spec

from ..batches.placed import tokens_placed
from ..config import Config, token_grid_of
from ..family_spec import register_family
from ..objectives import PackedObjective, WanFlowObjective, WanTeacherForcing
from ..ti2v import i2v_probability_of
from .diffusion import DiffusionFamily, _check_ar_dit, _tokens_per_cp_rank
from .wan_raw import check_raw_video, raw_encoders

__all__ = [
    "WanFamily",
    "WAN",
    "WAN_AR",
    "wan_transformer_config",
    "init_from_config",
    "diffusers_config_of",
]

# Wan 2.1 / 2.2 (every released size): the architecture constants the config does not vary
WAN_FIXED = dict(
    freq_dim=256,
    eps=1e-6,
    rope_max_seq_len=1024,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    image_dim=None,
    added_kv_proj_dim=None,
)
WAN_ROPE_THETA = 10000.0
_FIELDS = ("init_from", "per_token_timesteps", "data.i2v_probability", "data.text_encoder")
_UNUSED = ("lora_rank", "stdit_variant", "stdit_full_attention_layers", "num_query_groups")


def wan_transformer_config(
    config: Config, has_gpu: bool = False, params_dtype: Optional[torch.dtype] = None
) -> WanConfig:
    """``WanConfig`` of ``config`` (``params_dtype``: default bf16 with ``train.bf16``, else
    fp32); CPU initialisation on a CPU, as ``model_factory.transformer_config``."""
    from megatron_video.compat import device_transformer_config_kwargs

    m, p = config.model, config.parallel
    dtype = params_dtype or (torch.bfloat16 if config.train.bf16 else torch.float32)
    kw = device_transformer_config_kwargs(
        has_gpu,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        kv_channels=m.hidden_size // m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        layernorm_epsilon=WAN_FIXED["eps"],
        **wan_architecture(),
        init_method_std=m.init_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=config.train.bf16,
        **_wan_fields(config),
    )
    if p.recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*scope is deprecated.*")
        return WanConfig(**kw)


def _wan_fields(config: Config) -> dict:
    z = config.vae.latent_channels
    fixed = {k: v for k, v in WAN_FIXED.items() if k != "eps"}
    return dict(
        patch_size=tuple(config.model.patch_size),
        in_channels=z,
        out_channels=z,
        text_dim=config.data.text_embed_dim,
        rope_theta=config.model.rope_theta,
        **fixed,
    )


# ----------------------------------------------------------------------------------------------
# model.init_from
# ----------------------------------------------------------------------------------------------
def init_from_config(path) -> tuple:
    """``(kind, diffusers config)`` of ``model.init_from``: ``"diffusers"`` (a folder with
    ``config.json``) or ``"checkpoint"`` (``models.wan.convert``'s, with its tracker file)."""
    from megatron_video.models.wan.convert import CONFIG_FILE

    p = Path(path)
    tracker = p / "latest_checkpointed_iteration.txt"
    try:
        if (p / "config.json").is_file():
            return "diffusers", json.loads((p / "config.json").read_text())
        if tracker.is_file():
            step = int(tracker.read_text().strip())
            meta = json.loads((p / f"iter_{step:07d}" / CONFIG_FILE).read_text())
            return "checkpoint", meta["diffusers_config"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"model.init_from ({str(path)!r}) is not readable: {type(e).__name__}: {e}"
        ) from None
    raise ValueError(
        f"model.init_from ({str(path)!r}) must be a diffusers WanTransformer3DModel folder "
        f"(config.json) or a checkpoint of `diffusers_to_checkpoint` "
        f"(latest_checkpointed_iteration.txt)"
    )


_FIELD_OF = dict(  # diffusers config key -> the config field it comes from
    num_layers="model.num_layers",
    num_attention_heads="model.num_attention_heads",
    attention_head_dim="model.hidden_size / model.num_attention_heads",
    ffn_dim="model.ffn_hidden_size",
    in_channels="vae.latent_channels",
    out_channels="vae.latent_channels",
    text_dim="data.text_embed_dim",
    patch_size="model.patch_size",
)


def diffusers_config_of(config: Config) -> dict:
    """The diffusers ``WanTransformer3DModel`` config that ``config`` trains."""
    m, z = config.model, config.vae.latent_channels
    return dict(
        num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        attention_head_dim=m.hidden_size // m.num_attention_heads,
        ffn_dim=m.ffn_hidden_size or 4 * m.hidden_size,
        in_channels=z,
        out_channels=z,
        text_dim=config.data.text_embed_dim,
        patch_size=list(m.patch_size),
        **WAN_FIXED,
    )


def _check_init_from(config: Config) -> None:
    from megatron_video.models.wan.interop import full_diffusers_config

    path = config.model.init_from
    _, theirs = init_from_config(path)
    theirs = full_diffusers_config(theirs)
    for key, want in diffusers_config_of(config).items():
        if theirs[key] != want:
            field = _FIELD_OF.get(key, "Wan's fixed architecture")
            raise ValueError(
                f"model.init_from ({path!r}): its {key} ({theirs[key]!r}) must equal "
                f"{field} ({want!r})"
            )


def _load_init_from(model: WanModel, path) -> None:
    """The weights of ``model.init_from`` into this rank's ``model`` (collective for a
    checkpoint)."""
    from megatron_video.models.wan import convert
    from megatron_video.models.wan.interop import (
        full_diffusers_config,
        load_full_weights,
        read_diffusers_folder,
    )
    from megatron_video.models.wan.mapping import to_megatron

    kind, _ = init_from_config(path)
    if kind == "diffusers":
        cfg, sd = read_diffusers_folder(path)
        full = to_megatron(sd, model.config, full_diffusers_config(cfg))
        load_full_weights(model, {k: v.to(model.config.params_dtype) for k, v in full.items()})
        return
    from megatron.core import dist_checkpointing

    iter_dir, _ = convert._read_checkpoint_meta(path)
    request = convert.weights_request(model)
    convert._check_against_index(iter_dir, request)
    loaded = dist_checkpointing.load({"model": request}, str(iter_dir))["model"]
    model.load_state_dict(loaded, strict=False)


# ----------------------------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------------------------
def _check_common(config: Config, world_size: int) -> None:
    m, default = config.model, type(config.model)()
    name = m.family
    for field in _UNUSED:
        if getattr(m, field) != getattr(default, field):
            raise ValueError(
                f"model.{field} ({getattr(m, field)!r}) is not a field of model.family "
                f"{name!r} (Wan's architecture has no such choice); leave it at "
                f"{getattr(default, field)!r}"
            )
    if m.rope_theta != WAN_ROPE_THETA:
        raise ValueError(
            f"model.rope_theta ({m.rope_theta!r}) must be {WAN_ROPE_THETA} for model.family "
            f"{name!r} (Wan's RoPE)"
        )
    _check_source(config)
    grid = token_grid_of(config)
    if max(grid) > WAN_FIXED["rope_max_seq_len"]:
        raise ValueError(
            f"token grid {grid} (data.num_frames / height / width over model.patch_size) must "
            f"not exceed Wan's rope_max_seq_len ({WAN_FIXED['rope_max_seq_len']}) on any axis"
        )
    if m.init_from is not None:
        _check_init_from(config)
    _check_i2v(config)


def _check_source(config: Config) -> None:
    d, name = config.data, config.model.family
    if d.source == "energon":
        return check_raw_video(config)
    if d.source != "shards":
        raise ValueError(
            f"data.source ({d.source!r}) must be 'shards' (`megatron-video precompute`) or "
            f"'energon' (raw clips encoded in the step) for model.family {name!r}: Wan has no "
            f"procedural source (its captions need a text encoder)"
        )
    if d.text_embed_dim is None:
        raise ValueError(
            f"data.text_embed_dim (None) must be set with data.source 'shards' for model.family "
            f"{name!r}: Wan trains on the UMT5 embeddings `megatron-video precompute "
            f"--text-encoder` stores"
        )
    if d.text_encoder is not None:
        raise ValueError(
            f"data.text_encoder ({d.text_encoder!r}) is read with data.source 'energon' only "
            f"(shards hold precomputed caption embeddings); leave it null"
        )


def _check_i2v(config: Config) -> None:
    """First-frame (I2V) conditioning: whole first-frame tokens (fixed shapes or
    ``data.buckets``)."""
    from megatron_video.diffusion.ti2v import check_first_frame_patch

    p = i2v_probability_of(config)
    if p == 0:
        return
    check_first_frame_patch(config.model.patch_size)


def _check_wan(config: Config, world_size: int) -> None:
    _check_common(config, world_size)
    _tokens_per_cp_rank(config, world_size)


def _check_wan_ar(config: Config, world_size: int) -> None:
    _check_common(config, world_size)
    if config.model.per_token_timesteps:
        raise ValueError(
            "model.per_token_timesteps (True) is implied by model.family 'wan_ar' (teacher "
            "forcing timesteps are per block); leave it false"
        )
    _check_ar_dit(config, world_size)


# ----------------------------------------------------------------------------------------------
# The family kind
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class WanFamily(DiffusionFamily):
    """``DiffusionFamily`` (batches, layouts) with ``WanModel``, its config and objectives; no
    project VAE: latents come precomputed, or from raw clips through ``vae.diffusers``."""

    needs_vae: bool = False
    model_fields: tuple = _FIELDS

    @property
    def reads_raw_video(self) -> bool:
        return True

    def raw_video_encoders(self, config: Config):
        """``wan_raw.WanRawEncoders`` with ``data.source: energon``, else None (shards)."""
        return raw_encoders(config) if config.data.source == "energon" else None

    def check_rl(self, config: Config) -> None:
        """``train.objective: grpo``: Flow-GRPO (``rl.rules``; ``wan_ar``: streamed rollouts)."""
        from megatron_video.rl.rules import check_flow_rl

        check_flow_rl(config, tokens_placed(config, self), self.autoregressive)

    def transformer_config(self, config: Config, has_gpu: bool = False) -> WanConfig:
        return wan_transformer_config(config, has_gpu)

    def build_model(
        self, tcfg, pre_process=True, post_process=True, vp_stage=None, config: Config = None
    ):
        model = WanModel(
            tcfg,
            pre_process=pre_process,
            post_process=post_process,
            layer_spec=get_wan_layer_spec(tcfg),
            vp_stage=vp_stage,
        )
        if config is not None and config.model.init_from is not None:
            _load_init_from(model, config.model.init_from)
        return model

    def checkpoint_files(self, config: Config, params_dtype) -> dict:
        """``diffusers_config.json``, as ``models.wan.convert`` writes it: ``megatron-video
        convert --to-diffusers`` exports a trained checkpoint."""
        from megatron_video.models.wan.convert import CONFIG_FILE, checkpoint_meta
        from megatron_video.models.wan.interop import full_diffusers_config

        p = config.parallel
        meta = checkpoint_meta(
            full_diffusers_config(diffusers_config_of(config)),
            params_dtype,
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
        )
        return {CONFIG_FILE: meta}

    def megatron_lm_config(self, base, config: Config) -> WanConfig:
        """Megatron-LM's ``base`` for precision, recompute, parallel and fusion settings; Wan's
        architecture (sizes, norms, GELU-tanh, biases) and fields from ``config``."""
        if not isinstance(base, TransformerConfig):
            raise ValueError(
                f"base ({type(base).__name__}) must be a megatron.core TransformerConfig"
            )
        ours = wan_transformer_config(config, params_dtype=base.params_dtype)
        arch = {f.name for f in dataclasses.fields(WanConfig)} - {
            f.name for f in dataclasses.fields(TransformerConfig)
        }
        arch |= {"num_layers", "hidden_size", "num_attention_heads", "kv_channels"}
        arch |= {"ffn_hidden_size", "layernorm_epsilon", "add_bias_linear", "activation_func"}
        arch |= {"gated_linear_unit", "bias_activation_fusion", "num_query_groups"}
        kw = {f.name: getattr(base, f.name) for f in dataclasses.fields(type(base)) if f.init}
        kw = {k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(WanConfig)}}
        kw.update({k: getattr(ours, k) for k in arch})
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*scope is deprecated.*")
            return WanConfig(**kw)

    def check_megatron_lm_args(self, config: Config, args) -> None:
        m = config.model
        ffn, ours = getattr(args, "ffn_hidden_size", None), m.ffn_hidden_size or 4 * m.hidden_size
        if ffn is not None and ffn != ours:
            raise ValueError(
                f"--ffn-hidden-size ({ffn}) must equal the video config's value ({ours})"
            )

    def make_objective(self, config: Config, groups, sample):
        if tokens_placed(config, self):  # batches.placed: packed micro-batches of one shape
            return self.make_packed_objective(config)
        patch, z = config.model.patch_size, config.vae.latent_channels
        i2v = i2v_probability_of(config) > 0
        if self.autoregressive:
            return WanTeacherForcing(sample.layout, groups, sample.geometry, patch, z, i2v)
        cp, rank = (1, 0) if groups is None else (groups.cp_size, groups.cp_rank)
        per_token = config.model.per_token_timesteps
        return WanFlowObjective(sample.geometry, patch, z, per_token, cp, rank, i2v)

    def make_packed_objective(self, config: Config):
        """``objectives.PackedObjective`` with Wan's interface (flow; teacher forcing for AR)."""
        kind = "teacher_forcing" if self.autoregressive else "flow"
        return PackedObjective(
            kind, wan=(tuple(config.model.patch_size), config.vae.latent_channels)
        )


WAN = register_family(
    WanFamily(
        name="wan",
        summary="Wan 2.1 / 2.2 T2V (diffusers' WanTransformer3DModel), flow matching",
        objectives=("flow",),
        layer_type="full",
        autoregressive=False,
        model=WanModel,
        check=_check_wan,
        packed_kind="full",
        trainers=(("grpo", "megatron_video.training.grpo_wan:WanGRPOTrainer"),),
    )
)
WAN_AR = register_family(
    WanFamily(
        name="wan_ar",
        summary="Wan as a causal AR model, Balanced SP teacher forcing (LongLive)",
        objectives=("flow",),
        layer_type="full",
        autoregressive=True,
        model=WanModel,
        check=_check_wan_ar,
        packed_kind="teacher_forcing",
        trainers=(("grpo", "megatron_video.training.grpo_wan_ar:WanARGRPOTrainer"),),
    )
)
