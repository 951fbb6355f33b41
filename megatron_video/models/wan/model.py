"""The Wan 2.1 / 2.2 transformer (diffusers' ``WanTransformer3DModel``) as Megatron layers.

``WanConfig`` is Megatron's ``TransformerConfig`` plus diffusers' Wan config fields. ``WanModel``
is a ``MegatronModule``: patch embedding (the (pt, ph, pw) Conv3d as a linear over patch tokens),
the condition embedder (sinusoid + ``time_embedder`` + shared ``time_proj`` to 6 D, GELU-tanh text
projection, the I2V image embedder), a ``VideoTransformerBlock`` of ``WanLayer``s from a
``ModuleSpec`` (``wan_layer_specs``), the output norm with its 2-row table and ``proj_out``.
Tokens are split contiguously over the CP group (rank ``c`` holds ``[c*s, (c+1)*s)``); the
self-attention core is the 2D attention, cross-attention has no CP. Precision: where diffusers
computes in fp32 (modulation, norms, residual stream, output norm, timestep embedding) this
computes in max(fp32, dtype) (``island_dtype``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention.masks import AttentionMask
from megatron_video.layouts.geometry import VideoGeometry
from megatron_video.layouts.packed_video import PackedVideo
from megatron_video.layouts.placement import Placement
from megatron_video.models.dit_blocks import attend, linear_out, parallel_linear, tp_world_size
from megatron_video.models.dit_layer import DiTLayerBase, DiTParams, VideoTransformerBlock
from megatron_video.models.embedders import mark_pipeline_replicated
from megatron_video.models.packed import check_packed, packed_attention_mask, per_clip_to_tokens
from megatron_video.models.wan.rope import WanRope, apply_wan_rope
from megatron_video.parallel import comm

__all__ = [
    "WanConfig",
    "WanModel",
    "WanLayer",
    "WanSelfAttention",
    "WanCrossAttention",
    "WanQKNorm",
    "WanLayerNorm",
    "WanModulation",
    "island_dtype",
    "gelu_tanh",
    "wan_architecture",
    "IMAGE_CONTEXT_TEXT_TOKENS",
]

# diffusers' WanAttnProcessor: "512 is the context length of the text encoder, hardcoded for now";
# with the image branch the first L - 512 context tokens are the image's.
IMAGE_CONTEXT_TEXT_TOKENS = 512


def island_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where diffusers computes in fp32: max(fp32, dtype) (bf16 -> fp32, float64 stays float64)."""
    return torch.promote_types(torch.float32, dtype)


