"""MR-SP's model side for Qwen2.5-VL (``mmsp.qwen_vl.MMSPQwenVLModel``): what ``mmsp.rl`` needs to
roll out and score a prompt on it, beside ``video_llava``'s (``mmsp.rl``).

* ``encode_video``: one video ``(pixel_values_videos [t*h*w, C*2*p*p], video_grid_thw [3])``
  through transformers' vision tower + merger, this CP rank's temporal patches only (MM-SP stage
  1); the visual tokens are reused by the rollout prefill, the reference and the policy.
* ``llm_input``: prompt (+ response) ids, the video placeholders already expanded as the processor
  writes them, into the LLM's zigzag CP layout (stage 2) with the global 3-D M-RoPE ids
  (``models.qwen_vl.mrope_position_ids``, transformers' ``get_rope_index``) cut to this rank.
* ``text_offset``: decode positions. Past the prefix every token is text, and a text token after
  text sits at the previous token's id + 1 on all three axes (``get_rope_index``): a token at
  sequence index ``i >= P`` has t = h = w = ``i + offset``, ``offset`` the first response
  token's id - ``P`` (``mrope_position_ids`` of the prompt + one text token: after a prompt
  ending in text, the last token's id + 1; after a video the text restarts at the video's
  start + ``max(h, w) / merge``, below its last temporal id, so it is not the prefix's largest
  id + 1).
"""

from __future__ import annotations

import torch

from ..layouts.mmsp import frame_shards, reshard_plan
from ..models.qwen_vl.positions import mrope_position_ids, vision_token_counts
from ..parallel import comm
from .qwen_vl import combined_layout
from .sharding import MMSPBatch, reshard_to_llm

__all__ = ["is_qwen_vl", "cp_of", "encode_video", "llm_input", "text_offset", "check_prompt"]


def is_qwen_vl(model) -> bool:
    return getattr(model, "hf_config", None) is not None and hasattr(model, "visual")


def cp_of(model):
    """``(CP group, rank, size)``; at CP = 1 the language model's one-rank CP group."""
    group = getattr(model, "cp_group", None)  # None: CP = 1 (a plain QwenVLModel has none)
    group = group if group is not None else model.language_model.pg_collection.cp
    return group, group.rank(), model.cp_size


def _grid(video_grid_thw) -> tuple:
    grid = torch.as_tensor(video_grid_thw).reshape(-1).tolist()
    if len(grid) != 3:
        raise ValueError(f"video_grid_thw ({grid}) must be one video's (t, h, w)")
    return tuple(int(x) for x in grid)


def encode_video(model, video, grad: bool = False):
    """``video = (pixel_values_videos, video_grid_thw[, second_per_grid_t])`` of one video ->
    ``(visual tokens of this rank's temporal patches [n_local * h*w/4, hidden], temporal patches,
    (t, h, w), second_per_grid_t)``, the fields of ``rl.VideoTokens``. ``pixel_values_videos``
    holds every temporal patch's rows (``t*h*w``) or only this rank's (``n_local*h*w``: a loader
    decoding only its frames, ``training/qwen_vl_energon.py``); ``second_per_grid_t`` (None: 1 s)
    times the M-RoPE t ids as transformers' ``second_per_grid_ts``."""
    pv, grid_thw = video[:2]
    secs = float(video[2]) if len(video) > 2 and video[2] is not None else None
    t, h, w = _grid(grid_thw)
    _, rank, cp = cp_of(model)
    if t < cp:
        raise ValueError(
            f"video_grid_thw ({[t, h, w]}) temporal patches ({t}) must be >= "
            f"context_parallel_size ({cp}): every CP rank encodes a temporal patch"
        )
    mine = frame_shards([t], cp).local_units(rank)
    if pv.shape[0] not in (t * h * w, mine.numel() * h * w):
        raise ValueError(
            f"pixel_values_videos rows ({pv.shape[0]}) must equal t*h*w of video_grid_thw "
            f"({t * h * w}) or this CP rank's temporal patches' rows ({mine.numel() * h * w})"
        )
    units = pv.reshape(-1, h * w, pv.shape[-1])
    local = units if units.shape[0] < t else units.index_select(0, mine.to(pv.device))
    with torch.set_grad_enabled(grad):
        out = model._encode_units(local, (h, w))
    return out.reshape(-1, out.shape[-1]), t, (t, h, w), secs


