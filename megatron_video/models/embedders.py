"""Input / output pieces of the video DiTs: 3D patchify, patch embedding, final AdaLN layer, the
caption vocabulary and embedders, and the tagging of pipeline-replicated conditioning embedders.
Design: docs/architecture.md, "Megatron integration".
"""

from __future__ import annotations

# * ``patchify`` / ``unpatchify``: latents ``[B, C, T, H, W]`` <-> frame-major tokens ``[B,
#   T'*H'*W', C*pt*ph*pw]`` (token ``g = f*H'*W' + y*W' + x``, the order every layout indexes). A CP
#   rank patchifies only its own latent frames (``pt`` divides its frame count), which gives exactly
#   its contiguous slice of the global token sequence.
# * ``PatchEmbed``: tokens -> hidden ``D`` (first pipeline stage only).
# * ``FinalLayer``: AdaLN shift/scale from the conditioning, LayerNorm, ``D -> C*pt*ph*pw``; the
#   output projection is zero-initialised (the network starts by predicting 0).
# * ``TextEmbedder``: the learned caption table (``CaptionEmbedder``) plus a
#   per-sample classifier-free-guidance drop that swaps in the learned null caption.
#
# Conditioning embedders (timestep, text) are replicated on every pipeline stage:
# ``mark_pipeline_replicated`` tags their parameters the way Megatron's ``finalize_model_grads``
# expects (``param.pipeline_parallel``; with ``config.has_cond_embedder``) so their gradients are
# all-reduced across stages.
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from megatron_video.checks import check_positive_int

__all__ = [
    "PAD",
    "UNK",
    "VOCAB",
    "CaptionEmbedder",
    "patchify",
    "unpatchify",
    "token_grid",
    "PatchEmbed",
    "FinalLayer",
    "TextEmbedder",
    "mark_pipeline_replicated",
]


# The caption vocabulary of the embedded procedural data (``data.synthetic``: its sizes, colours and
# shapes, in that order, after the connecting words); ``len(VOCAB)`` is the DiTs' default
# ``text_vocab_size``.
PAD, UNK = "<pad>", "<unk>"
VOCAB = (
    PAD,
    UNK,
    "a",
    ",",
    "bouncing",
    "turning",
    "to",
    "left",
    "right",
    "top",
    "bottom",
    "small",
    "large",
    "red",
    "green",
    "blue",
    "yellow",
    "cyan",
    "magenta",
    "white",
    "orange",
    "circle",
    "square",
    "triangle",
    "diamond",
)


