"""Video question answering on the procedural videos (``data.synthetic``), for video-language
models, in Megatron's ``LLaVAModel`` text convention (``VideoQADataset``).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from ..checks import check_positive_int
from ..models.captions import VOCAB
from .synthetic import COLORS, SHAPES, render_video, sample_attributes

__all__ = [
    "ANSWER_IDS",
    "IMAGE_TOKEN_INDEX",
    "QA_VOCAB",
    "QUESTIONS",
    "TEXT_LEN",
    "VideoQADataset",
    "qa_tokenizer",
]

IMAGE_TOKEN_INDEX = -200
QA_VOCAB = tuple(VOCAB) + ("what", "colour", "is", "the", "shape", "at", "end", "start", "it", "?")
QUESTIONS = (
    ("what colour is the shape at the end ?", "color_end"),
    ("what colour is the shape at the start ?", "color_start"),
    ("what shape is it ?", "shape"),
)
ANSWER_IDS = tuple(QA_VOCAB.index(w) for w in (*COLORS, *SHAPES))  # the answer words' ids
TEXT_LEN = 1 + max(
    len(q.split()) for q, _ in QUESTIONS
)  # image token + question (answer = last label)


class VideoQADataset(torch.utils.data.Dataset):
    """``num_samples`` (video, question, answer) triples; item ``i`` is a dict with ``frames
    [T, 3, H, W]`` (LLaVA's tiles), ``input_ids``, ``labels``, ``loss_mask`` ``[TEXT_LEN]``,
    ``question`` and ``answer``.

    Sample ``i`` is the procedural video ``i`` and one of three questions about it, answered by one
    word from its attributes: "what colour is the shape at the end ?" (the end colour), "what colour
    is the shape at the start ?" (the start colour), "what shape is it ?" (the shape). The text has
    one image token (``IMAGE_TOKEN_INDEX``) where the video's visual tokens go, ``labels[i]`` the
    token after position ``i``, ``loss_mask`` 1 only where the label is the answer.
    """

    def __init__(
        self, num_samples: int, *, num_frames: int, height: int, width: int, seed: int = 0
    ):
        check_positive_int("num_samples", num_samples)
        self.num_samples, self.num_frames, self.height, self.width, self.seed = (
            num_samples,
            num_frames,
            height,
            width,
            seed,
        )
        self.ids = {w: i for i, w in enumerate(QA_VOCAB)}

    @property
    def vocab_size(self) -> int:
        return len(QA_VOCAB)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index ({index}) must be in [0, {self.num_samples})")
        attrs = sample_attributes(
            self.seed, index, num_frames=self.num_frames, height=self.height, width=self.width
        )
        video = render_video(
            attrs, num_frames=self.num_frames, height=self.height, width=self.width
        )
        question, field = QUESTIONS[index % len(QUESTIONS)]
        answer = getattr(attrs, field)
        words = question.split()
        seq = [IMAGE_TOKEN_INDEX] + [self.ids[w] for w in words] + [self.ids[answer]]
        n = len(seq) - 1  # input tokens (the answer is only a label)
        input_ids = torch.zeros(TEXT_LEN, dtype=torch.long)
        labels = torch.zeros(TEXT_LEN, dtype=torch.long)
        loss_mask = torch.zeros(TEXT_LEN)
        input_ids[:n] = torch.tensor(seq[:-1])
        labels[:n] = torch.tensor(seq[1:])
        loss_mask[n - 1] = 1.0  # the position whose label is the answer
        return {
            "frames": video.transpose(0, 1).contiguous(),
            "input_ids": input_ids,
            "labels": labels,
            "loss_mask": loss_mask,
            "question": question,
            "answer": answer,
            "answer_id": self.ids[answer],
        }


def qa_tokenizer(special_tokens: Optional[Mapping[str, int]] = None):
    """The questions' tokenizer, built in memory (nothing downloaded): a transformers
    ``PreTrainedTokenizerFast`` over a ``tokenizers`` WordLevel model whose ids are
    ``QA_VOCAB``'s (``<pad>`` 0 and ``<unk>`` 1 special, words split at spaces, decoded joined by
    spaces) plus ``special_tokens`` (name -> id, e.g. Qwen2.5-VL's ``<|video_pad|>``) as special
    tokens. ``decode(ids, skip_special_tokens=True)`` drops the special tokens; an id of none of
    them (a padded vocabulary row) decodes to nothing."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(QA_VOCAB)}
    extra = dict(special_tokens or {})
    for name, i in extra.items():
        if name in vocab or i in vocab.values():
            raise ValueError(
                f"special_tokens ({name!r}: {i}) must be a new token at a new id (QA_VOCAB "
                f"holds ids 0..{len(QA_VOCAB) - 1})"
            )
        vocab[name] = int(i)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=list(extra),
    )
