"""Wan's embedders and output head: the condition embedder (sinusoid + ``time_embedder`` + shared
``time_proj`` to 6 D, GELU-tanh text projection, the I2V image embedder), the output norm with its
2-row table and ``proj_out`` (``WanOutputHead``), and ``wan_unpatchify``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_video.models.wan.config import WanConfig, gelu_tanh, island_dtype
from megatron_video.models.wan.layer import WanLayerNorm

__all__ = [
    "WanConditionEmbedder",
    "WanTimeEmbedder",
    "WanMLPEmbedder",
    "WanImageEmbedder",
    "WanOutputHead",
    "timestep_sinusoid",
    "wan_unpatchify",
    "wan_linear",
]


def wan_linear(n_in: int, n_out: int, config) -> torch.nn.Linear:
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
        self.linear_1 = wan_linear(config.freq_dim, config.hidden_size, config)
        self.linear_2 = wan_linear(config.hidden_size, config.hidden_size, config)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        cd = island_dtype(self.linear_1.weight.dtype)
        e = timestep_sinusoid(t, self.freq_dim, cd)
        return _island_linear(self.linear_2, F.silu(_island_linear(self.linear_1, e)))


class WanMLPEmbedder(torch.nn.Module):
    """``linear_1`` -> activation -> ``linear_2`` (the text projection: GELU-tanh)."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int, config, activation=gelu_tanh):
        super().__init__()
        self.linear_1 = wan_linear(n_in, n_hidden, config)
        self.linear_2 = wan_linear(n_hidden, n_out, config)
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
        self.time_proj = wan_linear(D, 6 * D, config)
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
        self.proj_out = wan_linear(D, config.out_patch_dim, config)
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
