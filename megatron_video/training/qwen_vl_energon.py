"""The ``qwen_vl`` family's energon video-QA micro-batches (``data.source: energon``): clips of a
prepared dataset (``data.path``) written by ``data.qwen_video_qa.QwenVideoQA`` in the Qwen2.5-VL
processor's conventions, the tokenizer and ``(video_)preprocessor_config.json`` from the
``model.hf_config`` folder; each CP rank decodes only the frames of its temporal patches
(``layouts.mmsp.frame_shards`` over the micro-batch's videos, as ``mmsp.qwen_vl`` shards them; under
``train.objective: grpo`` over each video alone, as ``mmsp.rl_qwen_vl`` shards a prompt's video).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

import torch

from .config import Config

__all__ = ["QwenEnergonBatch", "QwenEnergonBatches", "hf_folder", "energon_source"]


def hf_folder(config: Config) -> Path:
    """The HF folder of ``model.hf_config`` (the folder, or the folder of its ``config.json``)."""
    p = Path(config.model.hf_config)
    return p if p.is_dir() else p.parent


def energon_source(config: Config, hf_config):
    """``(QwenVideoQA, VideoProcessing)`` of ``data.path`` with the tokenizer and processor of the
    ``model.hf_config`` folder; ``ValueError`` naming ``model.hf_config`` where they do not match
    the model (``check_matches_model``) or are missing."""
    from megatron_video.data.qwen_video_qa import (
        QwenVideoQA,
        check_matches_model,
        processing_from_folder,
    )

    folder = hf_folder(config)
    try:
        from transformers import AutoTokenizer

        proc = processing_from_folder(folder)
        tok = AutoTokenizer.from_pretrained(str(folder))
        check_matches_model(proc, hf_config, tok)
    except (ValueError, OSError) as e:
        raise ValueError(
            f"model.hf_config ({config.model.hf_config!r}) must be a folder whose tokenizer and "
            f"video processor match the model for data.source 'energon': {e}"
        ) from e
    return QwenVideoQA(config.data.path, tok, proc), proc


def max_length(qa, proc) -> int:
    """The longest expanded sample of the dataset (nominal: metrics and the position table):
    the prompt once (one ``<|video_pad|>``, a special token), each clip's visual tokens from its
    metadata and its answer's tokens in one batched call, as ``QwenVideoQA.text`` counts them."""
    from megatron_video.data.qwen_video_qa import plan_video

    tok, recs = qa.tokenizer, list(qa.records.values())
    if not recs:
        return 0
    prompt = len(tok(qa.prompt(), add_special_tokens=False)["input_ids"]) - 1
    answers = tok([r["caption"] + "<|im_end|>" for r in recs], add_special_tokens=False)
    return max(
        prompt + plan_video(r, proc).num_tokens // proc.merge**2 + len(a)
        for r, a in zip(recs, answers["input_ids"])
    )


@dataclass
class QwenEnergonBatch:
    input_ids: torch.Tensor  # [b, L] placeholders expanded, right-padded
    pixel_values_videos: torch.Tensor  # this CP rank's rows only
    video_grid_thw: torch.Tensor  # [b, 3]
    second_per_grid_ts: torch.Tensor  # [b]
    labels: torch.Tensor  # [b, L] HF convention, -100 on padding
    sample_ids: Optional[torch.Tensor] = None
    pixel_rows: Optional[List[int]] = None  # each sample's rows of pixel_values_videos
    answers: Optional[List[str]] = None  # each sample's answer text (the clip's caption)


class QwenEnergonBatches:
    """This rank's micro-batches: sample ``i`` of the stream is clip ``sorted keys[i % n]``; every
    CP rank of a group reads the same clips and decodes only its temporal patches' frames
    (``decoded_frames``: source frames decoded so far)."""

    def __init__(self, config: Config, coords, hf_config):
        self.qa, self.proc = energon_source(config, hf_config)
        self.keys = sorted(self.qa.records)
        self.cp_rank, self.cp_size = coords.cp_rank, coords.cp_size
        self.dp_rank, self.dp_size = coords.dp_rank, coords.dp_size
        self.micro = config.train.micro_batch_size
        gbs = config.train.global_batch_size or self.micro * self.dp_size
        self.num_microbatches = gbs // (self.micro * self.dp_size)
        self.pad_id = self.qa.tokenizer.pad_token_id or 0
        self.per_video = config.train.objective == "grpo"  # a prompt is its own sequence

    @property
    def decoded_frames(self) -> int:
        return self.qa.decoded_frames

    def micro_batch(self, step: int, m: int) -> QwenEnergonBatch:
        base = ((step * self.num_microbatches + m) * self.dp_size + self.dp_rank) * self.micro
        return self.from_positions([base + j for j in range(self.micro)])

    def _local_units(self, keys: List[str]) -> List[List[int]]:
        """This CP rank's temporal patches of each clip (the model's ``frame_shards``)."""
        from megatron_video.data.qwen_video_qa import plan_video
        from megatron_video.layouts.mmsp import frame_shards

        grids = [plan_video(self.qa.records[k], self.proc).grid for k in keys]
        for k, g in zip(keys, grids):
            if self.cp_size > 1 and g[1:] != grids[0][1:]:
                raise ValueError(
                    f"clip {k!r} (h, w) patches {g[1:]} must equal clip {keys[0]!r}'s "
                    f"{grids[0][1:]} in one micro-batch under context parallelism (data.path)"
                )
        if self.per_video:
            return [
                frame_shards([g[0]], self.cp_size).local_units(self.cp_rank).tolist() for g in grids
            ]
        shards = frame_shards([g[0] for g in grids], self.cp_size)
        mine = shards.local_units(self.cp_rank).tolist()
        out, start = [], 0
        for g in grids:
            out.append([u - start for u in mine if start <= u < start + g[0]])
            start += g[0]
        return out

    def from_positions(self, positions: List[int], step: int = 0) -> QwenEnergonBatch:
        keys = [self.keys[int(i) % len(self.keys)] for i in positions]
        units = self._local_units(keys)
        s = [self.qa.sample(k, self.cp_rank, self.cp_size, u) for k, u in zip(keys, units)]
        L = max(int(x["input_ids"].numel()) for x in s)

        def pad(t, value):
            return torch.nn.functional.pad(t, (0, L - t.numel()), value=value)

        return QwenEnergonBatch(
            input_ids=torch.stack([pad(x["input_ids"], self.pad_id) for x in s]),
            pixel_values_videos=torch.cat([x["pixel_values_videos"] for x in s]),
            video_grid_thw=torch.cat([x["video_grid_thw"] for x in s]),
            second_per_grid_ts=torch.cat([x["second_per_grid_ts"] for x in s]),
            labels=torch.stack([pad(x["labels"], -100) for x in s]),
            sample_ids=torch.tensor([int(i) for i in positions]),
            pixel_rows=[int(x["pixel_values_videos"].shape[0]) for x in s],
            answers=[self.qa.records[k]["caption"] for k in keys],
        )

    def step_batches(self, step: int) -> Iterator[QwenEnergonBatch]:
        return iter([self.micro_batch(step, m) for m in range(self.num_microbatches)])

    def data_state(self, step=None) -> None:
        """Stateless: a micro-batch is a pure function of ``(step, micro-batch, dp rank)``."""
        return None

    def restore_data_state(self, text) -> None:
        if text is not None:
            raise ValueError(
                "checkpoint holds a data-loader state; qwen_vl's energon source is stateless "
                "(QwenEnergonBatches.data_state) and cannot take one"
            )
