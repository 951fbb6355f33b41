"""The ``video_llava`` family's micro-batches (``data.video_qa``) and objective: next-token
cross-entropy on the answer token, each CP rank's share normalised over the global number of target
tokens (``mmsp.global_token_loss``). The family itself: ``training/families/video_llava.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch

from .config import Config

__all__ = ["VideoQABatch", "VideoQABatches", "LanguageModelObjective"]


@dataclass
class VideoQABatch:
    images: torch.Tensor  # [b * T, 3, H, W] every frame of the micro-batch (LLaVA's tiles)
    input_ids: torch.Tensor  # [b, TEXT_LEN]
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    num_image_tiles: torch.Tensor  # [b] frames per video
    sample_ids: Optional[torch.Tensor] = None  # [b] positions in the sample stream (GRPO seeds)


class VideoQABatches:
    """This data-parallel rank's micro-batches (every CP rank of a group gets the same samples;
    ``MMSPLLaVAModel`` encodes only its frames)."""

    def __init__(self, config: Config, dp_rank: int, dp_size: int):
        from megatron_video.data.video_qa import VideoQADataset

        d, t = config.data, config.train
        self.dataset = VideoQADataset(
            d.num_samples, num_frames=d.num_frames, height=d.height, width=d.width, seed=d.seed
        )
        self.dp_rank, self.dp_size, self.micro = dp_rank, dp_size, t.micro_batch_size
        gbs = t.global_batch_size or self.micro * dp_size
        self.num_microbatches = gbs // (self.micro * dp_size)

    def micro_batch(self, step: int, m: int) -> VideoQABatch:
        base = ((step * self.num_microbatches + m) * self.dp_size + self.dp_rank) * self.micro
        return self.from_positions([base + j for j in range(self.micro)])

    def from_positions(self, positions: List[int], step: int = 0) -> VideoQABatch:
        """The micro-batch of the samples at ``positions`` (the Megatron-LM entry's data path;
        ``step`` is unused: a sample does not depend on it)."""
        items = [self.dataset[int(i) % len(self.dataset)] for i in positions]
        ids = torch.stack([x["input_ids"] for x in items])
        return VideoQABatch(
            images=torch.cat([x["frames"] for x in items]),
            input_ids=ids,
            position_ids=torch.arange(ids.shape[1])[None].expand_as(ids).contiguous(),
            labels=torch.stack([x["labels"] for x in items]),
            loss_mask=torch.stack([x["loss_mask"] for x in items]),
            num_image_tiles=torch.tensor([x["frames"].shape[0] for x in items], dtype=torch.int),
            sample_ids=torch.tensor([int(i) for i in positions]),
        )

    def step_batches(self, step: int) -> Iterator[VideoQABatch]:
        return iter([self.micro_batch(step, m) for m in range(self.num_microbatches)])

    def data_state(self, step=None) -> None:
        """Stateless resume : a micro-batch is a
        pure function of ``(data.seed, step, micro-batch, dp rank)``, so a run resumed at step
        ``k`` sees exactly the batches an uninterrupted one would; nothing to checkpoint."""
        return None

    def restore_data_state(self, text) -> None:
        if text is not None:
            raise ValueError(
                "checkpoint holds a data-loader state; video_llava's video_qa source "
                "is stateless (VideoQABatches.data_state) and cannot take one"
            )


class LanguageModelObjective:
    """Cross-entropy on the answer tokens; the model returns ``(per-token loss, local loss mask)``."""

    def __init__(self, cp_group):
        self.cp_group = cp_group

    def model_call(self, mb: VideoQABatch, first_stage: bool):
        args = (mb.images, mb.input_ids, mb.position_ids, None)
        return args, dict(
            labels=mb.labels, loss_mask=mb.loss_mask, num_image_tiles=mb.num_image_tiles
        )

    def loss(self, output: torch.Tensor, mb: VideoQABatch, loss_mask: torch.Tensor) -> torch.Tensor:
        from megatron_video.mmsp import global_token_loss

        return global_token_loss(output.float(), loss_mask, self.cp_group)
