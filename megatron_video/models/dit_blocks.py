"""Parallel-friendly DiT building blocks shared by the ST-DiT, VideoDiT and causal AR DiT layers:
timestep embedding, AdaLN-LoRA modulation, per-head QK RMSNorm, the self- / cross-attention
modules with Megatron's slots, 3D RoPE. Design: docs/architecture.md, "Megatron integration".
"""

from __future__ import annotations

# * ``TimestepEmbedder``: sinusoidal features + MLP (replicated; recomputed on every pipeline
#   stage).
# * ``AdaLNLoRAModulation``: ``D -> r -> k*D`` shift/scale/gate chunks with a zero-initialised
#   output, so every gated residual branch is zero and the block starts as the identity
#   (AdaLN-zero).
# * ``HeadRMSNorm``: per-head QK RMSNorm over the head dimension. It acts on this rank's heads only,
#   so it needs no tensor-parallel communication; its modules are named ``q_layernorm`` /
#   ``k_layernorm`` so Megatron's ``finalize_model_grads`` sums their gradients over TP ranks when
#   ``config.qk_layernorm`` is set.
# * ``AdaLNNorm``: LayerNorm without affine parameters, the norm slots of the local layer specs.
# * ``DiTSelfAttention``: Megatron's self-attention slots (``linear_qkv``, ``q_layernorm`` /
#   ``k_layernorm``, ``core_attention``, ``linear_proj``) in Megatron's ``[s, b, D]`` convention;
#   the attention pattern is its ``core_attention`` (2D context-parallel, local, ...).
#   ``DiTCrossAttention``: video queries attend to the whole text without context parallelism.
#   Linear layers from the spec (Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` or
#   TE's).
# * 3D RoPE from global ``(t, h, w)`` token positions, so every layout rotates a token the same way.
#
# Masks are boolean with ``True`` = may attend.
import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_video.attention import local_attention
from megatron_video.attention.kv_cache import text_kv
from megatron_video.attention.megatron import DistAttention2D

__all__ = [
    "timestep_embedding",
    "AdaLNNorm",
    "rope_embedding",
    "TimestepEmbedder",
    "AdaLNLoRAModulation",
    "modulate",
    "gated",
    "HeadRMSNorm",
    "rope_3d_split",
    "rope_3d_angles",
    "apply_rope",
    "attend",
    "DiTAttentionSubmodules",
    "DiTSelfAttention",
    "DiTCrossAttentionSubmodules",
    "DiTCrossAttention",
    "tp_world_size",
]


def tp_world_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


