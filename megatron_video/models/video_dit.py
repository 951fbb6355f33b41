"""VideoDiT (full 3D attention) and the shared DiT model shell, built from Megatron-Core pieces.

``VideoDiTConfig`` extends Megatron's ``TransformerConfig`` with the video fields. ``VideoDiT``
is a ``MegatronModule``: conditioning embedders (timestep, text) on every pipeline stage, patch
embedding on the first, a ``VideoTransformerBlock`` (Megatron's ``TransformerBlock``) of
``TransformerLayer``-based layers from a ``ModuleSpec``, and the final AdaLN layer on the last. Two layer families share the shell:

* ``layer_type="full"``: ``VideoDiTLayer`` (this module): 2D (Ulysses x ring) full self-attention
  over the CP group, cross-attention to the whole text without CP, MLP; AdaLN-LoRA modulation
  (``D -> r -> 9D``, zero-initialised), per-head QK RMSNorm, 3D RoPE from global token positions.
* ``layer_type="stdit"``: ``models.stdit.STDiTLayer`` (hybrid CP<->DP spatial/temporal attention).

Token layout: a sample's frame-major token sequence (``embedders.patchify``) is split contiguously
over the CP group, rank ``c`` holding tokens ``[c*s, (c+1)*s)``; with the frame count divisible by
the CP size that is exactly ST-DiT's layout A, so both families take the same local input.

Layer call convention (shared with ``STDiTLayer`` and ``ARDiTLayer``): ``hidden_states [s, b, D]``,
``context [L, b, D_c]`` / ``context_mask [b, L]`` (True = real text token) in Megatron's slots, and
``params``, a ``models.dit_layer.DiTParams`` with the AdaLN conditioning ``[b, D]`` and the global
token grid. Specs: ``get_video_dit_layer_spec(..., backend="local" | "te")``; the self-attention's
``core_attention`` slot holds the 2D attention and ``models.specs.with_2d_attention`` swaps it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention.megatron import DistAttention2D
from megatron_video.data.synthetic import VOCAB
from megatron_video.layouts.stdit import VideoGeometry, token_thw
from megatron_video.models.dit_blocks import (AdaLNLoRAModulation, AdaLNNorm,
                                              DiTAttentionSubmodules, DiTCrossAttention,
                                              DiTCrossAttentionSubmodules, DiTSelfAttention,
                                              TimestepEmbedder, gated, modulate, rope_3d_angles,
                                              rope_embedding)
from megatron_video.models.dit_layer import (DiTLayerBase, DiTLayerSubmodules, DiTParams,
                                             VideoTransformerBlock, mlp_submodule)
from megatron_video.models.embedders import (FinalLayer, PatchEmbed, TextEmbedder,
                                             mark_pipeline_replicated)
from megatron_video.parallel.comm import check_same_shape

__all__ = ["LAYER_TYPES", "LAYER_BACKENDS", "VideoDiTConfig", "VideoDiTLayer",
           "get_video_dit_layer_spec", "full_attention_layer_spec", "layer_spec_for", "dit_backend_modules",
           "dit_self_attention_spec", "dit_cross_attention_spec", "dit_mlp_spec", "full_2d_attention", "VideoDiT", "replicated_embedders",
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
    text_input_dim: Optional[int] = None         # width of precomputed caption embeddings (projected)
    layer_type: str = "full"                     # "full" (VideoDiT) or "stdit"
    stdit_variant: str = "hybrid"
    stdit_full_attention_layers: Tuple[int, ...] = ()
    layer_backend: str = "local"                 # layer spec: "local" or "te" (TransformerEngine)
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
# Layer specs (local and TE) and the full-attention layer
# ----------------------------------------------------------------------------------------------
LAYER_BACKENDS = ("local", "te")


def dit_backend_modules(backend: str = "local") -> dict:
    """The linear / norm classes of a DiT layer spec: Megatron-core's own (``"local"``, CPU and
    GPU) or TransformerEngine's (``"te"``: ``TEColumnParallelLinear`` / ``TERowParallelLinear`` /
    ``TENorm``, FP8-capable). TE classes are looked up only here, when a TE spec is asked for."""
    if backend == "local":
        return dict(column=ColumnParallelLinear, row=RowParallelLinear, norm=AdaLNNorm)
    if backend == "te":
        from megatron.core.extensions import transformer_engine as te

        return dict(column=te.TEColumnParallelLinear, row=te.TERowParallelLinear, norm=te.TENorm)
    raise ValueError(f"backend ({backend!r}) must be one of {LAYER_BACKENDS}")


def check_layer_backend(backend: str) -> None:
    """``ValueError`` unless ``backend`` can build modules here (``"te"`` needs TransformerEngine)."""
    if backend not in LAYER_BACKENDS:
        raise ValueError(f"layer_backend ({backend!r}) must be one of {LAYER_BACKENDS}")
    if backend == "te":
        from megatron.core.extensions.transformer_engine import HAVE_TE

        if not HAVE_TE:
            raise ValueError("layer_backend ('te') needs TransformerEngine, which is not installed "
                             "here; use 'local'")


def dit_self_attention_spec(core_attention, backend: str = "local") -> ModuleSpec:
    """``DiTSelfAttention`` with ``core_attention`` and the backend's linears."""
    m = dit_backend_modules(backend)
    return ModuleSpec(module=DiTSelfAttention, params=dict(attn_mask_type=AttnMaskType.no_mask),
                      submodules=DiTAttentionSubmodules(linear_qkv=m["column"],
                                                        core_attention=core_attention,
                                                        linear_proj=m["row"]))


