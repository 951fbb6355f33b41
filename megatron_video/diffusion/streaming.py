"""Streaming block-by-block generation from a teacher-forcing AR model with a KV cache.

``stream_autoregressive`` denoises block ``j`` (``frames_per_block`` latent frames) with its noisy
tokens attending to the cached clean keys / values of the kept earlier frames and to themselves
(the teacher-forcing rule: noisy -> earlier clean blocks and its own block), then runs the finished
block once at timestep 0 to append its clean keys / values (clean -> kept clean frames and its own
block). The family supplies the model call on one block (``diffusion.ar_models``); the cache is
sharded over the CP group like training (``attention.kv_cache``). ``WindowRule`` says which frames
are kept: the first ``sink`` frames and the last ``window`` frames before the block; RoPE
positions are absolute latent frames (docs/generation.md, "Sink and window"). With a window that
covers the video this equals ``cp_sampling.sample_autoregressive`` (the recompute sampler).
Prompt switches re-encode the kept frames under the new prompt (KV re-cache), block-causally.
Any CP size up to a block's tokens: a block whose tokens the CP size does not divide is padded to a
multiple of it (``padded_block_tokens``); the padding attends nothing, is never attended (the
new tokens' mask ``masks.packed([0, nb*S])``), is evicted from the cache after each append and is
dropped after the gather, so the result equals CP = 1 (docs/generation.md, "Any CP size").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..attention import masks
from ..attention.kv_cache import CacheStep, KVCache
from ..parallel import comm
from .cfg import guided_denoise
from .samplers import flow_timesteps

__all__ = ["WindowRule", "stream_autoregressive", "BlockModel", "padded_block_tokens"]

# block_model(x [B, s, C] this CP rank's tokens of block j, t [B, s], cond, step, j) -> velocity
BlockModel = Callable[[Tensor, Tensor, Any, CacheStep, int], Tensor]


@dataclass(frozen=True)
class WindowRule:
    """Frames a block attends to besides itself: the first ``sink`` latent frames and the
    ``window`` frames right before it (``window`` None: all). Both whole blocks."""

    frames_per_block: int
    sink: int = 0
    window: Optional[int] = None

    def __post_init__(self):
        nb = self.frames_per_block
        if not isinstance(nb, int) or nb < 1:
            raise ValueError(f"frames_per_block ({nb!r}) must be a positive int")
        if not isinstance(self.sink, int) or self.sink < 0 or self.sink % nb:
            raise ValueError(
                f"sink ({self.sink!r}) must be a non-negative multiple of frames_per_block ({nb})"
            )
        if self.window is not None and (
            not isinstance(self.window, int) or self.window < 0 or self.window % nb
        ):
            raise ValueError(
                f"window ({self.window!r}) must be None or a non-negative multiple of "
                f"frames_per_block ({nb})"
            )

    def kept(self, frames: Tensor, first_frame: int) -> Tensor:
        """Which of the earlier ``frames`` a block starting at ``first_frame`` attends to."""
        earlier = frames < first_frame
        if self.window is None:
            return earlier
        return earlier & ((frames < self.sink) | (frames >= first_frame - self.window))


def _check_switches(switches, num_blocks: int, nb: int) -> Dict[int, Any]:
    out = {}
    for item in switches:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"switches entry ({item!r}) must be a (frame, cond) pair")
        frame, cond = item
        if not isinstance(frame, int) or frame % nb or not 0 < frame < num_blocks * nb:
            raise ValueError(
                f"switch frame ({frame!r}) must be a multiple of frames_per_block ({nb}) in "
                f"(0, {num_blocks * nb}) (a block boundary inside the video)"
            )
        if frame // nb in out:
            raise ValueError(f"switch frame ({frame}) is given twice")
        out[frame // nb] = cond
    return out


PAD_TAG = -(10**9)  # the cache tag of a padding token (a block padded to a multiple of the CP size)


def padded_block_tokens(block_tokens: int, cp_size: int) -> int:
    """A block's new-token count padded to a multiple of ``cp_size`` (each CP rank cuts an equal
    contiguous share; the padding attends nothing, is never attended and never cached)."""
    return -(-block_tokens // cp_size) * cp_size


def _setup(rule, nb: int, S: int, groups):
    """``(rule, cp size, cp rank, this rank's slice of the padded block, padded block tokens)``,
    checked before any collective."""
    rule = rule or WindowRule(nb)
    if rule.frames_per_block != nb:
        raise ValueError(
            f"rule.frames_per_block ({rule.frames_per_block}) must equal frames_per_block ({nb})"
        )
    N = 1 if groups is None else groups.cp_size
    rank = 0 if groups is None else groups.cp_rank
    if N > nb * S:
        raise ValueError(
            f"CP size ({N}) must be at most the tokens of a block ({nb} frames x {S} = "
            f"{nb * S}): every CP rank holds at least one real token"
        )
    T = padded_block_tokens(nb * S, N)
    s = T // N
    return rule, N, rank, slice(rank * s, (rank + 1) * s), T


def _padded(block: Tensor, T: int) -> Tensor:
    """``block [b, n, C]`` with zero tokens appended up to ``T``."""
    if block.shape[1] == T:
        return block
    return torch.cat(
        [block, block.new_zeros(block.shape[0], T - block.shape[1], block.shape[2])], 1
    )


def _appended(last_input: Tensor, clean: Tensor) -> Tensor:
    """The tokens of a finished block whose keys / values enter the cache: the clean ones (not the
    last noisy input). The tests replace it to prove that a stale cache is caught."""
    return clean


def _hold_first_frame(block_model: BlockModel, first_frame: Optional[Tensor], mine, S, nb, T):
    """``(block_model, start)`` with latent frame 0 held at ``first_frame [b, S, C]`` in block 0
    (TI2V, as training conditions: input the image, timestep 0, velocity 0; ``start`` puts it
    into block 0's noise); unchanged when ``first_frame`` is None. ``mine``: this rank's slice
    of the block padded to ``T`` tokens."""
    if first_frame is None:
        return block_model, lambda x: x
    if first_frame.dim() != 3 or first_frame.shape[1] != S:
        raise ValueError(
            f"first_frame shape ({tuple(first_frame.shape)}) must be [b, tokens_per_frame = {S}, C]"
        )
    hold = (torch.arange(T) // S)[mine] == 0  # this rank's tokens of latent frame 0
    image = torch.zeros(first_frame.shape[0], T, first_frame.shape[2]).to(first_frame)
    image[:, :S] = first_frame
    image = image[:, mine]

    def held(x, t, cond, step, j):
        if j or step.append:  # later blocks; the clean block 0 holds the image already
            return block_model(x, t, cond, step, j)
        m, img = hold.to(x.device), image.repeat(x.shape[0] // image.shape[0], 1, 1)
        x = torch.where(m[None, :, None], img.to(x.dtype), x)
        t = torch.where(m[None, :], torch.zeros_like(t), t)
        return torch.where(m[None, :, None], 0.0, block_model(x, t, cond, step, j))

    def start(x):
        return torch.where(hold.to(x.device)[None, :, None], image.to(x), x)

    return held, start


def stream_autoregressive(
    block_model: BlockModel,
    noise_block: Callable[[int], Tensor],
    num_blocks: int,
    frames_per_block: int,
    tokens_per_frame: int,
    cond: Any,
    *,
    groups=None,
    null_cond: Any = None,
    guidance_scale: float = 1.0,
    num_steps: int = 16,
    shift: float = 1.0,
    rule: Optional[WindowRule] = None,
    switches: Sequence[Tuple[int, Any]] = (),
    first_frame: Optional[Tensor] = None,
    progress: bool = False,
) -> Iterator[Tuple[int, Tensor, KVCache]]:
    """Yield ``(j, block j's clean tokens [b, nb*S, C] (every rank), cache)`` for each block.

    ``noise_block(j)``: the full noise of block ``j`` ``[b, nb*S, C]``, the same on every CP rank
    (each rank keeps its contiguous share). ``cond`` / ``null_cond``: the family's condition
    (classifier-free guidance with ``guidance_scale``: positive and negative caches, one batch
    ``[cond; null]``). ``switches``: ``(frame, cond)`` pairs, at a block boundary the prompt
    changes and the kept frames are re-encoded under it; the text's cross-attention keys / values
    are projected once per prompt (``KVCache.text_kv``, kept across switches row by row).
    ``first_frame [b, S, C]`` (TI2V / I2V, the same on every rank): the tokens of latent frame 0,
    held in block 0 as in training (their input the image, timestep 0, velocity 0).
    Collective over ``groups`` (None: one process).
    """
    nb, S = frames_per_block, tokens_per_frame
    rule, N, rank, mine, T = _setup(rule, nb, S, groups)
    switch_at = _check_switches(switches, num_blocks, nb)
    frame_of = torch.arange(T) // S  # block-relative frame of each new token
    padded = T > nb * S
    if padded:  # padding: its own tag (evicted after each append), attends / is attended by none
        frame_of[nb * S :] = PAD_TAG
    new_mask = masks.packed([0, nb * S]) if padded else None
    block_model, start = _hold_first_frame(block_model, first_frame, mine, S, nb, T)
    ts = [float(v) for v in flow_timesteps(num_steps, shift)]
    cache, done = KVCache(), {}  # done: this rank's clean share of the blocks still kept

    def run(x, t_value, c, step, j):
        t = torch.full(x.shape[:2], t_value, dtype=x.dtype, device=x.device)

        def fn(xx, tt, cc):
            return block_model(xx, tt, cc, step, j)

        if null_cond is None or guidance_scale == 1.0:
            return fn(x, t, c)
        return guided_denoise(fn, x, t, c, null_cond, guidance_scale)

    def append(x, c, j):
        run(x, 0.0, c, CacheStep(cache, frame_of + j * nb, append=True, new_mask=new_mask), j)
        if padded:  # padding never stays in the cache
            cache.keep(lambda tags: tags >= 0)

    bar = tqdm(total=num_blocks, disable=not progress, desc="blocks", leave=False)
    for j in range(num_blocks):
        f0 = j * nb
        keep = rule.kept(torch.arange(f0), f0)
        done = {k: x for k, x in done.items() if bool(keep[k * nb])}  # the kept blocks
        if j in switch_at:  # KV re-cache: the kept frames, block-causally, under the new prompt
            cond = switch_at[j]
            cache.clear()
            for k in sorted(done):
                append(done[k], cond, k)
        cache.keep(lambda tags: rule.kept(tags, f0))
        x = _padded(noise_block(j), T)[:, mine].clone()
        if j == 0:
            x = start(x)
        step = CacheStep(cache, frame_of + f0, new_mask=new_mask)
        for i in range(num_steps):
            last_input = x
            x = x + (ts[i + 1] - ts[i]) * run(x, ts[i], cond, step, j)
        if j + 1 < num_blocks:  # the finished block's clean keys / values
            append(_appended(last_input, x), cond, j)
        done[j] = x
        full = x if N == 1 else comm.all_gather_cat(x, groups.cp_group, dim=1, tag="stream.block")
        full = full[:, : nb * S]
        bar.update(1)
        yield j, full, cache
    bar.close()
