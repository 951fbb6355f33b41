"""VideoDiT: the DiT model shell (conditioning embedders on every pipeline stage, patch embedding
on the first, a ``VideoTransformerBlock`` of layers from a ``ModuleSpec``, the final AdaLN layer on
the last) and ``VideoDiTConfig``, Megatron's ``TransformerConfig`` plus the video fields. The
layers: ``models.video_dit_layer`` / ``models.stdit``; their specs: ``models.dit_layer_specs``.
Design: docs/architecture.md, "Megatron integration".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention.masks import AttentionMask
from megatron_video.layouts.packed_video import PackedVideo
from megatron_video.layouts.placement import Placement
from megatron_video.layouts.stdit import VideoGeometry
from megatron_video.models.dit_blocks import TimestepEmbedder
from megatron_video.models.dit_layer import DiTParams, VideoTransformerBlock
from megatron_video.models.dit_layer_specs import (  # noqa: F401  (re-exported, their old home)
    LAYER_BACKENDS,
    check_layer_backend,
    dit_backend_modules,
    dit_cross_attention_spec,
    dit_mlp_spec,
    dit_self_attention_spec,
    full_2d_attention,
    full_attention_layer_spec,
    get_video_dit_layer_spec,
    layer_spec_for,
)
from megatron_video.models.embedders import (
    VOCAB,
    FinalLayer,
    PatchEmbed,
    TextEmbedder,
    mark_pipeline_replicated,
)
from megatron_video.models.packed import (
    check_packed,
    pack_context,
    packed_attention_mask,
    per_clip_to_tokens,
)
from megatron_video.models.video_dit_layer import VideoDiTLayer  # noqa: F401  (re-exported)

__all__ = ["LAYER_TYPES", "VideoDiTConfig", "VideoDiT", "replicated_embedders", "mark_pp_replicas"]

LAYER_TYPES = ("full", "stdit")


@dataclass
class VideoDiTConfig(TransformerConfig):
    """``TransformerConfig`` plus the video fields of the DiT family."""

    in_channels: int = 4  # latent channels
    patch_size: Tuple[int, int, int] = (1, 1, 1)  # (pt, ph, pw)
    lora_rank: int = 32  # AdaLN-LoRA rank r
    rope_theta: Optional[float] = 10000.0  # None disables 3D RoPE
    timestep_scale: float = 1000.0  # timestep (or EDM c_noise) -> sinusoid argument
    timestep_frequency_dim: int = 256
    text_vocab_size: int = len(VOCAB)
    text_max_len: int = 16
    text_dim: Optional[int] = None  # width of the text embeddings (default hidden_size)
    text_input_dim: Optional[int] = None  # width of precomputed caption embeddings (projected)
    layer_type: str = "full"  # "full" (VideoDiT) or "stdit"
    stdit_variant: str = "hybrid"
    stdit_full_attention_layers: Tuple[int, ...] = ()
    layer_backend: str = "local"  # layer spec: "local" or "te" (TransformerEngine)
    cond_seed: int = 1234  # replicated embedders start identical everywhere
    # Megatron's finalize_model_grads all-reduces params tagged ``pipeline_parallel`` over the
    # pipeline group when this is set (the conditioning embedders live on every stage).
    has_cond_embedder: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_type ({self.layer_type!r}) must be one of {LAYER_TYPES}")
        if len(tuple(self.patch_size)) != 3 or any(int(p) < 1 for p in self.patch_size):
            raise ValueError(f"patch_size ({self.patch_size!r}) must be three positive integers")
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank ({self.lora_rank}) must be >= 1")
        if self.text_dim is None:
            self.text_dim = self.hidden_size

    @property
    def patch_dim(self) -> int:
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw


# ----------------------------------------------------------------------------------------------
# The model shell
# ----------------------------------------------------------------------------------------------
def replicated_embedders(model: torch.nn.Module):
    """Names of the top-level submodules replicated on every pipeline stage."""
    return [n for n in ("t_embedder", "text_embedder") if hasattr(model, n)]


def mark_pp_replicas(sharded_sd: dict, prefixes) -> dict:
    """Give pipeline-replicated tensors a replica id per stage (stage 0 holds the main copy);
    Megatron's default id ``(0, tp, dp)`` would make every stage claim the main replica."""
    pp = parallel_state.get_pipeline_model_parallel_rank()
    for key, value in sharded_sd.items():
        if isinstance(value, ShardedTensor) and any(key.startswith(p) for p in prefixes):
            rid = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
            value.replica_id = (pp,) + tuple(rid[1:]) if rid and rid[0] == 0 else (pp,) + tuple(rid)
    return sharded_sd


