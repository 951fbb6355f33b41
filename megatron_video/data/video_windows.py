"""Raw-frame windows to SP ranks (``read_window`` per rank, or ``scatter_windows`` from a loading
rank in one collective), and halo encoding of a window to exactly the rank's latents
(``encode_with_halo``, ``encode_rank_latents``). Windows: ``layouts.vae_halo``; design:
docs/architecture.md, "Capabilities" 2.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from ..layouts.balanced_sp import BalancedSPLayout
from ..layouts.vae_halo import HaloWindow, halo_window
from ..models.vae_halo_probe import Encoder, encoder_halo, resolve_halo
from ..ops.halo import halo_scatter
from ..parallel import comm

__all__ = [
    "TensorFrameSource",
    "read_window",
    "rank_windows",
    "scatter_windows",
    "encode_with_halo",
    "encode_window",
    "encode_rank_latents",
]

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.uint8]
_HEADER = 8  # [status, dtype code, ndim, *shape (<= 5)]


class TensorFrameSource:
    """A ``FrameSource`` over an in-memory video; records every ``read`` (to show what was read)."""

    def __init__(self, video: torch.Tensor, time_dim: int = 2):
        self.video, self.time_dim = video, time_dim % video.dim()
        self.reads: List[tuple] = []

    @property
    def num_frames(self) -> int:
        return self.video.shape[self.time_dim]

    def read(self, start: int, end: int) -> torch.Tensor:
        self.reads.append((start, end))
        return self.video.narrow(self.time_dim, start, end - start)


def read_window(source, meta: HaloWindow) -> torch.Tensor:
    """This rank's raw window read directly from ``source`` (no other frames are touched).

    The preferred path: every rank reads only its window from the dataset (a ``FrameSource``:
    anything with ``num_frames`` and ``read(start, end)``).
    """
    if meta.raw_end > source.num_frames:
        raise ValueError(
            f"window raw_end ({meta.raw_end}) exceeds the source's num_frames ({source.num_frames})"
        )
    return source.read(meta.raw_start, meta.raw_end)


def rank_windows(
    layout: BalancedSPLayout,
    rank: int,
    halo_latents: Optional[int] = None,
    temporal_stride: int = 4,
    causal_first_frame: bool = True,
    encoder: Optional[Encoder] = None,
) -> List[HaloWindow]:
    """One halo window per contiguous frame segment of ``rank`` (in local frame order); the halo
    is derived from ``encoder`` when ``halo_latents`` is None (see ``models.vae_halo_probe.resolve_halo``)."""
    h = resolve_halo(halo_latents, encoder, temporal_stride, causal_first_frame)
    return [
        halo_window(a, b, h, temporal_stride, causal_first_frame, rank=rank)
        for a, b in layout.rank_segments(rank)
    ]


def _as_list(w: Union[HaloWindow, Sequence[HaloWindow]]) -> List[HaloWindow]:
    return [w] if isinstance(w, HaloWindow) else list(w)


def scatter_windows(
    video: Optional[torch.Tensor],
    windows: Sequence[Union[HaloWindow, Sequence[HaloWindow]]],
    group,
    src: int = 0,
    time_dim: int = 2,
    tag: str = "video_windows",
) -> List[torch.Tensor]:
    """Deliver each SP rank its raw windows from the loading rank ``src`` (group rank).

    ``video`` (full raw video, ``[B, C, T, H, W]`` by default) is needed on ``src`` only;
    ``windows[i]`` is group rank ``i``'s window (or list of windows), known on every rank. Returns
    this rank's windows. A bad video on ``src`` raises ``ValueError`` on every rank (the status
    travels in the header, so nobody waits on a collective that will not come).

    A small header broadcast tells every rank the video's shape and dtype (shapes are exchanged
    explicitly, never assumed), ``ops.halo_scatter`` (C++ when built) cuts every rank's windows out
    in one pass, and one scatter delivers each rank its packed windows, padded to a common length.
    """
    n, me = comm.group_size(group), comm.group_rank(group)
    if len(windows) != n:
        raise ValueError(f"windows has {len(windows)} entries; must have one per group rank ({n})")
    mine = [_as_list(w) for w in windows]
    need_t = max(w.raw_end for ws in mine for w in ws)
    header = torch.zeros(_HEADER, dtype=torch.int64)
    if me == src:
        if video is None:
            header[0] = 1
        elif video.dim() not in (4, 5) or video.dtype not in _DTYPES:
            header[0] = 2
        else:
            header[1], header[2] = _DTYPES.index(video.dtype), video.dim()
            header[3 : 3 + video.dim()] = torch.tensor(video.shape)
            if video.shape[time_dim] < need_t:
                header[0] = 3
    comm.broadcast(header, group, src, tag=tag + ".header")
    status = int(header[0])
    if status:
        why = {
            1: "no video on the loading rank",
            2: f"video must have 4 or 5 dims and a dtype in {_DTYPES}",
            3: f"the video has fewer frames than the windows need ({need_t})",
        }[status]
        raise ValueError(f"scatter_windows (src {src}): {why}")
    dtype, ndim = _DTYPES[int(header[1])], int(header[2])
    shape = [int(s) for s in header[3 : 3 + ndim]]
    td = time_dim % ndim
    layout = _halo_layout(ndim, td)
    # every window, ranks in order, cut out in one pass by ops.halo_scatter (C++ when built); the
    # flat chunk of a rank is its windows back to back, zero-padded to the largest rank's size
    flat_windows = [(w.raw_start, w.raw_end) for ws in mine for w in ws]
    frame_elems = 1
    for i, d in enumerate(shape):
        frame_elems *= d if i != td else 1
    sizes = [[w.num_raw * frame_elems for w in ws] for ws in mine]
    chunk = max(sum(s) for s in sizes)
    out = torch.empty(chunk, dtype=dtype)
    chunks = None
    if me == src:
        x = video if ndim == 5 else video.unsqueeze(0)
        packed = halo_scatter(x.detach(), flat_windows, layout)
        chunks, i = [], 0
        for ws, sz in zip(mine, sizes):
            part = packed.buffer.narrow(0, int(packed.offsets[i]), sum(sz))
            i += len(ws)
            pad = chunk - sum(sz)
            chunks.append(torch.cat([part, part.new_zeros(pad)]) if pad else part)
    comm.scatter(chunks, out, group, src, tag=tag)
    result = []
    for w, part in zip(mine[me], out.narrow(0, 0, sum(sizes[me])).split(sizes[me])):
        wshape = list(shape)
        wshape[td] = w.num_raw
        result.append(part.view(wshape))
    return result


def _halo_layout(ndim: int, td: int) -> str:
    """The ``ops.halo_scatter`` layout of a ``ndim``-D video with time at ``td`` (4-D: ``[C, T, H, W]``)."""
    if ndim == 5 and td in (1, 2):
        return "bcthw" if td == 2 else "btchw"
    if ndim == 4 and td == 1:
        return "bcthw"
    raise ValueError(
        f"time_dim ({td}) of a {ndim}-D video must be 2 ([B, C, T, H, W]) or 1 "
        f"([B, T, C, H, W] or [C, T, H, W])"
    )


def encode_with_halo(
    encoder: Encoder, window: torch.Tensor, meta: HaloWindow, time_dim: int = 2
) -> torch.Tensor:
    """Encode a raw window and return exactly the rank's kept latents ``[ls, le)``.

    ``encoder``: a module or a callable (``lambda x: vae.encode(x).latent_dist.mean``); its halo
    comes from declared causal ops or, for anything else, a cached probe
    (``models.vae_halo_probe.encoder_halo``).

    Raises ``ValueError`` if ``meta.halo_latents`` is below the encoder's temporal receptive field
    (on every rank alike, whether or not its own window reaches the video start), or if the window or
    the encoder output do not match ``meta``.
    """
    need = encoder_halo(
        encoder, temporal_stride=meta.temporal_stride, causal_first_frame=meta.causal_first_frame
    )
    if meta.halo_latents < need:
        raise ValueError(
            f"halo_latents ({meta.halo_latents}) must be >= the encoder's temporal "
            f"receptive field ({need} latents)"
        )
    return encode_window(encoder, window, meta, time_dim)


def encode_window(
    encoder: Encoder, window: torch.Tensor, meta: HaloWindow, time_dim: int = 2
) -> torch.Tensor:
    """``encode_with_halo`` with the halo taken as given (chosen by the caller, e.g.
    ``training.vae_halo.choose_halo``: a user's ``vae.halo_latents``, or none needed at SP 1)."""
    if window.shape[time_dim] != meta.num_raw:
        raise ValueError(
            f"window has {window.shape[time_dim]} frames along dim {time_dim}; the meta "
            f"window [{meta.raw_start}, {meta.raw_end}) has {meta.num_raw}"
        )
    out = encoder(window)
    if out.shape[time_dim] != meta.num_window_latents:
        raise ValueError(
            f"encoder produced {out.shape[time_dim]} latents for a {meta.num_raw}-frame "
            f"window; expected drop ({meta.drop}) + kept ({meta.num_kept})"
        )
    return out.narrow(time_dim, meta.drop, meta.num_kept)


def encode_rank_latents(
    encoder: Encoder,
    windows: Sequence[torch.Tensor],
    metas: Sequence[HaloWindow],
    time_dim: int = 2,
) -> torch.Tensor:
    """Encode each of a rank's windows with its halo and concatenate: the rank's latents in local
    frame order."""
    if len(windows) != len(metas):
        raise ValueError(f"windows ({len(windows)}) and metas ({len(metas)}) must pair up")
    return torch.cat(
        [encode_with_halo(encoder, w, m, time_dim) for w, m in zip(windows, metas)], dim=time_dim
    )