def wan_architecture() -> dict:
    """The ``TransformerConfig`` settings every Wan model has (biased linears, GELU-tanh FFN, no
    dropout), whichever config its sizes come from."""
    return dict(
        add_bias_linear=True,
        activation_func=gelu_tanh,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (diffusers' ``gelu-approximate`` / ``gelu_tanh``)."""
    return F.gelu(x, approximate="tanh")


@dataclass
class WanConfig(TransformerConfig):
    """``TransformerConfig`` plus the fields of diffusers' ``WanTransformer3DModel`` config.

    ``hidden_size`` = heads x ``kv_channels`` (diffusers' ``attention_head_dim``),
    ``ffn_hidden_size`` = ``ffn_dim``, ``layernorm_epsilon`` = ``eps``."""

    patch_size: Tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    cross_attn_norm: bool = True
    qk_norm: Optional[str] = "rms_norm_across_heads"
    image_dim: Optional[int] = None
    added_kv_proj_dim: Optional[int] = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: Optional[int] = None
    rope_theta: float = 10000.0
    layer_backend: str = "local"
    has_cond_embedder: bool = True  # embedders replicated on every pipeline stage

    def __post_init__(self):
        super().__post_init__()
        if len(tuple(self.patch_size)) != 3 or any(int(p) < 1 for p in self.patch_size):
            raise ValueError(f"patch_size ({self.patch_size!r}) must be three positive integers")
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if self.num_query_groups not in (None, self.num_attention_heads):
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must equal "
                f"num_attention_heads ({self.num_attention_heads}) for Wan"
            )
        if self.image_dim is None and self.pos_embed_seq_len is not None:
            raise ValueError(f"pos_embed_seq_len ({self.pos_embed_seq_len}) needs image_dim")

    @property
    def patch_dim(self) -> int:
        return self.in_channels * math.prod(self.patch_size)

    @property
    def out_patch_dim(self) -> int:
        return self.out_channels * math.prod(self.patch_size)


# ----------------------------------------------------------------------------------------------
# Norms and modulation
# ----------------------------------------------------------------------------------------------
class WanLayerNorm(torch.nn.Module):
    """diffusers' ``FP32LayerNorm`` in max(fp32, dtype), returned in that dtype (the caller
    casts); Megatron's norm-builder signature. ``elementwise_affine`` for ``norm2``."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: Optional[float] = None,
        elementwise_affine: bool = False,
        **kwargs,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.weight = self.bias = None
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cd = island_dtype(x.dtype)
        w = None if self.weight is None else self.weight.to(cd)
        b = None if self.bias is None else self.bias.to(cd)
        return F.layer_norm(x.to(cd), (self.hidden_size,), w, b, self.eps)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward and backward: every rank's output depends on every rank's input,
    and each rank's gradient of the sum is only its part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x.clone(), group, tag="wan.qk_norm")

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), ctx.group, tag="wan.qk_norm.bwd"), None


def _tp_sum_impl(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over the TP group (autograd both ways); identity on one rank."""
    if group is None or comm.group_size(group) == 1:
        return x
    return _SumOverGroup.apply(x, group)


tp_sum = _tp_sum_impl  # looked up at call time (a test replaces it to show the sum is needed)


def _tp_group(pg_collection):
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    return (
        tp
        if tp is not None
        else parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    )


class WanQKNorm(torch.nn.Module):
    """RMSNorm over the whole q / k width (``rms_norm_across_heads``), weight sharded over TP with
    the heads: the sum of squares is summed over the TP group (exact), the mean taken over the
    full width ``heads * head_dim``. Computed in max(fp32, dtype), returned in the input dtype."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        full_size: int,
        tp_group=None,
        eps: Optional[float] = None,
    ):
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.full_size, self.tp_group = full_size, tp_group
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, full_size != hidden_size, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cd = island_dtype(x.dtype)
        xf = x.to(cd)
        ss = tp_sum(xf.pow(2).sum(-1, keepdim=True), self.tp_group)
        return (xf * torch.rsqrt(ss / self.full_size + self.eps) * self.weight.to(cd)).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets
        )


class WanModulation(MegatronModule):
    """A block's learned ``scale_shift_table [1, 6, D]`` plus the shared ``time_proj`` output:
    ``temb [b, 6, D]`` (or per token ``[b, s, 6, D]``) -> six ``[b, 1|s, D]`` tensors (shift,
    scale, gate of self-attention; of the FFN) in max(fp32, dtype). Replicated over TP."""

    def __init__(self, config: TransformerConfig, **kwargs):
        super().__init__(config=config)
        D = config.hidden_size
        self.scale_shift_table = torch.nn.Parameter(
            torch.randn(1, 6, D, dtype=config.params_dtype) / D**0.5
        )

    def forward(self, temb: torch.Tensor):
        cd = island_dtype(torch.promote_types(temb.dtype, self.scale_shift_table.dtype))
        table = self.scale_shift_table.to(cd)
        if temb.dim() == 4:
            return (table[None] + temb.to(cd)).unbind(2)
        return (table + temb.to(cd)).chunk(6, dim=1)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------
@dataclass
class WanSelfAttentionSubmodules:
    """Megatron's self-attention slots: fused ``linear_qkv`` (per head ``[q_h; k_h; v_h]``),
    ``q_layernorm`` / ``k_layernorm`` (across heads), ``core_attention``, ``linear_proj``."""

    linear_qkv: object = None
    core_attention: object = None
    q_layernorm: object = WanQKNorm
    k_layernorm: object = WanQKNorm
    linear_proj: object = None


def _heads(config: TransformerConfig) -> Tuple[int, int]:
    H, tp = config.num_attention_heads, tp_world_size()
    if H % tp:
        raise ValueError(
            f"num_attention_heads ({H}) must be divisible by tensor_model_parallel_size ({tp})"
        )
    return H // tp, config.kv_channels


def _column(spec, n_in: int, n_out: int, config):
    return parallel_linear(spec, n_in, n_out, config, bias=True)


def _row(spec, n_in: int, n_out: int, config):
    return parallel_linear(spec, n_in, n_out, config, bias=True, row=True)


def _norm(spec, config, heads: int, hd: int, pg_collection):
    return build_module(
        spec,
        config=config,
        hidden_size=heads * hd,
        full_size=config.num_attention_heads * hd,
        tp_group=_tp_group(pg_collection),
    )


_linear = linear_out


class WanSelfAttention(MegatronModule):
    """Wan's ``attn1``: ``forward(x [b, s, D], cos, sin, mask=None) -> [b, s, D]``; q / k normed
    across heads, Wan's RoPE, ``core_attention`` with Megatron's core-attention interface (2D
    attention over the CP group; ``models.specs.with_2d_attention`` may swap it)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: WanSelfAttentionSubmodules,
        layer_number: int = 1,
        attn_mask_type=AttnMaskType.no_mask,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        self.heads, self.head_dim = _heads(config)
        inner = self.heads * self.head_dim
        H = config.num_attention_heads
        self.attn_mask_type = attn_mask_type
        self.linear_qkv = _column(
            submodules.linear_qkv, config.hidden_size, 3 * H * self.head_dim, config
        )
        self.q_layernorm = _norm(
            submodules.q_layernorm, config, self.heads, self.head_dim, pg_collection
        )
        self.k_layernorm = _norm(
            submodules.k_layernorm, config, self.heads, self.head_dim, pg_collection
        )
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.linear_proj = _row(
            submodules.linear_proj, H * self.head_dim, config.hidden_size, config
        )
        self.inner = inner

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None, placement=None
    ):
        """``placement`` (a packed micro-batch's) goes to the core attention when given."""
        b, s, _ = x.shape
        h, d = self.heads, self.head_dim
        mixed = _linear(self.linear_qkv, x).view(b, s, h, 3, d)
        q = self.q_layernorm(mixed[..., 0, :].reshape(b, s, h * d)).view(b, s, h, d)
        k = self.k_layernorm(mixed[..., 1, :].reshape(b, s, h * d)).view(b, s, h, d)
        v = mixed[..., 2, :]
        q, k = apply_wan_rope(q, cos, sin), apply_wan_rope(k, cos, sin)
        o = self.core_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1).contiguous(),
            mask,
            attn_mask_type=self.attn_mask_type,
            **({} if placement is None else {"placement": placement}),
        )  # [s, b, h*d]
        return _linear(self.linear_proj, o.transpose(0, 1))


