"""VideoDiT (full 3D attention) and the shared DiT model shell, built from Megatron-Core pieces.

``VideoDiTConfig`` extends Megatron's ``TransformerConfig`` with the video fields. ``VideoDiT``
is a ``MegatronModule``: conditioning embedders (timestep, text) on every pipeline stage, patch
embedding on the first, a Megatron ``TransformerBlock`` of layers from a ``ModuleSpec``, and the
final AdaLN layer on the last. Two layer families share the shell:

* ``layer_type="full"``: ``VideoDiTLayer`` (this module): 2D (Ulysses x ring) full self-attention
  over the CP group, cross-attention to the whole text without CP, MLP; AdaLN-LoRA modulation
  (``D -> r -> 9D``, zero-initialised), per-head QK RMSNorm, 3D RoPE from global token positions.
* ``layer_type="stdit"``: ``models.stdit.STDiTLayer`` (hybrid CP<->DP spatial/temporal attention).

Token layout: a sample's frame-major token sequence (``embedders.patchify``) is split contiguously
over the CP group, rank ``c`` holding tokens ``[c*s, (c+1)*s)``; with the frame count divisible by
the CP size that is exactly ST-DiT's layout A, so both families take the same local input.

Layer call convention (shared with ``STDiTLayer``; Megatron's ``TransformerBlock`` has fixed slots):
``hidden_states [s, b, D]``, ``attention_mask`` = AdaLN conditioning ``[b, D]``, ``context [L, b,
D_c]`` / ``context_mask [b, L]`` (True = real text token), ``packed_seq_params`` = a
``VideoSeqParams`` carrying the global token grid.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention import dist_attention
from megatron_video.data.synthetic import VOCAB
from megatron_video.layouts.stdit import VideoGeometry, token_thw
from megatron_video.models.dit_blocks import (AdaLNLoRAModulation, DiTAttentionSubmodules,
                                              DiTCrossAttention, DiTCrossAttentionSubmodules,
                                              DiTSelfAttention, TimestepEmbedder, VideoSeqParams,
                                              attend, gated, modulate, rope_3d_angles)
from megatron_video.models.dit_layer import DiTLayerBase
from megatron_video.models.embedders import (FinalLayer, PatchEmbed, TextEmbedder,
                                             mark_pipeline_replicated)
from megatron_video.parallel.comm import check_same_shape

__all__ = ["LAYER_TYPES", "VideoDiTConfig", "VideoDiTLayerSubmodules", "VideoDiTLayer",
           "get_video_dit_layer_spec", "layer_spec_for", "VideoDiT", "replicated_embedders",
           "mark_pp_replicas"]

LAYER_TYPES = ("full", "stdit")


@dataclass
class VideoDiTConfig(TransformerConfig):
    """``TransformerConfig`` plus the video fields of the DiT family."""

    in_channels: int = 4                         # latent channels
    patch_size: Tuple[int, int, int] = (1, 1, 1)  # (pt, ph, pw)
    lora_rank: int = 32                          # AdaLN-LoRA rank r
    rope_theta: Optional[float] = 10000.0        # None disables 3D RoPE
    timestep_scale: float = 1000.0               # timestep (or EDM c_noise) -> sinusoid argument
    timestep_frequency_dim: int = 256
    text_vocab_size: int = len(VOCAB)
    text_max_len: int = 16
    text_dim: Optional[int] = None               # width of the text embeddings (default hidden_size)
    layer_type: str = "full"                     # "full" (VideoDiT) or "stdit"
    stdit_variant: str = "hybrid"
    stdit_full_attention_layers: Tuple[int, ...] = ()
    cond_seed: int = 1234                        # replicated embedders start identical everywhere
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
# The full-attention layer
# ----------------------------------------------------------------------------------------------
@dataclass
class VideoDiTLayerSubmodules:
    modulation: Union[ModuleSpec, type] = AdaLNLoRAModulation
    self_attention: Union[ModuleSpec, type] = None
    cross_attention: Union[ModuleSpec, type] = None
    mlp: Union[ModuleSpec, type] = None


def get_video_dit_layer_spec(lora_rank: int = 256, rope_theta: Optional[float] = 10000.0,
                             context_dim: Optional[int] = None) -> ModuleSpec:
    """``ModuleSpec`` of ``VideoDiTLayer`` for Megatron's ``TransformerBlock``."""
    return ModuleSpec(
        module=VideoDiTLayer,
        params=dict(lora_rank=lora_rank, rope_theta=rope_theta, context_dim=context_dim),
        submodules=VideoDiTLayerSubmodules(
            modulation=AdaLNLoRAModulation,
            self_attention=ModuleSpec(module=DiTSelfAttention, submodules=DiTAttentionSubmodules()),
            cross_attention=ModuleSpec(module=DiTCrossAttention,
                                       submodules=DiTCrossAttentionSubmodules()),
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))),
    )


