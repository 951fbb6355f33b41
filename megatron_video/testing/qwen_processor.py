"""A tiny Qwen2.5-VL tokenizer and processor built offline (tests of ``data.qwen_video_qa``):
a WordLevel tokenizer with Qwen's special tokens and a chat template of Qwen's shape, and
transformers' PIL image processor (the independent oracle of the pixel rows)."""

from __future__ import annotations

from typing import Sequence

SPECIAL = ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|video_pad|>", "<|image_pad|>")  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(texts: Sequence[str]):
    """A WordLevel tokenizer trained on ``texts`` plus Qwen's special tokens (split out of any
    text), with ``CHAT_TEMPLATE``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        list(texts) + ["user assistant"], trainers.WordLevelTrainer(special_tokens=list(SPECIAL))
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=list(SPECIAL[2:]),
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


def image_processor(*, patch: int, temporal: int, merge: int, min_pixels: int, max_pixels: int):
    """transformers' PIL ``Qwen2VLImageProcessorPil`` with these numbers (the video processor needs
    torchvision, not installed here: a video's frames go through it one image at a time)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    return Qwen2VLImageProcessorPil(
        patch_size=patch, temporal_patch_size=temporal, merge_size=merge, size=size
    )


def write_tiny_folder(folder, texts: Sequence[str], *, fps: float = 4.0, max_pixels: int = 1024):
    """A tiny Qwen2.5-VL HF folder: ``tiny_hf_config`` (its special-token ids the tokenizer's),
    ``tiny_tokenizer(texts)`` and a ``video_preprocessor_config.json`` (patch 4, temporal 2,
    merge 2, 256..``max_pixels`` pixels, ``fps``). Returns the folder."""
    import json
    from pathlib import Path

    from megatron_video.models.qwen_vl.config import tiny_hf_config

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(texts)
    tok.save_pretrained(str(out))
    hf = tiny_hf_config()
    for name, t in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                    ("vision_start_token_id", "<|vision_start|>"),
                    ("vision_end_token_id", "<|vision_end|>")):  # fmt: skip
        setattr(hf, name, tok.convert_tokens_to_ids(t))
    hf.to_json_file(str(out / "config.json"))
    proc = dict(patch_size=4, temporal_patch_size=2, merge_size=2, fps=fps,
                size={"shortest_edge": 256, "longest_edge": max_pixels})  # fmt: skip
    (out / "video_preprocessor_config.json").write_text(json.dumps(proc))
    return out