def token_grid(latent_thw: Sequence[int], patch: Sequence[int]) -> Tuple[int, int, int]:
    """``(T', H', W')`` of a latent ``(T, H, W)`` under ``patch``; ``ValueError`` if not divisible."""
    out = []
    for axis, n, p in zip(("frames", "height", "width"), latent_thw, patch):
        if p < 1 or n % p:
            raise ValueError(f"latent {axis} ({n}) must be divisible by patch size ({p})")
        out.append(n // p)
    return tuple(out)


def patchify(latents: Tensor, patch: Sequence[int]) -> Tensor:
    """``[B, C, T, H, W]`` -> ``[B, T'*H'*W', C*pt*ph*pw]`` (frame-major tokens)."""
    if latents.dim() != 5:
        raise ValueError(f"latents shape ({tuple(latents.shape)}) must be [B, C, T, H, W]")
    B, C, T, H, W = latents.shape
    pt, ph, pw = patch
    t, h, w = token_grid((T, H, W), patch)
    x = latents.reshape(B, C, t, pt, h, ph, w, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(B, t * h * w, C * pt * ph * pw)


def unpatchify(tokens: Tensor, patch: Sequence[int], grid: Sequence[int], channels: int) -> Tensor:
    """Inverse of ``patchify``: ``[B, T'*H'*W', C*pt*ph*pw]`` -> ``[B, C, T, H, W]``."""
    pt, ph, pw = patch
    t, h, w = grid
    B = tokens.shape[0]
    if (
        tokens.dim() != 3
        or tokens.shape[1] != t * h * w
        or tokens.shape[2] != channels * pt * ph * pw
    ):
        raise ValueError(
            f"tokens shape ({tuple(tokens.shape)}) must be [B, {t * h * w}, "
            f"{channels * pt * ph * pw}] for grid {tuple(grid)} and patch {tuple(patch)}"
        )
    x = tokens.reshape(B, t, h, w, channels, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(B, channels, t * pt, h * ph, w * pw)


def mark_pipeline_replicated(module: torch.nn.Module) -> None:
    """Tag ``module``'s parameters as replicated on every pipeline stage (gradients all-reduced
    over the pipeline group by Megatron's ``finalize_model_grads`` when
    ``config.has_cond_embedder`` is set)."""
    for p in module.parameters():
        p.pipeline_parallel = True


class PatchEmbed(MegatronModule):
    """Patch tokens ``[b, s, C*pt*ph*pw]`` -> ``[b, s, D]`` (replicated over TP)."""

    def __init__(self, config: TransformerConfig, in_dim: int):
        super().__init__(config=config)
        self.proj = torch.nn.Linear(in_dim, config.hidden_size, dtype=config.params_dtype)
        config.init_method(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.proj(tokens)


class FinalLayer(MegatronModule):
    """``LN(x) * (1 + scale) + shift`` then ``D -> out_dim``; conditioning ``[b, D]`` or ``[b, s, D]``."""

    def __init__(self, config: TransformerConfig, out_dim: int):
        super().__init__(config=config)
        D = config.hidden_size
        self.modulation = torch.nn.Linear(D, 2 * D, dtype=config.params_dtype)
        self.linear = torch.nn.Linear(D, out_dim, dtype=config.params_dtype)
        for lin in (self.modulation, self.linear):
            torch.nn.init.zeros_(lin.weight)
            torch.nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor, conditioning: Tensor) -> Tensor:
        """``x [b, s, D]``; ``conditioning`` per sample ``[b, D]`` or per token ``[b, s, D]``."""
        shift, scale = self.modulation(F.silu(conditioning)).chunk(2, dim=-1)
        if shift.dim() == 2:
            shift, scale = shift[:, None], scale[:, None]
        y = F.layer_norm(x, x.shape[-1:], eps=self.config.layernorm_epsilon)
        return self.linear(y * (1 + scale) + shift)


class CaptionEmbedder(nn.Module):
    """Learned per-token caption embeddings ``[b, L, d_text]`` (+ mask) and a learned null caption for CFG.

    Token and position tables are small ``nn.Embedding``s; padded positions are zeroed. ``null(b)``
    returns the null caption (a learned ``[L, d_text]`` sequence, all positions valid).
    """

    def __init__(
        self,
        vocab_size: int,
        d_text: int,
        max_len: int,
        *,
        generator: Optional[torch.Generator] = None,
    ):
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("d_text", d_text), ("max_len", max_len)):
            if v < 1:
                raise ValueError(f"{name} ({v}) must be >= 1")
        self.max_len = max_len
        self.tokens = nn.Embedding(vocab_size, d_text)
        self.positions = nn.Embedding(max_len, d_text)
        self.null_embedding = nn.Parameter(torch.empty(max_len, d_text))
        self.reset_parameters(generator)

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        # Explicit generator: replicated embedders (TP / PP stages) must start identical.
        for p in (self.tokens.weight, self.positions.weight, self.null_embedding):
            nn.init.normal_(p, std=1.0, generator=generator)

    def forward(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        if ids.dim() != 2 or ids.shape[1] != self.max_len or mask.shape != ids.shape:
            raise ValueError(
                f"ids {tuple(ids.shape)} and mask {tuple(mask.shape)} must both be "
                f"[b, max_len={self.max_len}]"
            )
        pos = torch.arange(self.max_len, device=ids.device)
        emb = (self.tokens(ids) + self.positions(pos)[None]) * mask[..., None].to(
            self.tokens.weight.dtype
        )
        return emb, mask.bool()

    def null(self, batch_size: int = 1) -> tuple[Tensor, Tensor]:
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be >= 1")
        emb = self.null_embedding[None].expand(batch_size, -1, -1)
        return emb, torch.ones(batch_size, self.max_len, dtype=torch.bool, device=emb.device)


class TextEmbedder(torch.nn.Module):
    """Caption ids -> ``([b, L, d], mask [b, L])`` with a classifier-free-guidance drop.

    ``drop [b]`` (bool) replaces a sample's caption by the learned null caption (all positions
    valid); the decision is an input so every CP / TP / PP rank applies the same one.
    With ``input_dim``, precomputed caption embeddings (a floating ``[b, L, input_dim]`` tensor in
    place of the ids, e.g. a T5 encoder's, ``data.text``) are projected to ``d`` by a learned linear
    layer instead; integer ids still go through the small caption embedder.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        max_len: int,
        seed: int = 0,
        input_dim: Optional[int] = None,
    ):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.captions = CaptionEmbedder(vocab_size, dim, max_len, generator=g)
        self.input_dim = input_dim
        if input_dim is not None:
            check_positive_int("input_dim", input_dim)
            self.proj = torch.nn.Linear(input_dim, dim)
            torch.nn.init.normal_(self.proj.weight, std=input_dim**-0.5, generator=g)
            torch.nn.init.zeros_(self.proj.bias)

    def forward(
        self, ids: Tensor, mask: Tensor, drop: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        if ids.is_floating_point():  # precomputed embeddings
            if (
                self.input_dim is None
                or ids.dim() != 3
                or ids.shape[2] != self.input_dim
                or ids.shape[1] != self.captions.max_len
                or mask.shape != ids.shape[:2]
            ):
                raise ValueError(
                    f"caption embeddings {tuple(ids.shape)} (mask {tuple(mask.shape)}) must be "
                    f"[b, {self.captions.max_len}, input_dim={self.input_dim}] (set "
                    f"data.text_embed_dim to the encoder's width)"
                )
            mask = mask.bool()
            emb = self.proj(ids.to(self.proj.weight.dtype)) * mask[..., None].to(
                self.proj.weight.dtype
            )
        else:
            emb, mask = self.captions(ids, mask)
        if drop is not None:
            null, null_mask = self.captions.null(ids.shape[0])
            d = drop.to(torch.bool)
            emb = torch.where(d[:, None, None], null.to(emb.dtype), emb)
            mask = torch.where(d[:, None], null_mask, mask)
        return emb, mask
