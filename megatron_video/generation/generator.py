"""A model on its ranks, ready to sample: ``Generator``. T2V models: the context-parallel samplers of
``cp_sampling`` (noise partitioned with the model's layout, denoised in parallel, gathered; or a
token-placed batch, one packed clip per sample). AR models: the streaming generator with a KV
cache (``streaming``), block by block, any length, sink + rolling window, prompt switches. What to
sample is a ``SampleSpec`` (shapes and the diffusion's sampler settings); the trainer's config
becomes one in ``training.generate`` (``train.sample`` and ``megatron-video generate`` call this).
Design: docs/generation.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch

from . import cp_sampling as cps
from .ar_models import WAN_TIMESTEP_SCALE, block_model, is_wan
from .wan_sampling import _proj_out_to_patchify

__all__ = ["SampleSpec", "Generator", "caption_conditions"]


@dataclass(frozen=True)
class SampleSpec:
    """What a ``Generator`` samples: the token grid ``(T', H', W')`` of a sample after patchify,
    ``patch_size`` ``(pt, ph, pw)``, ``latent_channels``, ``latent_frames`` ``F`` of the trained
    sample, ``frames_per_block`` (AR models), ``autoregressive``; and the sampler: ``objective``
    (``"edm"`` or a flow objective), ``guidance_scale``, ``sample_steps``, ``flow_shift``,
    ``sigma_data`` / ``sampler`` (EDM)."""

    token_grid: Tuple[int, int, int]
    patch_size: Tuple[int, int, int]
    latent_channels: int
    latent_frames: int
    frames_per_block: int
    autoregressive: bool
    objective: Optional[str]  # "edm"; otherwise (a flow objective, None) the flow sampler
    guidance_scale: float
    sample_steps: int
    flow_shift: float = 1.0
    sigma_data: float = 0.5
    sampler: str = "euler"

    @property
    def channels(self) -> int:
        """Channels of a token: ``latent_channels * pt * ph * pw``."""
        return self.latent_channels * math.prod(self.patch_size)


def caption_conditions(caption_len: int, captions: Sequence[str], device) -> Tuple[tuple, tuple]:
    """``(cond, null)`` of the caption families: ``(ids, mask, drop)`` of ``captions`` tokenized at
    ``caption_len``; CFG's null drops the caption."""
    from megatron_video.data.synthetic import CaptionTokenizer

    tok = CaptionTokenizer(caption_len)
    ids, mask = zip(*(tok.encode(c) for c in captions))
    ids, mask = torch.stack(ids).to(device), torch.stack(mask).to(device)
    b = len(captions)
    cond = (ids, mask, torch.zeros(b, dtype=torch.bool, device=device))
    return cond, (ids, mask, torch.ones(b, dtype=torch.bool, device=device))


@dataclass
class Generator:
    """A model on its ranks, ready to sample: ``model`` (eval, no grad; any Megatron wrapper),
    ``spec`` (``SampleSpec``), ``groups`` (``VideoParallelGroups``; CP rank and size; None: one
    process), ``geometry`` of the trained sample, ``token_ids`` this rank's T2V token ids,
    ``progress``, ``placed`` (a token-placed batch: ``(PackedVideo of one clip, its
    PlacementPlan, local ids)``)."""

    model: Any
    spec: SampleSpec
    groups: Any
    geometry: Any = None
    token_ids: Optional[torch.Tensor] = None
    progress: bool = False
    placed: Any = None

    @property
    def device(self):
        return next(self.model.parameters()).device

    def _guided(self, null) -> dict:
        s = self.spec
        return dict(
            null_cond=null,
            guidance_scale=s.guidance_scale,
            num_steps=s.sample_steps,
            progress=self.progress,
        )

    def _sample(self, net, x, cond, null):
        """The spec's sampler (EDM or flow) on this rank's tokens ``x``."""
        s = self.spec
        if s.objective == "edm":
            return cps.sample_edm(
                net, x, cond, sigma_data=s.sigma_data, sampler=s.sampler, **self._guided(null)
            )
        return cps.sample_flow(net, x, cond, shift=s.flow_shift, **self._guided(null))

    def _net(self, x, tt, c):
        """The model on this rank's tokens (Wan: its contiguous CP split, timestep ``t * 1000``)."""
        if self.placed is not None:
            return self._placed_net(x, tt, c)
        model, s = self.model, self.spec
        if is_wan(model):
            out = model(x, tt * WAN_TIMESTEP_SCALE, c[0], self.geometry)
            return _proj_out_to_patchify(out, tuple(s.patch_size), s.latent_channels)
        return model(x, tt, c[0], c[1], self.geometry, drop=c[2])

    def t2v_tokens(self, cond, null, noise: torch.Tensor) -> torch.Tensor:
        """Full clean tokens ``[b, N, C]`` of a T2V model from the full ``noise`` (collective)."""
        if self.placed is not None:
            return self._placed_tokens(noise, cond, null)
        local = cps.partition_tokens(noise, self.token_ids)
        out = self._sample(self._net, local, cond, null)
        return cps.gather_tokens(out, self.token_ids, self.groups.cp_group, noise.shape[1])

    def _placed_net(self, x, tt, c):
        """The model on a token-placed batch (``batches.placed``): each sample its own packed
        sequence of one clip (padding attends nothing and is dropped after the gather)."""
        packed, plan, _ = self.placed
        B, model, s = x.shape[0], self.model, self.spec
        tt = tt.reshape(-1).expand(B)
        outs = []
        for j in range(B):  # one collective model call per sample, the same count on every rank
            cj = [t[j : j + 1] for t in c]
            if is_wan(model):
                out = model(
                    x[j : j + 1], tt[j : j + 1] * WAN_TIMESTEP_SCALE, cj[0], packed,
                    placement=plan.placement,
                )  # fmt: skip
                out = _proj_out_to_patchify(out, tuple(s.patch_size), s.latent_channels)
            else:
                out = model(
                    x[j : j + 1], tt[j : j + 1], cj[0], cj[1], packed, drop=cj[2],
                    placement=plan.placement,
                )  # fmt: skip
            outs.append(out)
        return torch.cat(outs)

    def _placed_tokens(self, noise, cond, null):
        """``t2v_tokens`` of a token-placed batch: noise padded to the packed length, this
        rank's ids sampled, gathered, padding dropped."""
        packed, _, local = self.placed
        N = noise.shape[1]
        pad = noise.new_zeros(noise.shape[0], packed.seq_len - N, noise.shape[2])
        x = cps.partition_tokens(torch.cat([noise, pad], dim=1), local)
        out = self._sample(self._net, x, cond, null)
        return cps.gather_tokens(out, local, self.groups.cp_group, packed.seq_len)[:, :N]

    def ar_blocks(
        self,
        cond,
        null,
        noise_block,
        num_blocks: int,
        *,
        sink: int = 0,
        window: Optional[int] = None,
        switches: Sequence[Tuple[int, Any]] = (),
        first_frame: Optional[torch.Tensor] = None,
        recache: str = "block_causal",
    ) -> Iterator[Tuple[int, torch.Tensor, Any]]:
        """``stream_autoregressive`` with the model: ``(j, block tokens [b, nb*S, C], cache)``.
        ``window`` default: the trained latent frames less one block (the longest context the
        model saw), so a video of the trained length equals the recompute sampler. ``recache``:
        the prompt-switch KV re-cache, ``"block_causal"`` (ours) or ``"longlive"`` (LongLive
        v1.0's, its ``local_attn_size`` being ``sink + window + frames_per_block``)."""
        from . import streaming

        s = self.spec
        nb, (_, Hp, Wp) = s.frames_per_block, s.token_grid
        if window is None:
            window = s.latent_frames - nb
        g = self.groups
        N, rank = (1, 0) if g is None else (g.cp_size, g.cp_rank)
        return streaming.stream_autoregressive(
            block_model(self.model, Hp, Wp, nb, rank, N),
            noise_block,
            num_blocks,
            nb,
            Hp * Wp,
            cond,
            groups=g,
            null_cond=null,
            guidance_scale=s.guidance_scale,
            num_steps=s.sample_steps,
            shift=s.flow_shift,
            rule=streaming.WindowRule(nb, sink, window),
            switches=switches,
            first_frame=first_frame,
            recache=recache,
            progress=self.progress,
        )

    def sample_tokens(self, cond, null, noise: torch.Tensor) -> torch.Tensor:
        """Full clean tokens ``[b, N, C]`` of the spec's sample shape from the full ``noise``
        (collective): T2V models in one go, AR models block by block."""
        s = self.spec
        noise = noise.to(self.device)
        with torch.no_grad():
            if not s.autoregressive:
                return self.t2v_tokens(cond, null, noise)
            _, Hp, Wp = s.token_grid
            nbS = s.frames_per_block * Hp * Wp
            blocks = self.ar_blocks(
                cond, null, lambda j: noise[:, j * nbS : (j + 1) * nbS], noise.shape[1] // nbS
            )
            return torch.cat([block for _, block, _ in blocks], dim=1)
