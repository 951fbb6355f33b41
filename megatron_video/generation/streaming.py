"""Streaming block-by-block generation from a teacher-forcing AR model with a KV cache.

``stream_autoregressive`` denoises block ``j`` (``frames_per_block`` latent frames) with its noisy
tokens attending to the cached clean keys / values of the kept earlier frames and to themselves
(the teacher-forcing rule: noisy -> earlier clean blocks and its own block), then runs the finished
block once at timestep 0 to append its clean keys / values (clean -> kept clean frames and its own
block). The family supplies the model call on one block (``generation.ar_models``); the cache is
sharded over the CP group like training (``attention.kv_cache``). ``WindowRule`` says which frames
are kept: the first ``sink`` frames and the last ``window`` frames before the block; RoPE
positions are absolute latent frames (docs/generation.md, "Sink and window"). With a window that
covers the video this equals ``cp_sampling.sample_autoregressive`` (the recompute sampler).
Prompt switches re-encode the kept frames under the new prompt (KV re-cache), block-causally
(``recache="block_causal"``, ours), or as LongLive v1.0 does (``recache="longlive"``,
``_longlive_recache``: the last ``window + nb`` frames in one bidirectional pass, the sink's
old-prompt keys / values kept; docs/generation.md, "LongLive's re-cache").
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
from ..diffusion.cfg import guided_denoise
from ..diffusion.samplers import flow_timesteps
from ..parallel import comm

__all__ = ["WindowRule", "stream_autoregressive", "BlockModel", "padded_block_tokens"]

# block_model(x [B, s, C] this CP rank's tokens of block j, t [B, s], cond, step, j) -> velocity;
# LongLive's re-cache also calls it with ``blocks=n``: this rank's contiguous share of the ``n``
# consecutive blocks ``j .. j+n-1`` (their tokens padded to a multiple of the CP size)
BlockModel = Callable[..., Tensor]
RECACHE = ("block_causal", "longlive")


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

    def held(x, t, cond, step, j, **kw):
        if j or step.append:  # later blocks; the clean block 0 holds the image already
            return block_model(x, t, cond, step, j, **kw)
        m, img = hold.to(x.device), image.repeat(x.shape[0] // image.shape[0], 1, 1)
        x = torch.where(m[None, :, None], img.to(x.dtype), x)
        t = torch.where(m[None, :], torch.zeros_like(t), t)
        return torch.where(m[None, :, None], 0.0, block_model(x, t, cond, step, j))

    def start(x):
        return torch.where(hold.to(x.device)[None, :, None], image.to(x), x)

    return held, start


def _check_recache(recache, global_sink) -> None:
    if recache not in RECACHE:
        raise ValueError(f"recache ({recache!r}) must be one of {RECACHE}")
    if global_sink is not True:
        raise ValueError(
            f"global_sink ({global_sink!r}) must be True (LongLive's default, the only one "
            f"supported: its global_sink false writes the first frames of the re-cached window into "
            f"the sink slots, a moving sink that WindowRule does not express)"
        )


def _longlive_span(rule: WindowRule, f0: int) -> Tuple[int, bool]:
    """``(first re-cached frame, keep the sink's cached entries)`` of LongLive v1.0's re-cache at
    a switch at frame ``f0`` (``_recache_after_switch`` with ``global_sink: true``). Its
    ``local_attn_size`` is ``L = sink + window + nb`` (its cache: the sink plus ``window + nb``
    rolling frames; a noisy block attends the sink, ``window`` frames and itself; ``L = -1``:
    ``window`` None). It re-runs frames ``[max(0, f0 - L), f0)``; when that starts after frame 0
    (``is_recompute``) the sink slots are protected, so only the last ``window + nb`` frames are
    written (the first ``sink`` re-run frames are attended by nobody: dropped here) and the sink
    keeps its old-prompt keys / values; from frame 0 every frame, the sink too, is re-encoded."""
    nb = rule.frames_per_block
    if rule.window is None or f0 - rule.window - nb <= rule.sink:
        return 0, False
    return f0 - rule.window - nb, True


def _longlive_recache(run, cache: KVCache, fulls, rule: WindowRule, f0, cond, S, N, rank):
    """LongLive's KV re-cache at a switch at frame ``f0`` under ``cond``: the frames of
    ``_longlive_span`` in ONE pass at timestep 0 (RoPE at their absolute frames), attending to
    each other bidirectionally (no block mask) and to the kept sink entries. ``fulls``: the full
    clean blocks ``[b, nb*S, C]`` by index; the span is cut contiguously over the ``N`` CP ranks
    (padded to a multiple of ``N``; the padding attends nothing, is never attended, evicted)."""
    nb = rule.frames_per_block
    start, keep_sink = _longlive_span(rule, f0)
    if keep_sink:  # global sink: the sink's keys / values stay as they were cached
        cache.keep(lambda tags: (tags >= 0) & (tags < rule.sink))
    else:
        cache.clear()
    x = torch.cat([fulls[k] for k in range(start // nb, f0 // nb)], dim=1)
    M = x.shape[1]
    T = padded_block_tokens(M, N)
    s = T // N
    tags, _, mask = _block_tags(T, M, S)  # mask None: all new tokens attend all of them
    tags = torch.where(tags >= 0, tags + start, tags)
    step = CacheStep(cache, tags, append=True, new_mask=mask)
    mine = _padded(x, T)[:, rank * s : (rank + 1) * s]  # this rank's contiguous share
    run(mine, 0.0, cond, step, start // nb, blocks=(f0 - start) // nb)
    cache.keep(lambda tags: tags >= 0)  # the padding never stays


def _block_tags(T: int, n: int, S: int):
    """``(block-relative frame of each of the ``T`` new tokens, padded?, their mask)``: the ``n``
    real tokens first; padding gets ``PAD_TAG`` (evicted after each append) and attends / is
    attended by none (``masks.packed([0, n])``)."""
    frame_of = torch.arange(T) // S
    padded = T > n
    if padded:
        frame_of[n:] = PAD_TAG
    return frame_of, padded, masks.packed([0, n]) if padded else None


def _prune(blocks: Dict[int, Tensor], rule: WindowRule, f0: int) -> Dict[int, Tensor]:
    """The ``blocks`` (by index) whose frames ``rule`` keeps for the block starting at ``f0``."""
    nb = rule.frames_per_block
    return {k: x for k, x in blocks.items() if bool(rule.kept(torch.tensor(k * nb), f0))}


def _runner(block_model: BlockModel, null_cond, guidance_scale: float):
    """``run(x, t_value, cond, step, j, blocks=1)``: the velocity of ``block_model`` at timestep
    ``t_value``, classifier-free guided when ``null_cond`` is given and the scale is not 1."""

    def run(x, t_value, c, step, j, blocks=1):
        t = torch.full(x.shape[:2], t_value, dtype=x.dtype, device=x.device)
        kw = {} if blocks == 1 else {"blocks": blocks}

        def fn(xx, tt, cc):
            return block_model(xx, tt, cc, step, j, **kw)

        if null_cond is None or guidance_scale == 1.0:
            return fn(x, t, c)
        return guided_denoise(fn, x, t, c, null_cond, guidance_scale)

    return run


def _euler(x: Tensor, v: Tensor, i: int, j: int, ts) -> Tensor:
    """The flow ODE's Euler step ``i`` (the default ``transition``)."""
    return x + (ts[i + 1] - ts[i]) * v


def _denoise(run, x: Tensor, cond, step, j: int, ts, transition):
    """Block ``j`` from noise ``x`` along ``ts``: ``(the last step's input, the clean block)``."""
    last_input = x
    for i in range(len(ts) - 1):
        last_input = x
        x = transition(x, run(x, ts[i], cond, step, j), i, j, ts)
    return last_input, x


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
    recache: str = "block_causal",
    global_sink: bool = True,
    progress: bool = False,
    transition: Optional[Callable] = None,
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
    ``recache``: ``"block_causal"`` (ours) or ``"longlive"`` (``_longlive_recache``; then every
    rank keeps the full clean blocks of the last ``window + nb`` frames and the sink);
    ``global_sink``: LongLive's option, only True. ``transition(x, v, i, j, ts)``: the step (Euler;
    ``rl.ar_flow``: Flow-GRPO's SDE). Collective over ``groups`` (None: one process)."""
    nb, S = frames_per_block, tokens_per_frame
    rule, N, rank, mine, T = _setup(rule, nb, S, groups)
    switch_at = _check_switches(switches, num_blocks, nb)
    _check_recache(recache, global_sink)
    frame_of, padded, new_mask = _block_tags(T, nb * S, S)
    block_model, start = _hold_first_frame(block_model, first_frame, mine, S, nb, T)
    ts = [float(v) for v in flow_timesteps(num_steps, shift)]
    cache, done, fulls = KVCache(), {}, {}  # this rank's clean share / full blocks still kept
    longlive = recache == "longlive"
    span = WindowRule(nb, rule.sink, None if rule.window is None else rule.window + nb)
    run = _runner(block_model, null_cond, guidance_scale)

    def append(x, c, j):
        run(x, 0.0, c, CacheStep(cache, frame_of + j * nb, append=True, new_mask=new_mask), j)
        if padded:  # padding never stays in the cache
            cache.keep(lambda tags: tags >= 0)

    bar = tqdm(total=num_blocks, disable=not progress, desc="blocks", leave=False)
    for j in range(num_blocks):
        f0 = j * nb
        done, fulls = _prune(done, rule, f0), _prune(fulls, span, f0)  # the kept blocks
        cond = switch_at.get(j, cond)
        if j in switch_at and longlive:
            _longlive_recache(run, cache, fulls, rule, f0, cond, S, N, rank)
        elif j in switch_at:  # KV re-cache: the kept frames, block-causally, under the new prompt
            cache.clear()
            for k in sorted(done):
                append(done[k], cond, k)
        cache.keep(lambda tags: rule.kept(tags, f0))
        x = _padded(noise_block(j), T)[:, mine].clone()
        if j == 0:
            x = start(x)
        step = CacheStep(cache, frame_of + f0, new_mask=new_mask)
        last_input, x = _denoise(run, x, cond, step, j, ts, transition or _euler)
        if j + 1 < num_blocks:  # the finished block's clean keys / values
            append(_appended(last_input, x), cond, j)
        done[j] = x
        full = x if N == 1 else comm.all_gather_cat(x, groups.cp_group, dim=1, tag="stream.block")
        full = full[:, : nb * S]
        fulls = {**fulls, j: full} if longlive else fulls
        bar.update(1)
        yield j, full, cache
    bar.close()
