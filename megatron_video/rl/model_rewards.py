"""Rewards from models in local folders (nothing downloads): the interface and a CLIP-style
video-text scorer.

A model reward is an object that loads once per process and is called as any reward (``fn(latents,
**sample) -> [G]``, ``rl.rewards``). ``rl.reward`` names it as ``module:name``; the folder is bound
where it is made, in a module of the user's::

    # my_rewards.py (on the PYTHONPATH of every rank)
    from megatron_video.rl.model_rewards import CLIPVideoTextReward
    clip = CLIPVideoTextReward("/models/clip-vit-base-patch32")   # rl.reward: my_rewards:clip

``CLIPVideoTextReward(folder)``: ``transformers.CLIPModel`` and ``CLIPProcessor`` from ``folder``
(``save_pretrained`` output; ``local_files_only``); the score of a rollout is the mean over its
decoded frames of the cosine similarity of the frame's image embedding with the caption's text
embedding (in ``[-1, 1]``; CLIPScore's ``cos``). It scores ``videos`` (families with a VAE:
``video_dit``). Map: docs/wan.md, "Reinforcement learning (Flow-GRPO)".
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

__all__ = ["CLIPVideoTextReward"]


class CLIPVideoTextReward:
    """``reward(latents, caption=, videos=[G, 3, T, H, W] in [-1, 1]) -> [G]`` float64: per video
    the mean over frames (``frames``: that many, evenly spaced; None: all) of ``cos(image
    embedding of the frame, text embedding of caption)``. The model loads on the first call
    (``device``, float32), once per process."""

    def __init__(self, folder: str, frames: Optional[int] = None, device: str = "cpu"):
        if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
            raise ValueError(
                f"folder ({folder!r}) must be a local folder holding a CLIPModel and its "
                f"CLIPProcessor (save_pretrained's output)"
            )
        if frames is not None and (not isinstance(frames, int) or frames < 1):
            raise ValueError(f"frames ({frames!r}) must be None (all) or a positive int")
        self.folder, self.frames, self.device = str(folder), frames, device
        self._loaded = None

    def _load(self):
        if self._loaded is None:
            from transformers import CLIPModel, CLIPProcessor

            kw = dict(local_files_only=True)
            model = CLIPModel.from_pretrained(self.folder, **kw).to(self.device).eval()
            self._loaded = (model.float(), CLIPProcessor.from_pretrained(self.folder, **kw))
        return self._loaded

    def _pick(self, T: int) -> Tensor:
        if self.frames is None or self.frames >= T:
            return torch.arange(T)
        return torch.linspace(0, T - 1, self.frames).round().long()

    @torch.no_grad()
    def __call__(self, latents, caption: str, videos: Tensor = None, **_) -> Tensor:
        if videos is None or videos.dim() != 5 or videos.shape[1] != 3:
            raise ValueError(
                f"CLIPVideoTextReward scores decoded videos [G, 3, T, H, W] (a family with a "
                f"VAE passes them), got {None if videos is None else tuple(videos.shape)}"
            )
        model, processor = self._load()
        G, T = videos.shape[0], videos.shape[2]
        t = self._pick(T)
        rgb = ((videos.float().cpu() + 1.0) / 2.0).clamp(0.0, 1.0)[:, :, t]  # [G, 3, t, H, W]
        frames = [f.permute(1, 2, 0).numpy() for f in rgb.permute(0, 2, 1, 3, 4).flatten(0, 1)]
        inputs = processor(
            text=[caption], images=frames, return_tensors="pt", padding=True, do_rescale=False
        ).to(self.device)
        image = model.visual_projection(model.vision_model(inputs["pixel_values"]).pooler_output)
        text = model.text_projection(
            model.text_model(inputs["input_ids"], inputs.get("attention_mask")).pooler_output
        )
        image = image.double() / image.double().norm(dim=-1, keepdim=True)
        text = text.double() / text.double().norm(dim=-1, keepdim=True)
        return (image @ text[0]).view(G, len(t)).mean(dim=1).cpu()