class VideoDiT(MegatronModule):
    """Video DiT on patch tokens (the shell of the module docstring).

    ``forward(tokens, timesteps, caption_ids, caption_mask, geometry, drop=None)``:
    ``tokens [b, s_local, C*pt*ph*pw]`` this CP rank's patch tokens (first stage; ignored on later
    stages, which read ``set_input_tensor``), ``timesteps [b]`` (EDM ``c_noise`` or flow ``t``),
    ``caption_ids / caption_mask [b, L]``, ``geometry`` the global token grid, ``drop [b]`` bool
    (classifier-free guidance: use the null caption). Returns ``[b, s_local, patch_dim]`` on the
    last stage and the hidden states ``[s_local, b, D]`` on the others.

    A packed micro-batch (docs/architecture.md, "Packed micro-batches in the models"):
    ``geometry`` a ``PackedVideo`` of full clips, ``tokens [1, s_local, patch_dim]`` the ids
    ``placement.rank_ids(cp_rank)`` of the packed sequence (``placement`` may be None only at
    CP = 1), ``timesteps [C]``, ``caption_ids / caption_mask [C, L]`` and ``drop [C]`` per clip;
    ``mask`` overrides the clips' document mask (tests). ST-DiT refuses it.
    """

    def __init__(
        self,
        config: VideoDiTConfig,
        pre_process: bool = True,
        post_process: bool = True,
        layer_spec: Optional[ModuleSpec] = None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False  # read by Megatron's finalize_model_grads
        self.pre_process, self.post_process = pre_process, post_process
        # Identical conditioning embedders on every stage / rank: seeded apart from the global RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.cond_seed)
            self.t_embedder = TimestepEmbedder(config, config.timestep_frequency_dim)
            self.text_embedder = TextEmbedder(
                config.text_vocab_size,
                config.text_dim,
                config.text_max_len,
                seed=config.cond_seed,
                input_dim=config.text_input_dim,
            )
        for name in replicated_embedders(self):
            mark_pipeline_replicated(getattr(self, name))
        if pre_process:
            self.patch_embed = PatchEmbed(config, config.patch_dim)
        self.decoder = VideoTransformerBlock(
            config,
            layer_spec or layer_spec_for(config),
            pre_process=pre_process,
            post_process=False,
            vp_stage=vp_stage,
        )
        if post_process:
            self.final_layer = FinalLayer(config, config.patch_dim)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def conditioning(self, timesteps: torch.Tensor) -> torch.Tensor:
        return self.t_embedder(timesteps * self.config.timestep_scale)

    def forward(
        self,
        tokens: Optional[torch.Tensor],
        timesteps: torch.Tensor,
        caption_ids: torch.Tensor,
        caption_mask: torch.Tensor,
        geometry: VideoGeometry,
        drop: Optional[torch.Tensor] = None,
        placement: Optional[Placement] = None,
        mask: Optional[AttentionMask] = None,
    ) -> torch.Tensor:
        if isinstance(geometry, PackedVideo):
            return self._forward_packed(
                tokens, timesteps, caption_ids, caption_mask, geometry, drop, placement, mask
            )
        if placement is not None or mask is not None:
            raise ValueError(
                f"placement ({placement!r}) and mask ({mask!r}) must be None unless geometry is "
                f"a PackedVideo (a packed micro-batch)"
            )
        c = self.conditioning(timesteps)
        ctx, ctx_mask = self.text_embedder(caption_ids, caption_mask, drop)
        hidden = None
        if self.pre_process:
            if tokens is None or tokens.dim() != 3 or tokens.shape[-1] != self.config.patch_dim:
                raise ValueError(
                    f"tokens ({None if tokens is None else tuple(tokens.shape)}) must be "
                    f"[b, s_local, patch_dim = {self.config.patch_dim}]"
                )
            hidden = self.patch_embed(tokens).transpose(0, 1).contiguous()
        out = self.decoder(
            hidden,
            DiTParams(conditioning=c, geometry=geometry),
            context=ctx.transpose(0, 1).contiguous(),
            context_mask=ctx_mask,
        )
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.final_layer(out.transpose(0, 1), c)

    def cp_coordinates(self):
        """``(cp_size, cp_rank)`` of the layers (resolved by their one rule; ``(1, 0)`` without
        CP)."""
        return self.decoder.layers[0]._cp()

    def _packed_inputs(self, packed, kind, tokens, width, placement, per_clip, mask=None):
        """Checks of a packed forward (before any collective): ``per_clip`` ``{name: tensor}``
        each ``[num_clips, ...]``; returns this CP rank's global ids and the clip of each."""
        if self.config.layer_type == "stdit":
            raise ValueError(
                "geometry (PackedVideo) is not supported by ST-DiT (layer_type 'stdit'): its "
                "layouts A / B need a regular frame grid on every CP rank (whole frames of one "
                "sample per rank); use layer_type 'full' for packed micro-batches"
            )
        if mask is not None and not isinstance(mask, AttentionMask):
            raise ValueError(
                f"mask ({type(mask).__name__}) must be None (the clips' mask) or a "
                f"megatron_video AttentionMask on the packed sequence's global ids"
            )
        n = packed.num_clips if isinstance(packed, PackedVideo) else None
        for name, t in per_clip.items():
            if t is not None and (t.dim() < 1 or t.shape[0] != n):
                raise ValueError(
                    f"{name} ({tuple(t.shape)}) must have one row per clip (num_clips = {n}) "
                    f"for a packed micro-batch"
                )
        s = None if tokens is None else tokens.shape[1]
        if self.pre_process:
            if tokens is None or tokens.dim() != 3 or tokens.shape[-1] != width:
                raise ValueError(
                    f"tokens ({None if tokens is None else tuple(tokens.shape)}) must be "
                    f"[1, s_local, {width}] for a packed micro-batch"
                )
        b = 1 if tokens is None else tokens.shape[0]
        if s is None:
            s = packed.seq_len // self.config.context_parallel_size
        ids = check_packed(
            packed, kind, type(self).__name__, placement, self.cp_coordinates(), s, b
        )
        return ids, packed.clip_of(ids)

    def _forward_packed(
        self, tokens, timesteps, caption_ids, caption_mask, packed, drop, place, mask
    ):
        """``forward`` on a packed micro-batch (see the class docstring)."""
        _, clip = self._packed_inputs(
            packed,
            "full",
            tokens,
            self.config.patch_dim,
            place,
            dict(
                timesteps=timesteps, caption_ids=caption_ids, caption_mask=caption_mask, drop=drop
            ),
            mask,
        )
        c = self.conditioning(timesteps)  # [C, D]
        ctx, ctx_mask = pack_context(*self.text_embedder(caption_ids, caption_mask, drop))
        hidden = None
        if self.pre_process:
            hidden = self.patch_embed(tokens).transpose(0, 1).contiguous()
        params = DiTParams(
            conditioning=c,
            attention_mask=packed_attention_mask(packed) if mask is None else mask,
            packed=packed,
            placement=place,
        )
        out = self.decoder(hidden, params, context=ctx, context_mask=ctx_mask)
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        c_tok = per_clip_to_tokens(c, clip.to(c.device))[None]  # [1, s_local, D]
        return self.final_layer(out.transpose(0, 1), c_tok)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        # Layers differ when ST-DiT adds full attention to some; save them per global layer.
        metadata = dict(metadata or {}, non_homogeneous_layers=True)
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return mark_pp_replicas(sd, [f"{prefix}{n}." for n in replicated_embedders(self)])