@dataclass
class WanCrossAttentionSubmodules:
    """``linear_q``, fused ``linear_kv`` (per head ``[k_h; v_h]``), their norms, the I2V image
    branch (``linear_kv_img`` / ``k_img_layernorm``) and ``linear_proj``."""

    linear_q: object = None
    linear_kv: object = None
    q_layernorm: object = WanQKNorm
    k_layernorm: object = WanQKNorm
    linear_kv_img: object = None
    k_img_layernorm: object = WanQKNorm
    linear_proj: object = None


class WanCrossAttention(MegatronModule):
    """Wan's ``attn2``: video queries attend to the whole context, no context parallelism. With
    ``config.added_kv_proj_dim`` the first ``L - 512`` context tokens are the image's (own k / v
    projections and k norm, attended separately and added), as diffusers' ``WanAttnProcessor``."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: WanCrossAttentionSubmodules,
        layer_number: int = 1,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        self.heads, self.head_dim = _heads(config)
        H, hd, D = config.num_attention_heads, self.head_dim, config.hidden_size
        self.linear_q = _column(submodules.linear_q, D, H * hd, config)
        self.linear_kv = _column(submodules.linear_kv, D, 2 * H * hd, config)
        self.q_layernorm = _norm(submodules.q_layernorm, config, self.heads, hd, pg_collection)
        self.k_layernorm = _norm(submodules.k_layernorm, config, self.heads, hd, pg_collection)
        self.image_branch = getattr(config, "added_kv_proj_dim", None) is not None
        if self.image_branch:
            self.linear_kv_img = _column(
                submodules.linear_kv_img, config.added_kv_proj_dim, 2 * H * hd, config
            )
            self.k_img_layernorm = _norm(
                submodules.k_img_layernorm, config, self.heads, hd, pg_collection
            )
        self.linear_proj = _row(submodules.linear_proj, H * hd, D, config)

    def _kv(self, linear, norm, ctx):
        b, L, _ = ctx.shape
        h, d = self.heads, self.head_dim
        kv = _linear(linear, ctx).view(b, L, h, 2, d)
        return norm(kv[..., 0, :].reshape(b, L, h * d)).view(b, L, h, d), kv[..., 1, :]

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask=None) -> torch.Tensor:
        """``mask`` (optional): bool ``[b|1, 1, s, L]`` query x context mask (a packed
        micro-batch: each clip attends its own text); not with the I2V image branch."""
        b, s, _ = x.shape
        h, d = self.heads, self.head_dim
        if context.shape[0] != b:
            raise ValueError(f"context batch ({context.shape[0]}) must equal the video batch ({b})")
        if mask is not None and self.image_branch:
            raise ValueError(
                "mask (a packed micro-batch's per-clip text mask) is not supported with the I2V "
                "image branch (added_kv_proj_dim)"
            )
        q = self.q_layernorm(_linear(self.linear_q, x)).view(b, s, h, d)
        if self.image_branch:
            n = context.shape[1] - IMAGE_CONTEXT_TEXT_TOKENS
            if n <= 0:
                raise ValueError(
                    f"context length ({context.shape[1]}) must exceed "
                    f"{IMAGE_CONTEXT_TEXT_TOKENS}: with added_kv_proj_dim the first "
                    f"L - {IMAGE_CONTEXT_TEXT_TOKENS} tokens are the image's "
                    f"(diffusers' Wan I2V)"
                )
            img, context = context[:, :n], context[:, n:]
        k, v = self._kv(self.linear_kv, self.k_layernorm, context)
        o = attend(q, k, v, mask)
        if self.image_branch:
            k_img, v_img = self._kv(self.linear_kv_img, self.k_img_layernorm, img)
            o = o + attend(q, k_img, v_img)
        return _linear(self.linear_proj, o.reshape(b, s, h * d))


# ----------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------
class WanLayer(DiTLayerBase):
    """diffusers' ``WanTransformerBlock`` as a Megatron ``TransformerLayer``: ``input_layernorm``
    (norm1) / ``self_attention`` (attn1), ``pre_cross_attn_layernorm`` (norm2) /
    ``cross_attention`` (attn2), ``pre_mlp_layernorm`` (norm3) / ``mlp`` (ffn), ``modulation``
    (the block's ``scale_shift_table``). ``forward(hidden_states [s, b, D], context=[L, b, D],
    params=DiTParams)`` with ``params.conditioning`` the ``time_proj`` output ``[b, 6, D]`` (or
    ``[b, s, 6, D]`` per token), ``params.rotary_pos_emb`` this rank's RoPE rows ``[2, s, hd]``
    (cos, sin) and ``params.attention_mask`` (None: full attention)."""

    sequence_parallel_reason = "its sequence is already split by context parallelism"
    params_what = "Wan's time_proj output and RoPE rows"
    context_mask_unused = True

    def __init__(self, config: TransformerConfig, submodules, layer_number: int = 1, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        self.modulation = build_module(submodules.modulation, config=config)

    def _check(self, hidden_states, context, params):
        s, b, D = hidden_states.shape
        cond, rope = params.conditioning, params.rotary_pos_emb
        want = [(b, 6, D), (b, s, 6, D)]
        if not isinstance(cond, torch.Tensor) or tuple(cond.shape) not in want:
            raise ValueError(
                f"params.conditioning ({tuple(getattr(cond, 'shape', ())) or None}) "
                f"must be the time_proj output {want[0]} or per token {want[1]}"
            )
        if not isinstance(rope, torch.Tensor) or tuple(rope.shape)[:2] != (2, s):
            raise ValueError(
                f"params.rotary_pos_emb ({tuple(getattr(rope, 'shape', ())) or None})"
                f" must be Wan's RoPE rows [2, s = {s}, head_dim]"
            )
        if context is None:
            raise ValueError("context (the embedded text [L, b, D]) must be given to WanLayer")

    def _forward(self, hidden_states, context, context_mask, params: DiTParams):
        self._check(hidden_states, context, params)
        text_mask, extra = None, {}
        if params.packed is not None:  # per-clip text, placement to the core attention
            kind = params.packed.kinds[0]
            _, clip = self._packed_tokens(params, hidden_states, kind)
            text_mask = self._packed_text_mask(params, clip, context, None)
            extra = dict(placement=params.placement)
        self._check_same_shapes(params.packed, hidden_states=hidden_states, context=context)
        shift, scale, gate, c_shift, c_scale, c_gate = self.modulation(params.conditioning)
        cos, sin = params.rotary_pos_emb.unbind(0)
        x = hidden_states.transpose(0, 1)  # [b, s, D]
        dt, cd = x.dtype, island_dtype(x.dtype)
        y = (self.input_layernorm(x.to(cd)) * (1 + scale) + shift).to(dt)
        a = self.self_attention(y, cos, sin, params.attention_mask, **extra)
        x = (x.to(cd) + a * gate).to(dt)
        y = self.pre_cross_attn_layernorm(x.to(cd)).to(dt)
        x = x + self.cross_attention(y, context.transpose(0, 1), text_mask)
        y = (self.pre_mlp_layernorm(x.to(cd)) * (1 + c_scale) + c_shift).to(dt)
        x = (x.to(cd) + self._mlp(y).to(cd) * c_gate).to(dt)
        return x.transpose(0, 1).contiguous(), context


# ----------------------------------------------------------------------------------------------
# Embedders and the model
# ----------------------------------------------------------------------------------------------
def _linear_module(n_in: int, n_out: int, config) -> torch.nn.Linear:
    return torch.nn.Linear(n_in, n_out, dtype=config.params_dtype)


def _island_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` with the weights cast to ``x.dtype`` (the fp32 islands)."""
    return F.linear(x, layer.weight.to(x.dtype), layer.bias.to(x.dtype))