def dit_cross_attention_spec(context_dim: Optional[int], backend: str = "local") -> ModuleSpec:
    """Cross-attention to the whole text (no CP) with the backend's linears."""
    m = dit_backend_modules(backend)
    return ModuleSpec(module=DiTCrossAttention, params=dict(context_dim=context_dim),
                      submodules=DiTCrossAttentionSubmodules(linear_q=m["column"],
                                                             linear_kv=m["column"],
                                                             linear_proj=m["row"]))


def dit_mlp_spec(backend: str = "local"):
    m = dit_backend_modules(backend)
    return mlp_submodule(MLPSubmodules(linear_fc1=m["column"], linear_fc2=m["row"]))


def full_2d_attention() -> ModuleSpec:
    """Core attention over the whole sequence, context-parallel: 2D attention on the contiguous
    CP split the DiT models use (rank ``c`` holds tokens ``[c*s, (c+1)*s)``)."""
    return ModuleSpec(module=DistAttention2D, params=dict(scheme="contiguous"))


def get_video_dit_layer_spec(lora_rank: int = 256, rope_theta: Optional[float] = 10000.0,
                             context_dim: Optional[int] = None, backend: str = "local") -> ModuleSpec:
    """``ModuleSpec`` of ``VideoDiTLayer`` for Megatron's ``TransformerBlock``; ``backend``
    ``"local"`` (Megatron-core linears, parameter-free AdaLN norms) or ``"te"`` (TE linears and
    norms; building modules from it needs TransformerEngine)."""
    return full_attention_layer_spec(VideoDiTLayer, dict(lora_rank=lora_rank, rope_theta=rope_theta),
                                     context_dim, backend)


def full_attention_layer_spec(module, params: dict, context_dim: Optional[int],
                              backend: str = "local") -> ModuleSpec:
    """The submodules of a DiT layer whose self-attention is sequence-wide (2D attention core):
    norms, self-attention, cross-attention, MLP and AdaLN-LoRA modulation of ``backend``."""
    m = dit_backend_modules(backend)
    return ModuleSpec(
        module=module,
        params=params,
        submodules=DiTLayerSubmodules(
            input_layernorm=m["norm"],
            self_attention=dit_self_attention_spec(full_2d_attention(), backend),
            pre_cross_attn_layernorm=m["norm"],
            cross_attention=dit_cross_attention_spec(context_dim, backend),
            pre_mlp_layernorm=m["norm"],
            mlp=dit_mlp_spec(backend),
            modulation=AdaLNLoRAModulation),
    )


def layer_spec_for(config: VideoDiTConfig) -> ModuleSpec:
    """The layer spec selected by ``config.layer_type`` and ``config.layer_backend``."""
    check_layer_backend(config.layer_backend)
    if config.layer_type == "stdit":
        from megatron_video.models.stdit import get_stdit_layer_spec

        return get_stdit_layer_spec(config.stdit_variant, config.stdit_full_attention_layers,
                                    config.lora_rank, config.rope_theta, config.text_dim,
                                    backend=config.layer_backend)
    return get_video_dit_layer_spec(config.lora_rank, config.rope_theta, config.text_dim,
                                    backend=config.layer_backend)


