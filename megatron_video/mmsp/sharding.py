"""MM-SP runtime: stage 1 (this rank's frames through the encoder) and stage 2 (one autograd
all-to-all-v of the visual tokens into the LLM's zigzag CP layout), plus the global-token loss.

The index maps are ``layouts.mmsp`` (pure); the only collective on the data path is
``parallel.comm.all_to_all_v`` (counts exchanged first, backward = the inverse exchange), so the
encoder and projector of every rank receive exactly the gradient of the tokens they produced --
unlike an all-reduce into a zero-filled buffer, which autograd does not see through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..layouts.mmsp import (
    FrameShards,
    ReshardPlan,
    SequenceLayout,
    frame_shards,
    reshard_plan,
    sequence_layout,
)
from ..parallel import comm

__all__ = ["MMSPBatch", "plan_batch", "encode_local", "reshard_to_llm", "global_token_loss"]


@dataclass(frozen=True)
class MMSPBatch:
    """Everything one rank needs to run MM-SP on a micro-batch (built by ``plan_batch``)."""

    shards: FrameShards
    layout: SequenceLayout
    plan: ReshardPlan
    tokens_per_unit: int


def plan_batch(
    input_ids: torch.Tensor,
    num_frames: Sequence[int],
    image_token_index: int,
    tokens_per_unit: int,
    cp_rank: int,
    cp_size: int,
    tubelet_size: int = 1,
    seq_len: Optional[int] = None,
    group=None,
) -> MMSPBatch:
    """Stage-1 shards, the combined layout and this rank's re-shard plan for one micro-batch.

    ``num_frames[i]`` belongs to the ``i``-th image token of ``input_ids`` (row-major). Input
    errors raise ``ValueError`` on every rank before any collective; with ``group`` the ranks also
    check that they hold the same ``input_ids`` and ``num_frames`` (one small all-gather), since
    those decide where every token goes.
    """
    frames = [int(f) for f in num_frames]
    n_img = int((input_ids == image_token_index).sum())
    if len(frames) != n_img:
        raise ValueError(
            f"num_frames / num_image_tiles ({len(frames)} videos) must have one entry per "
            f"image token (image_token_index {image_token_index}) in input_ids ({n_img})"
        )
    shards = frame_shards(frames, cp_size, tubelet_size)
    layout = sequence_layout(
        input_ids,
        image_token_index,
        [f // tubelet_size * tokens_per_unit for f in frames],
        cp_size,
        seq_len,
    )
    if group is not None:
        comm.check_same_values(
            {"input_ids": input_ids.long(), "num_frames": torch.tensor(frames, dtype=torch.long)},
            group,
            "mmsp.plan_batch",
        )
    return MMSPBatch(
        shards, layout, reshard_plan(layout, shards, tokens_per_unit, cp_rank), tokens_per_unit
    )


def encode_local(
    encoder: Callable[[torch.Tensor], torch.Tensor], units: torch.Tensor, batch: MMSPBatch
) -> torch.Tensor:
    """Stage 1: ``encoder`` on this rank's units only.

    ``units [total_units, ...]`` are all the micro-batch's units, or only this rank's
    ``units[batch.shards.local_units(rank)]`` (a data loader that decodes only this rank's frames,
    e.g. ``data.qwen_video_qa``); ``encoder(local_units)`` must return ``[n_local,
    tokens_per_unit, h]`` and treat units independently. Returns this rank's visual tokens
    ``[n_local * tokens_per_unit, h]``.
    """
    idx = batch.shards.local_units(batch.plan.rank)
    if units.shape[0] == batch.shards.total_units:
        local = units.index_select(0, idx.to(units.device))
    elif units.shape[0] == idx.numel():
        local = units
    else:
        raise ValueError(
            f"units ({units.shape[0]}) must hold every unit of the micro-batch "
            f"({batch.shards.total_units} = sum(num_frames) / tubelet_size) or this rank's "
            f"({idx.numel()})"
        )
    out = encoder(local)
    if out.dim() != 3 or out.shape[:2] != (local.shape[0], batch.tokens_per_unit):
        raise ValueError(
            f"encoder output ({tuple(out.shape)}) must be [n_local ({local.shape[0]}), "
            f"tokens_per_unit ({batch.tokens_per_unit}), hidden]"
        )
    return out.reshape(-1, out.shape[-1])


def reshard_to_llm(
    local_visual: torch.Tensor, text_embeddings: torch.Tensor, batch: MMSPBatch, group
) -> torch.Tensor:
    """Stage 2: this rank's LLM input ``[batch, local_len, h]`` (zigzag layout).

    ``local_visual [n_local_tokens, h]`` (from ``encode_local``), ``text_embeddings
    [batch * text_len, h]`` (the embedded ``input_ids``, flattened batch-major; only the rows this
    rank holds are used). One autograd all-to-all-v over ``group`` moves the visual tokens.
    """
    plan, layout = batch.plan, batch.layout
    h = text_embeddings.shape[-1]
    if local_visual.shape[-1] != h:
        raise ValueError(
            f"visual tokens ({tuple(local_visual.shape)}) and text embeddings "
            f"({tuple(text_embeddings.shape)}) must have the same hidden size"
        )
    send = local_visual.index_select(0, plan.send_index.to(local_visual.device))
    recv = comm.all_to_all_v(
        send, plan.send_counts, group, tag="mmsp.reshard", expect_recv_counts=plan.recv_counts
    )
    text = text_embeddings.index_select(0, plan.text_index.to(text_embeddings.device))
    rows = torch.cat([text.new_zeros(1, h), text, recv.to(text.dtype)])
    return rows.index_select(0, plan.gather.to(rows.device)).view(layout.batch, layout.local_len, h)


def global_token_loss(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor, group, tag: str = "mmsp.loss"
) -> torch.Tensor:
    """This rank's share of the loss averaged over the *global* number of target tokens:
    ``sum(local loss * mask) / sum over the group of sum(mask)``. Summed over the group (as
    gradient reduction does) it is the single-process mean, whatever each rank's token count."""
    mask = loss_mask.to(per_token_loss.dtype)
    count = mask.sum().detach().reshape(1).clone()
    if group is not None:
        comm.all_reduce(count, group, tag=tag)
    return (per_token_loss * mask).sum() / count.clamp(min=1)[0]