def timestep_sinusoid(t: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' ``get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)``
    (``[cos, sin]``) in ``dtype`` instead of fp32."""
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=dtype, device=t.device) / half
    emb = t.to(dtype)[:, None] * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.cos(emb), torch.sin(emb)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


class WanTimeEmbedder(torch.nn.Module):
    """``time_embedder``: sinusoid -> ``linear_1`` -> SiLU -> ``linear_2`` in max(fp32, dtype)."""

    def __init__(self, config: WanConfig):
        super().__init__()
        self.freq_dim = config.freq_dim
        self.linear_1 = _linear_module(config.freq_dim, config.hidden_size, config)
        self.linear_2 = _linear_module(config.hidden_size, config.hidden_size, config)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        cd = island_dtype(self.linear_1.weight.dtype)
        e = timestep_sinusoid(t, self.freq_dim, cd)
        return _island_linear(self.linear_2, F.silu(_island_linear(self.linear_1, e)))


class WanMLPEmbedder(torch.nn.Module):
    """``linear_1`` -> activation -> ``linear_2`` (the text projection: GELU-tanh)."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, config, activation=gelu_tanh):
        super().__init__()
        self.linear_1 = _linear_module(n_in, n_hidden, config)
        self.linear_2 = _linear_module(n_hidden, n_out, config)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.activation(self.linear_1(x)))


