"""Text conditioning from a Hugging Face tokenizer + encoder (e.g. T5 / UMT5), local files only
(``HFTextEncoder``); the embedded default stays ``data.synthetic.CaptionTokenizer``.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ..checks import check_positive_int

__all__ = ["HFTextEncoder"]


class HFTextEncoder:
    """``encoder(captions) -> (emb, mask)`` from a HF tokenizer and encoder module.

    Embeddings ``[b, L, d]`` float32 (``last_hidden_state``; padded positions zeroed) and mask
    ``[b, L]`` bool, padded / truncated to ``max_len``. ``from_pretrained`` reads a LOCAL folder
    (``local_files_only``: nothing is downloaded). ``megatron-video precompute --text-encoder DIR``
    stores the embeddings next to the latents (``text_emb`` / ``text_mask`` in ``latent.pth``).
    """

    def __init__(self, tokenizer, encoder: torch.nn.Module, max_len: int = 64):
        check_positive_int("max_len", max_len)
        if not callable(tokenizer) or not isinstance(encoder, torch.nn.Module):
            raise ValueError("tokenizer must be a callable HF tokenizer and encoder an nn.Module")
        self.tokenizer, self.encoder, self.max_len = tokenizer, encoder.eval(), max_len

    @classmethod
    def from_pretrained(cls, path: str, max_len: int = 64) -> "HFTextEncoder":
        """Tokenizer + encoder from a local folder (``save_pretrained`` layout): a T5 or a UMT5
        (Wan's text encoder), by the folder's ``model_type``."""
        from transformers import AutoConfig, AutoTokenizer, T5EncoderModel, UMT5EncoderModel

        kinds = {"t5": T5EncoderModel, "umt5": UMT5EncoderModel}
        kind = AutoConfig.from_pretrained(path, local_files_only=True).model_type
        if kind not in kinds:
            raise ValueError(
                f"text encoder {path!r}: model_type ({kind!r}) must be one of {sorted(kinds)}"
            )
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        enc = kinds[kind].from_pretrained(path, local_files_only=True, use_safetensors=True)
        return cls(tok, enc, max_len)

    @property
    def dim(self) -> int:
        return int(self.encoder.config.d_model)

    @torch.no_grad()
    def __call__(self, captions: Sequence[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        if isinstance(captions, str) or not all(isinstance(c, str) for c in captions):
            raise ValueError("captions must be a sequence of strings")
        t = self.tokenizer(
            list(captions),
            padding="max_length",
            truncation=True,
            max_length=self.max_len,
            return_tensors="pt",
        )
        mask = t["attention_mask"].bool()
        emb = self.encoder(
            input_ids=t["input_ids"], attention_mask=t["attention_mask"]
        ).last_hidden_state
        return (emb.float() * mask[..., None]).contiguous(), mask
