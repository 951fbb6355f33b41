"""A generated video's files and the streamed request's checks: ``VideoSink`` (each finished AR
block VAE-decoded and appended to an mp4, a GIF at the end captioned with the prompt in force at
each frame), ``write_gif`` (also ``train.sample``'s GIF), ``stream_video`` (the timed block loop of
``megatron-video generate``), and the checks of its options (``raw_frames_to_latent``,
``parse_switch``, ``latent_switches``, ``check_window``), each a ``ValueError`` naming the option.
Design: docs/generation.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable, List, Sequence, Tuple, Union

import numpy as np
import torch

from megatron_video.models.vae import TEMPORAL_STRIDE

from .generator import SampleSpec

__all__ = [
    "VideoSink",
    "write_gif",
    "video_to_frames",
    "stream_video",
    "raw_frames_to_latent",
    "parse_switch",
    "latent_switches",
    "check_window",
]


def video_to_frames(video: torch.Tensor, scale: int = 4) -> List[np.ndarray]:
    """``[3, T, H, W]`` in ``[-1, 1]`` -> T uint8 frames ``[H*scale, W*scale, 3]``."""
    v = ((video.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    v = v.permute(1, 2, 3, 0).numpy()  # [T, H, W, 3]
    return [np.kron(f, np.ones((scale, scale, 1), dtype=np.uint8)) for f in v]


def write_gif(
    path,
    videos: Sequence[torch.Tensor],
    labels: Sequence[Union[str, Sequence[str]]] = (),
    scale: int = 4,
    fps: int = 8,
) -> Path:
    """Side-by-side GIF of equally long videos ``[3, T, H, W]``, a caption strip above each: a
    label is one string, or one per frame (e.g. the prompt in force at each frame)."""
    from PIL import Image, ImageDraw

    columns = [video_to_frames(v, scale) for v in videos]
    T = min(len(c) for c in columns)
    h, w = columns[0][0].shape[:2]
    pad, strip = 4, 14
    frames = []
    for t in range(T):
        canvas = Image.new(
            "RGB", (len(columns) * (w + pad) + pad, h + strip + 2 * pad), (24, 24, 24)
        )
        draw = ImageDraw.Draw(canvas)
        for i, col in enumerate(columns):
            x = pad + i * (w + pad)
            canvas.paste(Image.fromarray(col[t]), (x, strip + pad))
            if i < len(labels):
                label = labels[i] if isinstance(labels[i], str) else labels[i][t]
                draw.text((x, 2), label, fill=(230, 230, 230))
        frames.append(canvas)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return Path(path)


def raw_frames_to_latent(frames: int, frames_per_block: int, option: str = "--frames") -> int:
    """Latent frames of a video of ``frames`` raw frames (causal VAE: ``1 + 4 (F - 1)``), a whole
    number of AR blocks; ``ValueError`` naming ``option`` otherwise."""
    F, rest = divmod(frames - 1, TEMPORAL_STRIDE)
    F += 1
    if not isinstance(frames, int) or frames < 1 or rest or F % frames_per_block:
        step = TEMPORAL_STRIDE * frames_per_block
        raise ValueError(
            f"{option} ({frames}) must be 1 + {TEMPORAL_STRIDE} (F - 1) raw frames with F latent "
            f"frames a whole number of blocks of {frames_per_block} (e.g. "
            f"{1 + TEMPORAL_STRIDE * (frames_per_block - 1)}, "
            f"{1 + TEMPORAL_STRIDE * (frames_per_block - 1) + step}, ...)"
        )
    return F


def parse_switch(text: str) -> Tuple[int, str]:
    """``"FRAME:PROMPT"`` of ``--switch`` -> ``(raw frame, prompt)``."""
    frame, sep, prompt = text.partition(":")
    if not sep or not frame.strip().isdigit() or not prompt.strip():
        raise ValueError(f"--switch ({text!r}) must be FRAME:PROMPT with FRAME a raw frame index")
    return int(frame), prompt.strip()


def latent_switches(
    switches: Iterable[Tuple[int, str]], frames: int, frames_per_block: int
) -> List[Tuple[int, str]]:
    """``--switch`` ``(raw frame, prompt)`` pairs -> ``(latent frame, prompt)``: each raw frame
    must start a block inside the ``frames`` raw frames of the video."""
    nb, F = frames_per_block, raw_frames_to_latent(frames, frames_per_block)
    out = []
    for raw, prompt in switches:
        lat, rest = divmod(raw - 1, TEMPORAL_STRIDE)
        if raw < 1 or rest or (lat + 1) % nb or not 0 < lat + 1 < F:
            raise ValueError(
                f"--switch ({raw}:...) frame must be a raw frame that starts a block inside the "
                f"video: 1 + {TEMPORAL_STRIDE} k with latent frame k a positive multiple of "
                f"{nb} below {F} (--frames {frames})"
            )
        out.append((lat + 1, prompt))
    return out


def check_window(nb: int, sink, window) -> None:
    """``--sink`` / ``--window``: whole blocks (``streaming.WindowRule``'s rule, named as the
    options), checked before the model is built."""
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0 or sink % nb:
        raise ValueError(
            f"--sink ({sink!r}) must be a non-negative multiple of model.frames_per_block ({nb}) "
            f"latent frames (the sink is whole blocks)"
        )
    bad = isinstance(window, bool) or not isinstance(window, int) or window < 0 or window % nb
    if window is not None and bad:
        raise ValueError(
            f"--window ({window!r}) must be a non-negative multiple of model.frames_per_block "
            f"({nb}) latent frames (the window is whole blocks), or unset (the trained length)"
        )


class VideoSink:
    """The logging rank's output: each finished block VAE-decoded (given all latents before it:
    the causal decoder's frames depend on them) and appended to an mp4 (libx264); a GIF at the
    end, captioned with the prompt in force at each frame (``switches``: ``(raw frame, prompt)``).
    ``spec``: the blocks' token grid; ``decode(latents [1, z, F, h, w]) -> video [1, 3, T, H, W]``
    in ``[-1, 1]``. ``add(j, block tokens)``; ``close() -> (mp4, gif, frames written, captions,
    tokens)``."""

    def __init__(self, output: str, spec: SampleSpec, decode, prompt: str, switches=(), fps=8):
        import av

        self.out, self.spec, self.decode, self.prompt = Path(output), spec, decode, prompt
        self.switches = sorted(switches)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tokens, self.frames = [], []
        self._c = av.open(str(self.out.with_suffix(".mp4")), "w")
        self._st = self._c.add_stream("libx264", rate=fps)
        self._st.pix_fmt = "yuv420p"

    def add(self, j: int, block: torch.Tensor) -> None:
        import av

        from megatron_video.models.embedders import unpatchify

        s = self.spec
        nb, (_, Hp, Wp) = s.frames_per_block, s.token_grid
        self.tokens.append(block.cpu())
        grid = ((j + 1) * nb, Hp, Wp)
        tokens = torch.cat(self.tokens, dim=1)
        video = self.decode(unpatchify(tokens, tuple(s.patch_size), grid, s.latent_channels))[0]
        video = video[:, 0 if j == 0 else 1 + TEMPORAL_STRIDE * (j * nb - 1) :]
        if j == 0:
            self._st.height, self._st.width = video.shape[-2:]
        v = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        for t in range(v.shape[1]):
            self.frames.append(video[:, t])
            img = v[:, t].permute(1, 2, 0).contiguous().numpy()
            for pkt in self._st.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                self._c.mux(pkt)

    def close(self) -> dict:
        for pkt in self._st.encode():
            self._c.mux(pkt)
        self._c.close()
        gif = self.out.with_suffix(".gif")
        captions = [
            ([self.prompt] + [p for f, p in self.switches if f <= t])[-1]
            for t in range(len(self.frames))
        ]
        write_gif(gif, [torch.stack(self.frames, dim=1)], labels=[captions])
        return dict(
            mp4=str(self.out.with_suffix(".mp4")),
            gif=str(gif),
            written_frames=len(self.frames),
            captions=captions,
            tokens=torch.cat(self.tokens, dim=1),
        )


def stream_video(blocks, num_blocks: int, frames_per_block: int, sink=None, log: Callable = print):
    """Run the block iterator ``blocks`` (``Generator.ar_blocks``; no grad), each block into
    ``sink`` (``VideoSink``; None on the ranks that do not write) with its time logged. Returns
    the per-block seconds."""
    nb, times, t0 = frames_per_block, [], time.time()
    with torch.no_grad():
        for j, block, _ in blocks:
            times.append(time.time() - t0)
            if sink is not None:
                sink.add(j, block)
                log(
                    f"[megatron-video] block {j + 1}/{num_blocks} (latent frames {j * nb}-"
                    f"{(j + 1) * nb - 1}): {times[-1]:.2f} s"
                )
            t0 = time.time()
    return times