class WanImageEmbedder(torch.nn.Module):
    """``image_embedder`` (I2V): [``pos_embed``], ``norm1``, exact-GELU MLP, ``norm2`` (norms
    in max(fp32, dtype), diffusers' ``FP32LayerNorm`` with affine parameters)."""

    def __init__(self, config: WanConfig):
        super().__init__()
        E, D = config.image_dim, config.hidden_size
        self.norm1 = WanLayerNorm(config, E, eps=1e-5, elementwise_affine=True)
        self.ff = WanMLPEmbedder(E, E, D, config, activation=F.gelu)
        self.norm2 = WanLayerNorm(config, D, eps=1e-5, elementwise_affine=True)
        self.pos_embed = None
        if config.pos_embed_seq_len is not None:
            self.pos_embed = torch.nn.Parameter(
                torch.zeros(1, config.pos_embed_seq_len, E, dtype=config.params_dtype)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            b, n, e = x.shape
            x = x.view(-1, 2 * n, e) + self.pos_embed
        y = self.ff(self.norm1(x).to(x.dtype))
        return self.norm2(y).to(y.dtype)


class WanConditionEmbedder(torch.nn.Module):
    """diffusers' ``condition_embedder``: ``(timestep, text, image) -> (temb, timestep_proj,
    context)`` with ``timestep_proj [b, 6, D]`` (or ``[b, s, 6, D]`` for ``timestep [b, s]``)
    and ``context`` the embedded image tokens (if any) followed by the embedded text."""

    def __init__(self, config: WanConfig):
        super().__init__()
        D = config.hidden_size
        self.time_embedder = WanTimeEmbedder(config)
        self.time_proj = _linear_module(D, 6 * D, config)
        self.text_embedder = WanMLPEmbedder(config.text_dim, D, D, config)
        self.image_embedder = WanImageEmbedder(config) if config.image_dim is not None else None

    def forward(self, timestep, text, image=None):
        per_token = timestep.dim() == 2
        temb = self.time_embedder(timestep.flatten())
        if per_token:
            temb = temb.unflatten(0, tuple(timestep.shape))
        temb = temb.to(text.dtype)
        proj = self.time_proj(F.silu(temb))
        proj = proj.unflatten(-1, (6, -1))
        context = self.text_embedder(text)
        if image is not None:
            if self.image_embedder is None:
                raise ValueError(
                    "encoder_hidden_states_image was given but the model has no "
                    "image embedder (config image_dim is None)"
                )
            context = torch.cat([self.image_embedder(image), context], dim=1)
        return temb, proj, context


class WanOutputHead(torch.nn.Module):
    """``norm_out`` (no affine) modulated by ``scale_shift_table [1, 2, D]`` + ``temb``, then
    ``proj_out`` to ``out_channels * pt * ph * pw`` (channel order (pt, ph, pw, C), diffusers')."""

    def __init__(self, config: WanConfig):
        super().__init__()
        D = config.hidden_size
        self.norm_out = WanLayerNorm(config, D, eps=config.layernorm_epsilon)
        self.proj_out = _linear_module(D, config.out_patch_dim, config)
        self.scale_shift_table = torch.nn.Parameter(
            torch.randn(1, 2, D, dtype=config.params_dtype) / D**0.5
        )

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        cd = island_dtype(torch.promote_types(x.dtype, temb.dtype))
        table, temb = self.scale_shift_table.to(cd), temb.to(cd)
        if temb.dim() == 3:  # per token: [b, s, D]
            shift, scale = (table[None] + temb[:, :, None]).unbind(2)
        else:
            shift, scale = (table + temb[:, None]).chunk(2, dim=1)
        y = self.norm_out(x.to(cd)) * (1 + scale) + shift
        return self.proj_out(y.to(x.dtype))


def wan_unpatchify(tokens: torch.Tensor, grid, patch, channels: int) -> torch.Tensor:
    """``[B, T'*H'*W', pt*ph*pw*C]`` (diffusers' ``proj_out`` order) -> ``[B, C, T, H, W]``."""
    (t, h, w), (pt, ph, pw) = grid, patch
    x = tokens.reshape(tokens.shape[0], t, h, w, pt, ph, pw, channels)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)