def layer_spec_for(config: VideoDiTConfig) -> ModuleSpec:
    """The layer spec selected by ``config.layer_type``."""
    if config.layer_type == "stdit":
        from megatron_video.models.stdit import get_stdit_layer_spec

        return get_stdit_layer_spec(config.stdit_variant, config.stdit_full_attention_layers,
                                    config.lora_rank, config.rope_theta, config.text_dim)
    return get_video_dit_layer_spec(config.lora_rank, config.rope_theta, config.text_dim)


class VideoDiTLayer(DiTLayerBase):
    """Full-attention DiT block: 2D self-attention, cross-attention, MLP, each AdaLN-gated."""

    sequence_parallel_reason = "its sequence is already split by context parallelism"

    def __init__(self, config: TransformerConfig, submodules: VideoDiTLayerSubmodules,
                 layer_number: int = 1, pg_collection=None, vp_stage: Optional[int] = None,
                 lora_rank: int = 256, rope_theta: Optional[float] = 10000.0,
                 context_dim: Optional[int] = None):
        super().__init__(config, layer_number, vp_stage)
        self.rope_theta = rope_theta
        self._build_dit_submodules(submodules, lora_rank, context_dim)

    def _attention(self, x, geometry: VideoGeometry):
        P, rank = self._cp()
        s = x.shape[1]
        angles = None
        if self.rope_theta is not None:
            ids = torch.arange(rank * s, (rank + 1) * s)
            angles = rope_3d_angles(token_thw(ids, geometry), self.self_attention.head_dim,
                                    self.rope_theta).to(x.device)
        q, k, v = self.self_attention.qkv(x, angles)
        o = attend(q, k, v) if P == 1 else dist_attention(q, k, v, self.groups, scheme="contiguous")
        return self.self_attention.project(o)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[VideoSeqParams] = None, **unused):
        """``hidden_states [s, b, D]`` (contiguous CP shard) -> ``([s, b, D], context)``."""
        conditioning = attention_mask
        geometry = self._geometry(packed_seq_params, "the global token grid")
        s, b, D = hidden_states.shape
        P, _ = self._cp()
        if s * P != geometry.tokens:
            raise ValueError(f"hidden_states sequence length ({s}) x cp_size ({P}) must equal the "
                             f"tokens of geometry {geometry} ({geometry.tokens})")
        if conditioning is None or tuple(conditioning.shape) != (b, D):
            raise ValueError(f"attention_mask (conditioning) must be [b, D] = [{b}, {D}], got "
                             f"{None if conditioning is None else tuple(conditioning.shape)}")
        if P > 1:
            shapes = {"hidden_states": hidden_states, "conditioning": conditioning}
            if context is not None:
                shapes["context"] = context
            check_same_shape(shapes, self.groups.cp_group, where="VideoDiTLayer")
        mods = self.modulation(conditioning)

        def branch(i, x, f):
            shift, scale, gate = mods[3 * i:3 * i + 3]
            return x + gated(f(modulate(self._norm(x), shift, scale)), gate)

        x = hidden_states.transpose(0, 1)
        x = branch(0, x, lambda y: self._attention(y, geometry))
        if context is not None:
            ctx = context.transpose(0, 1)
            x = branch(1, x, lambda y: self.cross_attention(y, ctx, context_mask))
        x = branch(2, x, self._mlp)
        return x.transpose(0, 1).contiguous(), context