# ----------------------------------------------------------------------------------------------
# Conditioning
# ----------------------------------------------------------------------------------------------
def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features ``[b, dim]`` of (possibly fractional) timesteps ``t`` ``[b]``."""
    if dim < 2:
        raise ValueError(f"dim ({dim}) must be >= 2")
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float64) / half)
    args = t.to(torch.float64)[:, None] * freqs.to(t.device)[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb.to(t.dtype if t.is_floating_point() else torch.get_default_dtype())


class TimestepEmbedder(MegatronModule):
    """``t [b] -> [b, D]``: sinusoidal features then Linear-SiLU-Linear (replicated over TP)."""

    def __init__(self, config: TransformerConfig, frequency_dim: int = 256):
        super().__init__(config=config)
        self.frequency_dim = frequency_dim
        D = config.hidden_size
        self.linear_1 = torch.nn.Linear(frequency_dim, D, dtype=config.params_dtype)
        self.linear_2 = torch.nn.Linear(D, D, dtype=config.params_dtype)
        for lin in (self.linear_1, self.linear_2):
            config.init_method(lin.weight)
            torch.nn.init.zeros_(lin.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        e = timestep_embedding(t, self.frequency_dim).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(e)))


class AdaLNLoRAModulation(MegatronModule):
    """AdaLN-LoRA: ``c [b, D] -> SiLU -> D->r -> r->num_chunks*D`` split into ``num_chunks`` tensors.

    The output projection is zero-initialised: all shifts, scales and gates start at zero, so
    ``x + gate * f(x)`` is the identity at initialisation (AdaLN-zero). The low rank ``r`` replaces
    the ``D x 9D`` AdaLN matrix that dominates a DiT's parameters. Replicated over TP ranks: its
    input and every consumer of its output are identical across them, and so are its gradients.
    """

    def __init__(self, config: TransformerConfig, num_chunks: int = 9, lora_rank: int = 256):
        super().__init__(config=config)
        if num_chunks < 1:
            raise ValueError(f"num_chunks ({num_chunks}) must be >= 1")
        if lora_rank < 1:
            raise ValueError(f"lora_rank ({lora_rank}) must be >= 1")
        D = config.hidden_size
        self.num_chunks = num_chunks
        self.linear_down = torch.nn.Linear(D, lora_rank, bias=False, dtype=config.params_dtype)
        self.linear_up = torch.nn.Linear(
            lora_rank, num_chunks * D, bias=True, dtype=config.params_dtype
        )
        config.init_method(self.linear_down.weight)
        torch.nn.init.zeros_(self.linear_up.weight)
        torch.nn.init.zeros_(self.linear_up.bias)

    def forward(self, c: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return self.linear_up(self.linear_down(F.silu(c))).chunk(self.num_chunks, dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 + scale) + shift`` with per-sample ``[b, D]`` parameters broadcast over tokens."""
    view = (shift.shape[0],) + (1,) * (x.dim() - 2) + (shift.shape[-1],)
    return x * (1 + scale.reshape(view)) + shift.reshape(view)


def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * gate`` with a per-sample ``[b, D]`` gate broadcast over tokens."""
    return x * gate.reshape((gate.shape[0],) + (1,) * (x.dim() - 2) + (gate.shape[-1],))


class HeadRMSNorm(torch.nn.Module):
    """RMSNorm over the last (head) dimension with one weight shared by all heads."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: Optional[float] = None):
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight.to(x.dtype)


class AdaLNNorm(torch.nn.Module):
    """LayerNorm without affine parameters (AdaLN supplies the scale and shift): the norm slots
    (``input_layernorm``, ...) of the local DiT layer specs. Megatron's norm-builder signature."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: Optional[float] = None, **kwargs
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = config.layernorm_epsilon if eps is None else eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), eps=self.eps)


# ----------------------------------------------------------------------------------------------
# 3D RoPE from global token positions
# ----------------------------------------------------------------------------------------------
def rope_3d_split(head_dim: int) -> Tuple[int, int, int]:
    """Channels given to the (t, h, w) axes: ``h`` and ``w`` get ``2*floor(d/6)`` each, ``t`` the rest."""
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim ({head_dim}) must be even and >= 6 for 3D RoPE")
    dhw = 2 * (head_dim // 6)
    return head_dim - 2 * dhw, dhw, dhw


def rope_3d_angles(thw: torch.Tensor, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotation angles ``[..., head_dim/2]`` (float64) for tokens at positions ``thw [..., 3]``."""
    parts = []
    for axis, d in enumerate(rope_3d_split(head_dim)):
        inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        parts.append(thw[..., axis : axis + 1].to(torch.float64) * inv)
    return torch.cat(parts, dim=-1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, s, h, d]`` by ``angles [s, d/2]`` (or ``[b, s, d/2]``); pairs ``(i, i+d/2)``."""
    cos = torch.cos(angles).to(x.dtype).unsqueeze(-2)
    sin = torch.sin(angles).to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ----------------------------------------------------------------------------------------------
# Local attention (the short-sequence patterns: spatial, temporal, cross)
# ----------------------------------------------------------------------------------------------
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Softmax attention on one rank: q ``[b, s, h, d]``, k/v ``[b, s_kv, h_kv, d]`` -> ``[b, s, h, d]``.

    ``mask``: bool, True = may attend, ``[s, s_kv]`` or ``[b|1, h|1, s, s_kv]``; rows that see no
    key give zeros. Runs the project's local kernel (backend chosen per device and dtype).
    """
    return local_attention(q, k, v, mask, softmax_scale)[0]


