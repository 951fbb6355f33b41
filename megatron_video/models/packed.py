"""What the DiT models need to run a packed micro-batch (``layouts.packed_video.PackedVideo``): the
self-attention mask of the clips (documents; teacher forcing inside each AR clip), per-token
conditioning gathered from per-clip values, the 3D RoPE of each token on its own clip's grid, the
per-clip caption mask of cross-attention and the packed caption context. Design:
docs/architecture.md, "Packed micro-batches in the models".
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_video.attention import masks
from megatron_video.attention.masks import AttentionMask, RuleMask
from megatron_video.layouts.packed_video import PackedVideo
from megatron_video.layouts.placement import Placement
from megatron_video.models.dit_blocks import rope_3d_angles, rope_embedding
from megatron_video.ops.masks import TokenIds

__all__ = [
    "PackedTeacherForcingMask",
    "packed_attention_mask",
    "check_packed",
    "per_clip_to_tokens",
    "packed_rope",
    "packed_text_mask",
    "pack_context",
]


class PackedTeacherForcingMask(RuleMask):
    """Teacher forcing inside each clip of a packed sequence, nothing across clips: the
    ``teacher_forcing`` rule on each token's (side, AR block of its clip) ANDed with the same clip
    (``doc``); padding attends nothing and is never attended. C++ tile status like every rule."""

    rule = "teacher_forcing"

    def __init__(self, packed: PackedVideo):
        if not isinstance(packed, PackedVideo) or packed.kinds != ("teacher_forcing",):
            raise ValueError(
                f"packed ({packed!r}) must be a PackedVideo of teacher-forcing clips only"
            )
        self.packed = packed

    def identities(self, ids, role):
        p = self.packed
        doc = p.clip_of(ids)
        doc = torch.where(doc >= 0, doc, torch.full_like(doc, -1 if role == "q" else -2))
        return TokenIds(side=p.side(ids), block=p.block(ids), doc=doc)

    def keys_needed(self, q_ids, k_ids):
        """Exactly the keys some query of ``q_ids`` attends (ring routing): a clean key of block
        ``b`` of clip ``c`` if a clean query of ``c`` has block ``>= b`` or a noisy one ``> b``; a
        noisy key if a noisy query of its clip has its block."""
        p = self.packed
        qc, qs, qb = p.clip_of(q_ids), p.side(q_ids), p.block(q_ids)
        kc, ks, kb = p.clip_of(k_ids), p.side(k_ids), p.block(k_ids)
        n = p.num_clips + 1  # row n: padding (attends nothing, never attended)
        qc, kc = torch.where(qc >= 0, qc, n - 1), torch.where(kc >= 0, kc, n - 1)
        real = qc < n - 1
        reach = torch.full((n,), -1, dtype=torch.long, device=qc.device)  # clean keys up to here
        reach.scatter_reduce_(0, qc[real], (qb - qs)[real], "amax")  # noisy q: blocks < its own
        width = int(max(int(qb.max()) if qb.numel() else 0, int(kb.max()) if kb.numel() else 0)) + 1
        noisy_q = torch.unique((qc * width + qb)[real & (qs == 1)])
        clean_ok = (kb <= reach[kc]) & (ks == 0)
        noisy_ok = torch.isin(kc * width + kb, noisy_q) & (ks == 1)
        return (clean_ok | noisy_ok) & (kc < n - 1)

    def _value(self):
        return (self.packed,)

    def __repr__(self):
        return f"PackedTeacherForcingMask({self.packed!r})"


def packed_attention_mask(packed: PackedVideo) -> AttentionMask:
    """The self-attention mask of ``packed``: ``masks.packed(cu_seqlens)`` (full attention inside
    each clip) for full clips, ``PackedTeacherForcingMask`` for teacher-forcing clips."""
    if packed.kinds == ("full",):
        return masks.packed(packed.cu_seqlens)
    if packed.kinds == ("teacher_forcing",):
        return PackedTeacherForcingMask(packed)
    raise ValueError(
        f"packed.kinds ({packed.kinds}) must be one kind per micro-batch ('full' for T2V, "
        f"'teacher_forcing' for the AR family)"
    )


def check_packed(
    packed, kind: str, who: str, placement: Optional[Placement], cp: Tuple[int, int], s: int, b: int
) -> torch.Tensor:
    """The global ids this CP rank holds, after checking: ``packed`` a ``PackedVideo`` of ``kind``
    clips, batch ``b == 1``, ``placement`` (required at CP > 1) covering its ``seq_len`` and the
    local length ``s``. ``cp = (cp_size, cp_rank)``; ``who`` names the model in errors."""
    if not isinstance(packed, PackedVideo):
        raise ValueError(f"packed ({type(packed).__name__}) must be a layouts.PackedVideo")
    if packed.kinds != (kind,):
        raise ValueError(
            f"packed.kinds ({packed.kinds}) must be ({kind!r},) for {who} (rule: one attention "
            f"kind per packed micro-batch, the model's own)"
        )
    if b != 1:
        raise ValueError(f"batch size ({b}) must be 1 for a packed micro-batch (one sequence)")
    ids = packed.local_ids(placement, *cp)
    if ids.numel() != s:
        raise ValueError(
            f"sequence length ({s}) must equal the packed seq_len ({packed.seq_len}) / cp_size "
            f"({cp[0]}) = {ids.numel()} tokens on each CP rank"
        )
    return ids


def per_clip_to_tokens(per_clip: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """``per_clip [C, ...]`` gathered at each token's clip ``clip [s]`` -> ``[s, ...]``; padding
    tokens (``clip == -1``) get zeros."""
    pad = per_clip.new_zeros((1,) + tuple(per_clip.shape[1:]))
    table = torch.cat([per_clip, pad], dim=0)
    idx = torch.where(clip >= 0, clip, torch.full_like(clip, per_clip.shape[0]))
    return table.index_select(0, idx.to(per_clip.device))


def packed_rope(packed: PackedVideo, ids: torch.Tensor, head_dim: int, theta: float):
    """Megatron ``rotary_pos_emb [s, 1, 1, head_dim]`` of global ``ids``: each token's 3D RoPE at
    its ``(t, h, w)`` on its own clip's grid (teacher forcing: both halves alike)."""
    return rope_embedding(rope_3d_angles(packed.token_thw(ids.cpu()), head_dim, theta))