# ----------------------------------------------------------------------------------------------
# The model shell
# ----------------------------------------------------------------------------------------------
def replicated_embedders(model: torch.nn.Module):
    """Names of the top-level submodules replicated on every pipeline stage."""
    return [n for n in ("t_embedder", "text_embedder") if hasattr(model, n)]


def mark_pp_replicas(sharded_sd: dict, prefixes) -> dict:
    """Give pipeline-replicated tensors a replica id per stage (stage 0 holds the main copy);
    Megatron's default id ``(0, tp, dp)`` would make every stage claim the main replica."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    pp = parallel_state.get_pipeline_model_parallel_rank()
    for key, value in sharded_sd.items():
        if isinstance(value, ShardedTensor) and any(key.startswith(p) for p in prefixes):
            rid = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
            value.replica_id = (pp,) + tuple(rid[1:]) if rid and rid[0] == 0 else (pp,) + tuple(rid)
    return sharded_sd


class VideoDiT(MegatronModule):
    """Video DiT on patch tokens; see the module docstring.

    ``forward(tokens, timesteps, caption_ids, caption_mask, geometry, drop=None)``:
    ``tokens [b, s_local, C*pt*ph*pw]`` this CP rank's patch tokens (first stage; ignored on later
    stages, which read ``set_input_tensor``), ``timesteps [b]`` (EDM ``c_noise`` or flow ``t``),
    ``caption_ids / caption_mask [b, L]``, ``geometry`` the global token grid, ``drop [b]`` bool
    (classifier-free guidance: use the null caption). Returns ``[b, s_local, patch_dim]`` on the
    last stage and the hidden states ``[s_local, b, D]`` on the others.
    """

    def __init__(self, config: VideoDiTConfig, pre_process: bool = True, post_process: bool = True,
                 layer_spec: Optional[ModuleSpec] = None, vp_stage: Optional[int] = None):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False   # read by Megatron's finalize_model_grads
        self.pre_process, self.post_process = pre_process, post_process
        # Identical conditioning embedders on every stage / rank: seeded apart from the global RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.cond_seed)
            self.t_embedder = TimestepEmbedder(config, config.timestep_frequency_dim)
            self.text_embedder = TextEmbedder(config.text_vocab_size, config.text_dim,
                                              config.text_max_len, seed=config.cond_seed)
        for name in replicated_embedders(self):
            mark_pipeline_replicated(getattr(self, name))
        if pre_process:
            self.patch_embed = PatchEmbed(config, config.patch_dim)
        self.decoder = TransformerBlock(config, layer_spec or layer_spec_for(config),
                                        pre_process=pre_process, post_process=False,
                                        vp_stage=vp_stage)
        if post_process:
            self.final_layer = FinalLayer(config, config.patch_dim)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def conditioning(self, timesteps: torch.Tensor) -> torch.Tensor:
        return self.t_embedder(timesteps * self.config.timestep_scale)

    def forward(self, tokens: Optional[torch.Tensor], timesteps: torch.Tensor,
                caption_ids: torch.Tensor, caption_mask: torch.Tensor, geometry: VideoGeometry,
                drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        c = self.conditioning(timesteps)
        ctx, ctx_mask = self.text_embedder(caption_ids, caption_mask, drop)
        hidden = None
        if self.pre_process:
            if tokens is None or tokens.dim() != 3 or tokens.shape[-1] != self.config.patch_dim:
                raise ValueError(f"tokens ({None if tokens is None else tuple(tokens.shape)}) must be "
                                 f"[b, s_local, patch_dim = {self.config.patch_dim}]")
            hidden = self.patch_embed(tokens).transpose(0, 1).contiguous()
        out = self.decoder(hidden, attention_mask=c, context=ctx.transpose(0, 1).contiguous(),
                           context_mask=ctx_mask, packed_seq_params=VideoSeqParams(geometry=geometry))
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.final_layer(out.transpose(0, 1), c)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        # Layers differ when ST-DiT adds full attention to some; save them per global layer.
        metadata = dict(metadata or {}, non_homogeneous_layers=True)
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return mark_pp_replicas(sd, [f"{prefix}{n}." for n in replicated_embedders(self)])