def _heads(config: TransformerConfig) -> Tuple[int, int, int]:
    """(query heads, key/value heads, head dim) with TP divisibility checked."""
    H = config.num_attention_heads
    Hkv = config.num_query_groups or H
    tp = tp_world_size()
    if H % Hkv:
        raise ValueError(f"num_attention_heads ({H}) must be divisible by num_query_groups ({Hkv})")
    if Hkv % tp:
        raise ValueError(
            f"num_query_groups ({Hkv}) must be divisible by tensor_model_parallel_size ({tp})"
        )
    if tp > 1 and not config.qk_layernorm:
        # Megatron's finalize_model_grads sums the per-head norm weights' TP partials only then
        raise ValueError(
            f"config.qk_layernorm ({config.qk_layernorm}) must be True when "
            f"tensor_model_parallel_size ({tp}) > 1 (QK-norm gradients are summed over TP)"
        )
    return H, Hkv, config.kv_channels


# ----------------------------------------------------------------------------------------------
# Attention projections
# ----------------------------------------------------------------------------------------------
def parallel_linear(
    spec, n_in: int, n_out: int, config: TransformerConfig, *, bias: bool, row=False
):
    """Megatron's column-parallel linear ``n_in -> n_out`` from ``spec`` (output split over TP, the
    ``init_method``), or with ``row`` the row-parallel one (input split, all-reduced output, the
    ``output_layer_init_method``); the bias is added inside (``linear_out`` returns it added)."""
    if row:
        side = dict(init_method=config.output_layer_init_method, input_is_parallel=True)
    else:
        side = dict(init_method=config.init_method, gather_output=False)
    return build_module(
        spec, n_in, n_out, config=config, bias=bias, skip_bias_add=False, is_expert=False, **side
    )


def linear_out(layer, x: torch.Tensor) -> torch.Tensor:
    """A Megatron linear layer's output on ``x`` with its returned bias (if any) added."""
    out, bias = layer(x)
    return out if bias is None else out + bias


def _head_norms_and_projection(module, submodules, config: TransformerConfig, heads: int, hd: int):
    """``module``'s per-head ``q_layernorm`` / ``k_layernorm`` and its row-parallel
    ``linear_proj`` (``heads * hd -> hidden_size``), as Megatron's attention builds them."""
    module.q_layernorm = build_module(submodules.q_layernorm, config=config, hidden_size=hd)
    module.k_layernorm = build_module(submodules.k_layernorm, config=config, hidden_size=hd)
    module.linear_proj = parallel_linear(
        submodules.linear_proj,
        heads * hd,
        config.hidden_size,
        config,
        bias=config.add_bias_linear,
        row=True,
    )


@dataclass
class DiTAttentionSubmodules:
    """Submodules of ``DiTSelfAttention`` (the slots of Megatron's ``SelfAttentionSubmodules``)."""

    linear_qkv: Union[ModuleSpec, type] = ColumnParallelLinear
    core_attention: Union[ModuleSpec, type] = None  # default: DistAttention2D (contiguous)
    q_layernorm: Union[ModuleSpec, type] = HeadRMSNorm
    k_layernorm: Union[ModuleSpec, type] = HeadRMSNorm
    linear_proj: Union[ModuleSpec, type] = RowParallelLinear


def rope_embedding(angles: torch.Tensor) -> torch.Tensor:
    """3D RoPE angles ``[s, d/2]`` (or ``[s, b, d/2]``) as Megatron's ``rotary_pos_emb``
    ``[s, 1|b, 1, d]``: its rotate-half convention pairs channels ``(i, i + d/2)`` like ``apply_rope``."""
    emb = torch.cat([angles, angles], dim=-1)
    return emb[:, None, None, :] if emb.dim() == 2 else emb[:, :, None, :]