def adaln_branch(x, mods, i: int, norm, f):
    """``x + gate_i * f(modulate(norm(x), shift_i, scale_i))`` with per-sample ``[b, D]`` chunks."""
    shift, scale, gate = mods[3 * i:3 * i + 3]
    return x + gated(f(modulate(norm(x), shift, scale)), gate)


class VideoDiTLayer(DiTLayerBase):
    """Full-attention DiT block: 2D self-attention, cross-attention, MLP, each AdaLN-gated.

    A Megatron ``TransformerLayer``: ``input_layernorm`` / ``self_attention`` (its
    ``core_attention`` the 2D attention), ``pre_cross_attn_layernorm`` / ``cross_attention``,
    ``pre_mlp_layernorm`` / ``mlp``, plus ``modulation`` (9 chunks).
    ``forward(hidden_states [s, b, D], context=[L, b, D_c], context_mask=[b, L], params=DiTParams)``
    -> ``([s, b, D], context)`` with ``params.conditioning [b, D]`` and ``params.geometry``.
    """

    sequence_parallel_reason = "its sequence is already split by context parallelism"

    def __init__(self, config: TransformerConfig, submodules: DiTLayerSubmodules,
                 layer_number: int = 1, lora_rank: int = 256,
                 rope_theta: Optional[float] = 10000.0, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        self._build_modulation(submodules.modulation, 9, lora_rank)
        self.rope_theta = rope_theta

    def _rope(self, s: int, geometry: VideoGeometry, device):
        if self.rope_theta is None:
            return None
        _, rank = self._cp()
        ids = torch.arange(rank * s, (rank + 1) * s)
        angles = rope_3d_angles(token_thw(ids, geometry), self.self_attention.head_dim,
                                self.rope_theta)
        return rope_embedding(angles).to(device)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                params: Optional[DiTParams] = None, rotary_pos_emb=None, attention_bias=None,
                packed_seq_params=None, **unused):
        """``hidden_states [s, b, D]`` (contiguous CP shard) -> ``([s, b, D], context)``."""
        params = self._check_params(params, "the AdaLN conditioning and the global token grid", dict(
            attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
            attention_bias=attention_bias, packed_seq_params=packed_seq_params))
        geometry = self._geometry(params, "the global token grid")
        conditioning = params.conditioning
        s, b, D = hidden_states.shape
        P, _ = self._cp()
        if s * P != geometry.tokens:
            raise ValueError(f"hidden_states sequence length ({s}) x cp_size ({P}) must equal the "
                             f"tokens of geometry {geometry} ({geometry.tokens})")
        if not isinstance(conditioning, torch.Tensor) or tuple(conditioning.shape) != (b, D):
            raise ValueError(f"params.conditioning must be [b, D] = [{b}, {D}], got "
                             f"{tuple(getattr(conditioning, 'shape', ())) or None}")
        if P > 1:
            shapes = {"hidden_states": hidden_states, "conditioning": conditioning}
            if context is not None:
                shapes["context"] = context
            check_same_shape(shapes, self.groups.cp_group, where="VideoDiTLayer")
        mods = self.modulation(conditioning)
        rope = self._rope(s, geometry, hidden_states.device)

        def attention(y):   # [b, s, D] in and out; the attention modules take Megatron's [s, b, D]
            out, _ = self.self_attention(y.transpose(0, 1), rotary_pos_emb=rope)
            return out.transpose(0, 1)

        x = hidden_states.transpose(0, 1)
        x = adaln_branch(x, mods, 0, self.input_layernorm, attention)
        if context is not None:
            ctx = context.transpose(0, 1)
            x = adaln_branch(x, mods, 1, self.pre_cross_attn_layernorm,
                             lambda y: self.cross_attention(y, ctx, context_mask))
        x = adaln_branch(x, mods, 2, self.pre_mlp_layernorm, self._mlp)
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
                                              config.text_max_len, seed=config.cond_seed,
                                              input_dim=config.text_input_dim)
        for name in replicated_embedders(self):
            mark_pipeline_replicated(getattr(self, name))
        if pre_process:
            self.patch_embed = PatchEmbed(config, config.patch_dim)
        self.decoder = VideoTransformerBlock(config, layer_spec or layer_spec_for(config),
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
        out = self.decoder(hidden, DiTParams(conditioning=c, geometry=geometry),
                           context=ctx.transpose(0, 1).contiguous(), context_mask=ctx_mask)
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
