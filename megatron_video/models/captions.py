"""The caption vocabulary of the embedded procedural data and its learned embedder: plain torch, no
Megatron-Core, so the data layer and ``megatron-video --help`` import it without Megatron."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["PAD", "UNK", "VOCAB", "CaptionEmbedder"]

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