class DiTSelfAttention(MegatronModule):
    """Self-attention of the DiT layers with Megatron's slots: ``linear_qkv``, per-head
    ``q_layernorm`` / ``k_layernorm``, 3D RoPE, a ``core_attention`` and ``linear_proj``.

    ``forward(hidden_states [s, b, D], attention_mask=None, rotary_pos_emb=None)`` -> ``(out,
    bias)`` like Megatron's ``SelfAttention``; the core attention has Megatron's core-attention
    interface (``DistAttention2D`` for sequence-wide attention over the CP group,
    ``LocalDotProductAttention`` for short local sequences), receives Megatron's ``cp_comm_type``
    and ``pg_collection``, and may be swapped by ``models.specs.with_2d_attention``. The fused QKV
    weight uses Megatron's per-query-group layout ``[q_heads_of_group, k, v]`` so TP shards hold
    whole groups and checkpoints match Megatron's ``SelfAttention``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: DiTAttentionSubmodules = None,
        layer_number: Optional[int] = None,
        attn_mask_type=AttnMaskType.no_mask,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        submodules = submodules or DiTAttentionSubmodules()
        H, Hkv, hd = _heads(config)
        tp = tp_world_size()
        self.heads, self.kv_heads, self.head_dim = H // tp, Hkv // tp, hd
        self.attn_mask_type = attn_mask_type
        self.linear_qkv = parallel_linear(
            submodules.linear_qkv,
            config.hidden_size,
            (H + 2 * Hkv) * hd,
            config,
            bias=config.add_bias_linear or config.add_qkv_bias,
        )
        core = submodules.core_attention
        if core is None:
            core = ModuleSpec(module=DistAttention2D, params=dict(scheme="contiguous"))
        self.core_attention = build_module(
            core,
            config=config,
            layer_number=layer_number or 1,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        _head_norms_and_projection(self, submodules, config, H, hd)

    def qkv(self, x: torch.Tensor, rope_angles: Optional[torch.Tensor] = None):
        """``x [..., D]`` -> q ``[..., h, d]``, k, v ``[..., h_kv, d]`` (this TP rank's heads);
        ``rope_angles`` broadcast against ``x``'s leading dims without the last (``[s, d/2]`` for
        ``[b, s, D]``)."""
        mixed, _ = self.linear_qkv(x)
        g = self.heads // self.kv_heads
        mixed = mixed.view(*x.shape[:-1], self.kv_heads, g + 2, self.head_dim)
        q = mixed[..., :g, :].reshape(*x.shape[:-1], self.heads, self.head_dim)
        k, v = mixed[..., g, :], mixed[..., g + 1, :]
        q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope_angles is not None:
            q, k = apply_rope(q, rope_angles), apply_rope(k, rope_angles)
        return q, k, v

    def project(self, o: torch.Tensor) -> torch.Tensor:
        """``o [..., h, d]`` -> ``[..., D]`` (all-reduced over TP by ``RowParallelLinear``)."""
        return linear_out(self.linear_proj, o.reshape(*o.shape[:-2], self.heads * self.head_dim))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        placement=None,
        **kwargs,
    ):
        """``[s, b, D]`` -> ``([s, b, D], None)``; ``rotary_pos_emb [s, 1|b, 1, d]`` (see
        ``rope_embedding``); ``attention_mask``: None or a megatron_video ``AttentionMask``;
        ``placement`` (a packed micro-batch's ``layouts.placement.Placement``) goes to the core
        attention as its keyword when given."""
        angles = None
        if rotary_pos_emb is not None:
            angles = rotary_pos_emb[..., 0, : self.head_dim // 2]  # [s, 1|b, d/2]
        q, k, v = self.qkv(hidden_states, angles)
        extra = {} if placement is None else {"placement": placement}
        o = self.core_attention(
            q, k, v, attention_mask, attn_mask_type=self.attn_mask_type, **extra
        )
        return self.project(o.view(*o.shape[:2], self.heads, self.head_dim)), None


@dataclass
class DiTCrossAttentionSubmodules:
    linear_q: Union[ModuleSpec, type] = ColumnParallelLinear
    linear_kv: Union[ModuleSpec, type] = ColumnParallelLinear
    q_layernorm: Union[ModuleSpec, type] = HeadRMSNorm
    k_layernorm: Union[ModuleSpec, type] = HeadRMSNorm
    linear_proj: Union[ModuleSpec, type] = RowParallelLinear


class DiTCrossAttention(MegatronModule):
    """Video queries attend to the whole text of their sample; no context parallelism.

    Text is short, so every CP rank holds all of it and attends with its own video tokens: the
    result per query is what a single GPU computes, with no communication.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: DiTCrossAttentionSubmodules = None,
        layer_number: Optional[int] = None,
        context_dim: Optional[int] = None,
        **kwargs,
    ):
        # (Megatron's cp_comm_type / pg_collection are accepted and unused: no CP here)
        super().__init__(config=config)
        submodules = submodules or DiTCrossAttentionSubmodules()
        H, Hkv, hd = _heads(config)
        tp = tp_world_size()
        self.heads, self.kv_heads, self.head_dim = H // tp, Hkv // tp, hd
        bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_q = parallel_linear(
            submodules.linear_q, config.hidden_size, H * hd, config, bias=bias
        )
        self.linear_kv = parallel_linear(
            submodules.linear_kv, context_dim or config.hidden_size, 2 * Hkv * hd, config, bias=bias
        )
        _head_norms_and_projection(self, submodules, config, H, hd)

    def _kv(self, context: torch.Tensor):
        kv, _ = self.linear_kv(context)
        kv = kv.view(*context.shape[:-1], self.kv_heads, 2, self.head_dim)
        return self.k_layernorm(kv[..., 0, :]), kv[..., 1, :]

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        context_mask: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        step=None,
    ) -> torch.Tensor:
        """``x [b, s, D]``, ``context [b, L, D_c]``, ``context_mask [b, L]`` (True = real text
        token); ``attention_mask`` (optional) a bool ``[b|1, 1, s, L]`` query x text mask (a
        packed micro-batch: each clip attends its own caption), ANDed with ``context_mask``.
        ``step``: the layer's self-attention mask; a ``CacheStep`` (generation) memoises the
        text's keys / values per prompt (``attention.kv_cache.text_kv``)."""
        if context.shape[0] != x.shape[0]:
            raise ValueError(
                f"context batch ({context.shape[0]}) must equal the video batch "
                f"({x.shape[0]}) held by this rank"
            )
        q, _ = self.linear_q(x)
        q = self.q_layernorm(q.view(*x.shape[:-1], self.heads, self.head_dim))
        k, v = text_kv(step, self, context, self._kv)
        mask = None
        if context_mask is not None:
            if tuple(context_mask.shape) != tuple(context.shape[:2]):
                raise ValueError(
                    f"context_mask shape {tuple(context_mask.shape)} must be [b, L] = "
                    f"{list(context.shape[:2])}"
                )
            mask = context_mask.to(torch.bool)[:, None, None, :].expand(-1, 1, x.shape[1], -1)
        if attention_mask is not None:
            want = (1, x.shape[1], context.shape[1])
            if attention_mask.dim() != 4 or tuple(attention_mask.shape[1:]) != want:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} must be [b|1, 1, s, L] "
                    f"= [b|1, {want[0]}, {want[1]}, {want[2]}]"
                )
            am = attention_mask.to(torch.bool)
            mask = am if mask is None else mask & am
        o = attend(q, k, v, mask)
        return linear_out(self.linear_proj, o.reshape(*x.shape[:-1], self.heads * self.head_dim))