def check_prompt(model, visual, prompt_ids) -> None:
    """``prompt_ids [1, T]`` with the video's placeholders (one video, expanded), no images."""
    cfg = model.hf_config
    n_vid = int((prompt_ids == cfg.video_token_id).sum())
    want = vision_token_counts(torch.tensor([visual.grid]), model.merge)[0]
    if (
        prompt_ids.dim() != 2
        or prompt_ids.shape[0] != 1
        or n_vid != want
        or bool((prompt_ids == cfg.image_token_id).any())
    ):
        raise ValueError(
            f"prompt_ids ({tuple(prompt_ids.shape)}, {n_vid} video tokens) must be [1, T] with "
            f"the video's {want} video tokens ({cfg.video_token_id}, expanded as the processor "
            f"writes them) and no image tokens"
        )


def _positions(model, visual, ids) -> torch.Tensor:
    grid = torch.tensor([visual.grid])
    secs = getattr(visual, "second_per_grid_t", None)
    secs = None if secs is None else [secs]
    return mrope_position_ids(ids.cpu(), model.hf_config, grid, second_per_grid_ts=secs)


def text_offset(model, visual, prompt_ids) -> int:
    """The first response token's M-RoPE id (all three axes) - ``P``: a text token at index
    ``i >= P`` sits at ``i +`` this on every axis (as ``mrope_position_ids`` of the longer
    sequence)."""
    P = prompt_ids.shape[1]
    ids = torch.cat([prompt_ids.cpu(), torch.full((1, 1), -1, dtype=prompt_ids.dtype)], 1)
    return int(_positions(model, visual, ids)[0, 0, P]) - P


def llm_input(model, visual, ids, prompt_len: int):
    """``(combined [s_local, 1, h] in the zigzag CP layout, MMSPBatch, M-RoPE ids [3, 1,
    s_local])`` of one sequence ``ids [1, T]`` (prompt + response). Response tokens
    (``ids[:, prompt_len:]``) are text whatever their id (a sampled video or image token id is
    its own embedding, as the decoding step embedded it), only the prompt's placeholders video."""
    group, rank, cp = cp_of(model)
    if cp > 1:
        comm.check_same_values({"input_ids": ids.long().cpu()}, group, "rl.qwen_vl")
    vid = model.hf_config.video_token_id
    marked = ids.clone()
    marked[:, prompt_len:] = -1  # text for the layout and the M-RoPE ids
    layout = combined_layout(marked, vid, cp)
    if layout.seq_len > model.language_model.max_sequence_length:  # before any collective
        raise ValueError(
            f"prompt + response ({ids.shape[1]} tokens, padded to {layout.seq_len}) must be <= "
            f"language_max_sequence_length ({model.language_model.max_sequence_length})"
        )
    t, h, w = visual.grid
    tpu = h * w // model.merge**2
    shards = frame_shards([t], cp)
    batch = MMSPBatch(shards, layout, reshard_plan(layout, shards, tpu, rank), tpu)
    text = model.language_model.embedding(
        input_ids=ids.masked_fill(marked == vid, 0), position_ids=None
    )
    text = text.transpose(0, 1).reshape(-1, text.shape[-1])
    combined = reshard_to_llm(visual.local.to(text.dtype), text, batch, group)
    pos = _positions(model, visual, marked)
    pos = torch.nn.functional.pad(pos, (0, layout.seq_len - pos.shape[-1]))
    local = pos[:, :, batch.plan.positions].to(text.device)
    return combined.transpose(0, 1).contiguous(), batch, local