def packed_text_mask(
    clip: torch.Tensor, num_clips: int, context_mask: Optional[torch.Tensor], text_len: int
) -> torch.Tensor:
    """Bool ``[1, 1, s, num_clips * L]`` cross-attention mask: query token of clip ``c`` attends
    only clip ``c``'s caption tokens (``L`` each, packed clip-major), and of those only the real
    ones (``context_mask [1, C·L]``); padding queries attend nothing (zero output)."""
    if text_len % num_clips:
        raise ValueError(
            f"context length ({text_len}) must be num_clips ({num_clips}) x caption length "
            f"(the packed captions, clip-major)"
        )
    key_clip = torch.arange(num_clips, device=clip.device).repeat_interleave(text_len // num_clips)
    m = clip[:, None] == key_clip[None, :]
    if context_mask is not None:
        if tuple(context_mask.shape) != (1, text_len):
            raise ValueError(
                f"context_mask shape {tuple(context_mask.shape)} must be [1, num_clips x L] = "
                f"[1, {text_len}] for a packed micro-batch"
            )
        m = m & context_mask.to(device=m.device, dtype=torch.bool)
    return m[None, None]


def pack_context(ctx: torch.Tensor, ctx_mask: torch.Tensor):
    """Per-clip captions ``[C, L, D_c]`` / ``[C, L]`` -> the packed context in Megatron's layout
    ``[C·L, 1, D_c]`` and its mask ``[1, C·L]`` (clip-major)."""
    C, L, Dc = ctx.shape
    return ctx.reshape(C * L, 1, Dc).contiguous(), ctx_mask.reshape(1, C * L)
