"""Qwen2.5-VL's 3-D M-RoPE position ids, computed globally on the whole (unsharded) batch.

Text tokens advance all three axes together; the merged tokens of a video of grid ``(t, h, w)``
(patches) get ``(start + floor(k * interval), start + i, start + j)`` for temporal patch ``k`` and
merged row / column ``i, j`` (``interval = tokens_per_second * second_per_grid_t``, 1 for images),
and the next text token starts at ``start + max(h, w) / merge``. The same rule as transformers'
``Qwen2_5_VLModel.get_rope_index`` (tests compare the two), written over token runs: a run of
placeholder tokens may hold several consecutive videos, each consuming its grid's token count.
Under CP each rank cuts the global ids to its zigzag positions (``models.qwen_vl.model``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

__all__ = ["mrope_position_ids", "vision_token_counts"]


def vision_token_counts(grid_thw: Optional[torch.Tensor], merge: int) -> List[int]:
    """Merged tokens of each ``(t, h, w)`` grid entry: ``t * h * w / merge**2``."""
    if grid_thw is None:
        return []
    return [int(t) * int(h) * int(w) // (merge * merge) for t, h, w in grid_thw.tolist()]


def _vision_ids(start: int, grid, merge: int, interval: float) -> torch.Tensor:
    t, h, w = (int(x) for x in grid)
    h, w = h // merge, w // merge
    tt = (torch.arange(t, dtype=torch.float64) * interval).long()
    tt = tt[:, None, None].expand(t, h, w)
    hh = torch.arange(h)[None, :, None].expand(t, h, w)
    ww = torch.arange(w)[None, None, :].expand(t, h, w)
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def _runs(row: torch.Tensor, kinds: Sequence[int]):
    """``(kind, start, end)`` of maximal runs of equal token kind (0 text) in ``row``."""
    out, s = [], 0
    vals = row.tolist()
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[s]:
            out.append((kinds[vals[s]], s, i))
            s = i
    return out


def mrope_position_ids(
    input_ids: torch.Tensor,
    hf_config,
    video_grid_thw: Optional[torch.Tensor] = None,
    image_grid_thw: Optional[torch.Tensor] = None,
    second_per_grid_ts: Optional[Sequence[float]] = None,
) -> torch.Tensor:
    """``[3, batch, text_len]`` position ids of ``input_ids`` (placeholders already expanded, as
    the processor writes them). Grids are consumed in row-major order of their placeholders."""
    vc = hf_config.vision_config
    merge, tps = int(vc.spatial_merge_size), float(vc.tokens_per_second)
    ids = input_ids.detach().cpu().long()
    kind = torch.zeros_like(ids)
    kind[ids == hf_config.image_token_id] = 1
    kind[ids == hf_config.video_token_id] = 2
    grids = {
        1: list(image_grid_thw.tolist()) if image_grid_thw is not None else [],
        2: list(video_grid_thw.tolist()) if video_grid_thw is not None else [],
    }
    secs = list(second_per_grid_ts) if second_per_grid_ts is not None else None
    used = {1: 0, 2: 0}
    out = torch.zeros(3, *ids.shape, dtype=torch.long)
    for b in range(ids.shape[0]):
        pos, parts = 0, []
        for k, s, e in _runs(kind[b], (0, 1, 2)):
            if k == 0:
                parts.append(torch.arange(e - s).expand(3, -1) + pos)
                pos += e - s
                continue
            n = e - s
            while n > 0:
                name = "video_grid_thw" if k == 2 else "image_grid_thw"
                if used[k] >= len(grids[k]):
                    raise ValueError(
                        f"{name} ({len(grids[k])} entries) has fewer entries than the "
                        f"placeholder runs of input_ids need (row {b})"
                    )
                g = grids[k][used[k]]
                cnt = vision_token_counts(torch.tensor([g]), merge)[0]
                if cnt > n:
                    raise ValueError(
                        f"{name}[{used[k]}] ({g}) needs {cnt} placeholder tokens; the run of "
                        f"input_ids row {b} at {e - n} has {n} left"
                    )
                interval = tps * float(secs[used[k]] if secs is not None else 1.0) if k == 2 else 1
                parts.append(_vision_ids(pos, g, merge, interval))
                pos += max(int(g[1]), int(g[2])) // merge
                used[k] += 1
                n -= cnt
        out[:, b] = torch.cat(parts, dim=1) if parts else out[:, b]
    for k, name in ((1, "image_grid_thw"), (2, "video_grid_thw")):
        if used[k] != len(grids[k]):
            raise ValueError(
                f"{name} ({len(grids[k])} entries) must have one entry per placeholder run of "
                f"input_ids ({used[k]} used)"
            )
    return out
