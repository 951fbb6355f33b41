"""The Wan transformer layer as Megatron modules: norms (``WanLayerNorm``, the TP-exact
``WanQKNorm``), the block's modulation, self-attention (2D attention core, CP) and cross-attention
(no CP), and ``WanLayer`` built from a ``ModuleSpec`` (``wan_layer_specs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention.kv_cache import text_kv
from megatron_video.models.dit_blocks import attend, linear_out, parallel_linear, tp_world_size
from megatron_video.models.dit_layer import DiTLayerBase, DiTParams
from megatron_video.models.wan.config import IMAGE_CONTEXT_TEXT_TOKENS, island_dtype
from megatron_video.models.wan.rope import apply_wan_rope
from megatron_video.parallel import comm

__all__ = [
    "WanLayer",
    "WanSelfAttention",
    "WanCrossAttention",
    "WanQKNorm",
    "WanLayerNorm",
    "WanModulation",
    "WanSelfAttentionSubmodules",
    "WanCrossAttentionSubmodules",
]


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

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask=None, step=None):
        """``mask`` (optional): bool ``[b|1, 1, s, L]`` query x context mask (a packed
        micro-batch: each clip attends its own text); not with the I2V image branch. ``step``:
        the layer's attention mask; a ``CacheStep`` (generation) memoises the context's keys /
        values per prompt (``attention.kv_cache.text_kv``)."""
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
        k, v = text_kv(step, self, context, partial(self._kv, self.linear_kv, self.k_layernorm))
        o = attend(q, k, v, mask)
        if self.image_branch:
            project = partial(self._kv, self.linear_kv_img, self.k_img_layernorm)
            k_img, v_img = text_kv(step, (self, "image"), img, project)
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
        x = x + self.cross_attention(y, context.transpose(0, 1), text_mask, params.attention_mask)
        y = (self.pre_mlp_layernorm(x.to(cd)) * (1 + c_scale) + c_shift).to(dt)
        x = (x.to(cd) + self._mlp(y).to(cd) * c_gate).to(dt)
        return x.transpose(0, 1).contiguous(), context
