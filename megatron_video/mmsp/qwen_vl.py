"""MM-SP on Qwen2.5-VL: ``MMSPQwenVLModel`` (``models.qwen_vl.QwenVLModel`` under context
parallelism, exact in outputs and gradients). Design: docs/mmsp.md, "Qwen2.5-VL".

Stage 1: each CP rank runs transformers' vision tower + merger on its share of every video's
temporal patches (``layouts.mmsp.frame_shards``; a temporal patch is an independent unit because
transformers masks vision attention per temporal patch, ``models.qwen_vl.model``). Stage 2: the
expanded ``input_ids`` are the combined sequence; each rank builds its zigzag shard -- text rows
from its own embedding lookup, visual rows through one autograd all-to-all-v
(``sharding.reshard_to_llm``) -- and cuts the global 3-D M-RoPE ids and the labels to it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layouts.mmsp import SequenceLayout, frame_shards, reshard_plan
from ..models.qwen_vl.model import IGNORE_INDEX, QwenVLModel, shift_labels
from ..parallel import comm
from .sharding import MMSPBatch, encode_local, reshard_to_llm

__all__ = ["MMSPQwenVLModel", "combined_layout"]


def combined_layout(input_ids: torch.Tensor, video_token_id: int, cp_size: int) -> SequenceLayout:
    """The combined sequence of expanded ``input_ids`` ``[b, T]`` (every placeholder is one visual
    token), padded to a multiple of ``2 * cp_size``."""
    B, T = input_ids.shape
    S = -(-T // (2 * cp_size)) * (2 * cp_size)
    is_vid = (input_ids == video_token_id).cpu()
    rows = torch.arange(B)[:, None].expand(B, T)
    cols = torch.arange(T)[None].expand(B, T)
    return SequenceLayout(
        B,
        T,
        S,
        torch.full((B,), T, dtype=torch.long),
        cp_size,
        (rows * T + cols)[~is_vid],
        (rows * S + cols)[~is_vid],
        (rows * S + cols)[is_vid],
    )


class MMSPQwenVLModel(QwenVLModel):
    """``QwenVLModel`` with MM-SP over the CP group (``config.context_parallel_size``, 2D
    attention's ``cp_comm_type``); at CP = 1 it is ``QwenVLModel``. Under CP every video needs
    at least CP temporal patches and the videos of a micro-batch one spatial grid (``ValueError``
    before any collective otherwise). ``forward`` returns this rank's logits / per-token loss on
    its zigzag positions (``last_mmsp_batch.plan.positions``); normalise a loss over the global
    target count (``mmsp.global_token_loss``)."""

    supports_context_parallel = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cp_group = self._cp_group() if self.cp_size > 1 else None
        self.last_mmsp_batch: Optional[MMSPBatch] = None

    def _cp_group(self):
        pgs = getattr(self.language_model, "pg_collection", None)
        if pgs is not None and getattr(pgs, "cp", None) is not None:
            return pgs.cp
        from megatron.core import parallel_state as ps

        return ps.get_context_parallel_group()

    def _check_cp_videos(self, video_grid_thw):
        """Under CP every video has >= CP temporal patches and all share one (h, w)."""
        for j, (t, h, w) in enumerate(video_grid_thw.tolist()):
            if t < self.cp_size:
                raise ValueError(
                    f"video_grid_thw[{j}] temporal patches ({t}) must be >= "
                    f"context_parallel_size ({self.cp_size}): every CP rank encodes at least one "
                    f"temporal patch of every video"
                )
            if (h, w) != tuple(video_grid_thw[0, 1:].tolist()):
                raise ValueError(
                    f"video_grid_thw[{j}] (h, w) ({h}, {w}) must equal video_grid_thw[0]'s "
                    f"({tuple(video_grid_thw[0, 1:].tolist())}) under context parallelism"
                )

    def _local_pixel_rows(self, video_grid_thw):
        """Rows of this rank's temporal patches (``frame_shards``): a loader that decodes only
        this rank's frames (``data.qwen_video_qa``) hands ``pixel_values_videos`` of those."""
        if self.cp_size == 1 or video_grid_thw is None or not len(video_grid_thw):
            return None
        self._check_cp_videos(video_grid_thw)
        shards = frame_shards([int(t) for t in video_grid_thw[:, 0].tolist()], self.cp_size)
        hw = int(video_grid_thw[0, 1] * video_grid_thw[0, 2])
        return int(shards.local_units(self.cp_group.rank()).numel()) * hw

    def plan(self, input_ids, video_grid_thw) -> MMSPBatch:
        """This rank's MM-SP plan: temporal patches over the CP group, the combined sequence in
        the zigzag layout; the ranks check that they hold the same ``input_ids`` and grids."""
        N = self.cp_size
        layout = combined_layout(input_ids, self.hf_config.video_token_id, N)
        grid = video_grid_thw.cpu() if video_grid_thw is not None else torch.zeros(0, 3)
        tpu = int(grid[0, 1] * grid[0, 2]) // self.merge**2 if len(grid) else 1
        shards = frame_shards([int(t) for t in grid[:, 0].tolist()], N)
        comm.check_same_values(
            {"input_ids": input_ids.long().cpu(), "video_grid_thw": grid.long()},
            self.cp_group,
            "qwen_vl.plan",
        )
        rank = self.cp_group.rank()
        return MMSPBatch(shards, layout, reshard_plan(layout, shards, tpu, rank), tpu)

    def decoder_input(self, input_ids, pixel_values_videos, video_grid_thw, positions):
        """(decoder input ``[s_local, b, h]``, M-RoPE ids ``[3, b, s_local]``) of this rank."""
        if self.cp_size == 1:
            return super().decoder_input(input_ids, pixel_values_videos, video_grid_thw, positions)
        if video_grid_thw is not None:
            self._check_cp_videos(video_grid_thw)
        batch = self.plan(input_ids, video_grid_thw)
        self.last_mmsp_batch = batch
        h = self.config.hidden_size
        if video_grid_thw is not None and len(video_grid_thw):
            hw = [int(x) for x in video_grid_thw[0, 1:].tolist()]
            # every unit's rows, or only this rank's (a loader decoding only its frames)
            units = pixel_values_videos.reshape(-1, hw[0] * hw[1], pixel_values_videos.shape[-1])
            visual = encode_local(lambda u: self._encode_units(u, hw), units, batch)
        else:
            visual = torch.zeros(0, h, dtype=self.config.params_dtype)
        text = self._text_embeddings(input_ids)
        text = text.transpose(0, 1).reshape(-1, text.shape[-1])
        combined = reshard_to_llm(visual.to(text.dtype), text, batch, self.cp_group)
        pad = batch.layout.seq_len - positions.shape[-1]
        positions = torch.nn.functional.pad(positions, (0, pad))
        local = positions[:, :, batch.plan.positions.to(positions.device)]
        return combined.transpose(0, 1).contiguous(), local

    def local_labels(self, labels: torch.Tensor, batch: Optional[MMSPBatch] = None):
        """Megatron's shifted labels, under CP padded with ``IGNORE_INDEX`` and cut to this rank's
        zigzag positions (``batch``: default ``last_mmsp_batch``)."""
        lab = shift_labels(labels)
        batch = batch if batch is not None else self.last_mmsp_batch
        if self.cp_size == 1 or batch is None:
            return lab
        pad = batch.layout.seq_len - lab.shape[1]
        lab = torch.nn.functional.pad(lab, (0, pad), value=IGNORE_INDEX)
        return lab[:, batch.plan.positions.to(lab.device)].contiguous()
