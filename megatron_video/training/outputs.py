"""Run outputs: ``metrics.json``, ``loss.png`` (matplotlib) and ``sample.gif`` (pillow)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Sequence, Union

import numpy as np
import torch

__all__ = ["write_metrics", "plot_loss", "write_gif", "video_to_frames"]


def write_metrics(path, metrics: Dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(metrics, indent=2, default=float))
    os.replace(tmp, path)
    return path


def plot_loss(
    path,
    steps: Sequence[int],
    losses: Sequence[float],
    title: str = "training loss",
    quantity: str = "loss",
) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label=quantity)
    if len(losses) >= 10:  # a moving average shows the trend through the noise of tiny batches
        k = max(5, len(losses) // 20)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(list(steps)[k - 1 :], smooth, lw=2, label=f"mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel(quantity)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


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
