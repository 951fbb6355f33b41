"""Run outputs: ``metrics.json`` and ``loss.png`` (matplotlib); the GIFs: ``generation.video_out``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Sequence

import numpy as np

__all__ = ["write_metrics", "plot_loss"]


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