class WanModel(MegatronModule):
    """diffusers' ``WanTransformer3DModel`` on Megatron; see the module docstring.

    ``forward(tokens, timestep, text, geometry, image=None, attention_mask=None,
    positions=None)``: ``tokens [b, s_local, C*pt*ph*pw]`` this CP rank's patch tokens
    (``embedders.patchify`` order; first stage), ``timestep [b]`` or per token ``[b, s_local]``,
    ``text [b, L, text_dim]``, ``image [b, L_img, image_dim]`` (I2V), ``geometry`` the global
    token grid; ``positions [s_local]`` the tokens' ids in ``geometry`` for RoPE (default: the
    contiguous CP split; the teacher-forcing layout passes its own, both halves sharing them) and
    ``attention_mask`` the 2D attention's mask (teacher forcing). Returns
    ``[b, s_local, pt*ph*pw*C_out]`` on the last stage (hidden states ``[s_local, b, D]`` on the
    others).

    A packed micro-batch (docs/architecture.md, "Packed micro-batches in the models"):
    ``geometry`` a ``PackedVideo`` (full clips: T2V; teacher-forcing clips: ``wan_ar``),
    ``tokens [1, s_local, ...]`` at the ids ``placement.rank_ids(cp_rank)`` (``placement`` None
    only at CP = 1), ``timestep [C]`` per clip or ``[1, s_local]`` per token, ``text [C, L,
    text_dim]`` per clip; ``positions`` and ``image`` must be None; ``attention_mask`` None (the
    clips' mask) or an override.
    """

    def __init__(
        self,
        config: WanConfig,
        pre_process: bool = True,
        post_process: bool = True,
        layer_spec: Optional[ModuleSpec] = None,
        vp_stage: Optional[int] = None,
    ):
        if layer_spec is None:  # as GPTModel: the spec is given (models/wan/wan_layer_specs.py)
            raise ValueError(
                "layer_spec (None) must be given: a Wan layer ModuleSpec, e.g. "
                "megatron_video.models.wan.get_wan_layer_spec(config)"
            )
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.pre_process, self.post_process = pre_process, post_process
        self.rope = WanRope(config.kv_channels, config.rope_max_seq_len, config.rope_theta)
        self.condition_embedder = WanConditionEmbedder(config)
        mark_pipeline_replicated(self.condition_embedder)
        if pre_process:
            self.patch_embedding = _linear_module(config.patch_dim, config.hidden_size, config)
        spec = layer_spec
        self.decoder = VideoTransformerBlock(
            config, spec, pre_process=pre_process, post_process=False, vp_stage=vp_stage
        )
        if post_process:
            self.head = WanOutputHead(config)

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def cp(self) -> Tuple[int, int]:
        """``(cp_size, cp_rank)`` of the layers (resolved by their one rule)."""
        return self.decoder.layers[0]._cp()

    def _check(self, s: int, timestep, text, geometry, positions):
        P, _ = self.cp()
        if positions is not None:
            if not isinstance(geometry, VideoGeometry) or tuple(positions.shape) != (s,):
                raise ValueError(
                    f"positions ({tuple(positions.shape)}) must be [s_local = {s}] global "
                    f"token ids of geometry ({geometry})"
                )
        elif not isinstance(geometry, VideoGeometry) or s * P != geometry.tokens:
            raise ValueError(
                f"tokens per rank ({s}) x cp_size ({P}) must equal the tokens of "
                f"geometry ({geometry})"
            )
        if timestep.dim() not in (1, 2) or (timestep.dim() == 2 and timestep.shape[1] != s):
            raise ValueError(
                f"timestep ({tuple(timestep.shape)}) must be [b] or per token [b, s_local = {s}]"
            )
        if text.dim() != 3 or text.shape[-1] != self.config.text_dim:
            raise ValueError(
                f"text ({tuple(text.shape)}) must be [b, L, text_dim = {self.config.text_dim}]"
            )

    def forward(
        self,
        tokens: Optional[torch.Tensor],
        timestep: torch.Tensor,
        text: torch.Tensor,
        geometry: VideoGeometry,
        image: Optional[torch.Tensor] = None,
        attention_mask=None,
        positions: Optional[torch.Tensor] = None,
        placement: Optional[Placement] = None,
    ) -> torch.Tensor:
        if isinstance(geometry, PackedVideo):
            return self._forward_packed(
                tokens, timestep, text, geometry, image, attention_mask, positions, placement
            )
        if placement is not None:
            raise ValueError(
                f"placement ({placement!r}) must be None unless geometry is a PackedVideo"
            )
        s = tokens.shape[1] if self.pre_process else self.decoder.input_tensor.shape[0]
        self._check(s, timestep, text, geometry, positions)
        _, rank = self.cp()
        if positions is None:  # the contiguous CP split
            positions = torch.arange(rank * s, (rank + 1) * s)
        cos, sin = self.rope(positions, geometry)
        temb, proj, context = self.condition_embedder(timestep, text, image)
        hidden = None
        if self.pre_process:
            if tokens.dim() != 3 or tokens.shape[-1] != self.config.patch_dim:
                raise ValueError(
                    f"tokens ({tuple(tokens.shape)}) must be [b, s_local, "
                    f"patch_dim = {self.config.patch_dim}]"
                )
            hidden = self.patch_embedding(tokens).transpose(0, 1).contiguous()
        params = DiTParams(
            conditioning=proj,
            geometry=geometry,
            attention_mask=attention_mask,
            rotary_pos_emb=torch.stack([cos, sin]).to(text.device),
        )
        out = self.decoder(hidden, params, context=context.transpose(0, 1).contiguous())
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.head(out.transpose(0, 1), temb)

    def _check_packed(self, tokens, timestep, text, packed, image, mask, positions, placement):
        """This CP rank's global ids and their clips, after the packed input checks."""
        if image is not None or positions is not None:
            raise ValueError(
                "image and positions must be None for a packed micro-batch (geometry "
                "PackedVideo): I2V is not packed; positions come from each token's clip"
            )
        if mask is not None and not isinstance(mask, AttentionMask):
            raise ValueError(
                f"attention_mask ({type(mask).__name__}) must be None (the clips' mask) or a "
                f"megatron_video AttentionMask for a packed micro-batch"
            )
        n = packed.num_clips
        if text.dim() != 3 or text.shape[0] != n or text.shape[-1] != self.config.text_dim:
            raise ValueError(
                f"text ({tuple(text.shape)}) must be [num_clips = {n}, L, text_dim = "
                f"{self.config.text_dim}] for a packed micro-batch"
            )
        if self.pre_process and (tokens.dim() != 3 or tokens.shape[-1] != self.config.patch_dim):
            raise ValueError(
                f"tokens ({tuple(tokens.shape)}) must be [1, s_local, patch_dim = "
                f"{self.config.patch_dim}]"
            )
        s = tokens.shape[1] if self.pre_process else self.decoder.input_tensor.shape[0]
        b = tokens.shape[0] if self.pre_process else self.decoder.input_tensor.shape[1]
        kind = packed.kinds[0] if isinstance(packed, PackedVideo) else None
        ids = check_packed(packed, kind, "WanModel", placement, self.cp(), s, b)
        if tuple(timestep.shape) not in ((n,), (1, s)):
            raise ValueError(
                f"timestep ({tuple(timestep.shape)}) must be [num_clips = {n}] per clip or "
                f"[1, s_local = {s}] per token for a packed micro-batch"
            )
        return ids, packed.clip_of(ids)

    def _forward_packed(self, tokens, timestep, text, packed, image, mask, positions, placement):
        """``forward`` on a packed micro-batch (class docstring)."""
        ids, clip = self._check_packed(
            tokens, timestep, text, packed, image, mask, positions, placement
        )
        cos, sin = self.rope(ids, packed)
        temb, proj, context = self.condition_embedder(timestep, text)
        if timestep.dim() == 1:  # per clip -> per token (padding: zeros)
            clip = clip.to(temb.device)
            temb, proj = per_clip_to_tokens(temb, clip)[None], per_clip_to_tokens(proj, clip)[None]
        hidden = None
        if self.pre_process:
            hidden = self.patch_embedding(tokens).transpose(0, 1).contiguous()
        params = DiTParams(
            conditioning=proj,
            attention_mask=packed_attention_mask(packed) if mask is None else mask,
            rotary_pos_emb=torch.stack([cos, sin]).to(text.device),
            packed=packed,
            placement=placement,
        )
        C, L, D = context.shape
        out = self.decoder(hidden, params, context=context.reshape(C * L, 1, D).contiguous())
        if isinstance(out, tuple):
            out = out[0]
        if not self.post_process:
            return out
        return self.head(out.transpose(0, 1), temb)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        from megatron_video.models.video_dit import mark_pp_replicas

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return mark_pp_replicas(sd, [f"{prefix}condition_embedder."])
