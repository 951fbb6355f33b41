"""Wan's 3D rotary embedding: the head dimension split over (frame, row, column), its own table.

As diffusers' ``WanRotaryPosEmbed``: ``h`` and ``w`` get ``2 * (head_dim // 6)`` channels each,
``t`` the rest; per axis the angles ``pos * theta^(-2i/d)`` are built in float64 and the cos /
sin table stored in float32 (repeat-interleaved, channel pairs ``(2i, 2i + 1)``). Megatron's RoPE computes
cos / sin in the tensor's dtype with rotate-half pairs, hence this table. Rows come from global
token ids, so every context-parallel layout rotates a token the same way.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_video.layouts.geometry import VideoGeometry
from megatron_video.layouts.packed_video import PackedVideo
from megatron_video.layouts.stdit import token_thw

__all__ = ["wan_rope_split", "WanRope", "apply_wan_rope"]


def wan_rope_split(head_dim: int) -> Tuple[int, int, int]:
    """Channels of the (t, h, w) axes: ``h = w = 2 * (head_dim // 6)``, ``t`` the rest."""
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"attention_head_dim ({head_dim}) must be even and >= 6 for Wan's 3D RoPE")
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def _axis_table(dim: int, max_len: int, theta: float):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), freqs)
    return (
        angles.cos().repeat_interleave(2, dim=1).float(),
        angles.sin().repeat_interleave(2, dim=1).float(),
    )


class WanRope(torch.nn.Module):
    """The table (non-persistent fp32 buffers ``freqs_cos`` / ``freqs_sin`` ``[max_len, head_dim]``)
    and its rows for given tokens: ``forward(ids, geometry) -> (cos, sin)``, each
    ``[len(ids), hd]``."""

    def __init__(self, head_dim: int, max_seq_len: int = 1024, theta: float = 10000.0):
        super().__init__()
        self.split = wan_rope_split(head_dim)
        self.max_seq_len = max_seq_len
        cos, sin = zip(*(_axis_table(d, max_seq_len, theta) for d in self.split))
        self.register_buffer("freqs_cos", torch.cat(cos, dim=1), persistent=False)
        self.register_buffer("freqs_sin", torch.cat(sin, dim=1), persistent=False)

    def forward(self, ids: torch.Tensor, geometry: VideoGeometry):
        """``geometry`` a ``VideoGeometry`` or a ``PackedVideo`` (each token on its own clip's
        grid, both teacher-forcing halves alike)."""
        packed = isinstance(geometry, PackedVideo)
        grids = [c.grid for c in geometry.clips] if packed else [geometry]
        for g in grids:
            grid = (g.frames, g.height, g.width)
            if max(grid) > self.max_seq_len:
                raise ValueError(
                    f"token grid {grid} must not exceed rope_max_seq_len "
                    f"({self.max_seq_len}) on any axis (Wan's RoPE table length)"
                )
        ids = ids.to(self.freqs_cos.device)
        thw = geometry.token_thw(ids) if packed else token_thw(ids, geometry)
        out = []
        for table in (self.freqs_cos, self.freqs_sin):
            parts = table.split(self.split, dim=1)
            out.append(torch.cat([parts[a][thw[:, a]] for a in range(3)], dim=1))
        return out[0], out[1]


def apply_wan_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, s, h, d]`` by rows ``cos, sin [s, d]``; pairs ``(2i, 2i + 1)`` (diffusers'
    ``apply_rotary_emb`` of Wan), computed in max(fp32, x.dtype) and returned in ``x.dtype``."""
    cd = torch.promote_types(torch.float32, x.dtype)
    c = cos[:, None, 0::2].to(cd)
    s = sin[:, None, 1::2].to(cd)
    x1, x2 = x[..., 0::2].to(cd), x[..., 1::2].to(cd)
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).to(x.dtype)
