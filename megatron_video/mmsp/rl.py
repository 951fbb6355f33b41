"""MR-SP: GRPO of the video-language model with the long video prefix context-parallel.

One RL step per prompt (video + question), on every CP rank of an ``MMSPLLaVAModel``:

* ``encode_video``: the frames are encoded once (MM-SP stage 1: this rank's share only) and the
  visual tokens are reused by the rollout prefill, the reference and the policy (the embedding
  cache of MR-SP; with ``RLConfig.train_encoder`` the policy pass re-encodes with gradients).
* ``rollout``: the combined prefix is prefilled once in the LLM's zigzag CP layout through
  ``attention.kv_cache`` (``CacheStep``: each rank keeps its Ulysses heads / ring share of the
  prefix keys and values), then ``G`` responses are decoded against that one shared cache: each
  step runs one new token per response (cut over the CP ranks), attending the prefix and its own
  cached tokens (a mask on the cache tags), and appends its keys / values; sampling is seeded
  per prompt and response, so every layout samples the same tokens.
* ``response_logprobs`` (policy with gradients, reference without): Megatron's language forward
  of prompt + response in the MM-SP layout, per-token log-probs from its vocab-parallel loss.
* ``grpo_loss``: group-normalised advantages, clipped ratio to the rollout policy (``rl.clip`` /
  ``clip_high`` / ``dual_clip``), k3 KL to the reference (``kl_clamp``), log-probs at the rollout
  temperature, normalised by the response tokens of the global batch or per micro-batch
  (``loss_agg``).

The parts every GRPO shares (advantages, the clipped ratio with the k3 KL, the token normalisers,
rollout seeding, the reward checks and registry) are in ``megatron_video.rl`` (``rl.grpo``,
``rl.seeding``, ``rl.rewards``); this module is the VLM's side. Map: docs/mmsp.md ("GRPO").
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

from ..attention import masks
from ..attention.kv_cache import CacheStep, KVCache
from ..layouts.mmsp import frame_shards
from ..layouts.zigzag import shard_global_ids
from ..parallel import comm
from ..rl.config import RLConfig
from ..rl.grpo import group_advantages, grpo_token_terms, logprob_temperature
from ..rl.rewards import check_rewards, resolve_reward
from ..rl.seeding import rollout_generator
from . import rl_qwen_vl as qwen
from .sharding import plan_batch, reshard_to_llm

__all__ = [
    "Rollout",
    "VideoTokens",
    "encode_video",
    "rollout",
    "response_logprobs",
    "grpo_loss",
    "score",
    "exact_match_reward",
]


@dataclasses.dataclass
class Rollout:
    """``tokens [G, L]`` (0 past each response's end), ``lengths [G]``, ``logprobs [G, L]`` (of
    the sampled tokens under the rollout policy at the rollout temperature, 1 when greedy;
    0 past the end)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor


def _cp(model):
    if qwen.is_qwen_vl(model):
        return qwen.cp_of(model)
    group = model.cp_group if model.cp_group is not None else model.pg_collection.cp  # CP 1: 1 rank
    return group, group.rank(), model.context_parallel_lm


# ----------------------------------------------------------------------------------------------
# the embedding cache
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class VideoTokens:
    """This CP rank's visual tokens of one video (``local [n_local * img_seq_len, h]``) and the
    video's frame count (Qwen2.5-VL: temporal patches; ``grid`` its ``(t, h, w)``,
    ``second_per_grid_t`` the M-RoPE timing of a temporal patch, None: 1 s)."""

    local: torch.Tensor
    num_frames: int
    grid: Optional[tuple] = None
    second_per_grid_t: Optional[float] = None


def encode_video(model, images, grad: bool = False) -> VideoTokens:
    """One video ``images [F, 3, H, W]`` through the vision model + projector, this CP rank's
    share of the frames only (MM-SP stage 1). Computed once per step and handed to ``rollout``
    and ``response_logprobs``; ``grad``: keep the graph (``rl.train_encoder``). Qwen2.5-VL:
    ``images = (pixel_values_videos, video_grid_thw)`` (``rl_qwen_vl.encode_video``)."""
    if qwen.is_qwen_vl(model):
        return VideoTokens(*qwen.encode_video(model, images, grad))
    _, rank, cp = _cp(model)
    local = images.index_select(0, frame_shards([images.shape[0]], cp).local_units(rank))
    with torch.set_grad_enabled(grad):
        out = model._encode(local)
    return VideoTokens(out.reshape(-1, out.shape[-1]), images.shape[0])


def _max_len(model) -> int:
    if qwen.is_qwen_vl(model):
        return model.language_model.max_sequence_length
    return model._language_max_sequence_length


def _llm_input(model, visual, ids, prompt_len: int):
    """``(combined [s_local, 1, h] in the zigzag CP layout, MMSPBatch, position ids)`` of one
    sequence: the position ids are Qwen2.5-VL's M-RoPE ids of this rank ``[3, 1, s_local]``, None
    for ``video_llava`` (1-D RoPE from the sequence index). ``ids[:, prompt_len:]`` is response."""
    group, rank, cp = _cp(model)
    if qwen.is_qwen_vl(model):
        combined, batch, pos = qwen.llm_input(model, visual, ids, prompt_len)
    else:
        token = model.image_token_index
        frames = [visual.num_frames]
        batch = plan_batch(ids, frames, token, model.img_seq_len, rank, cp, group=group)
    if batch.layout.seq_len > _max_len(model):
        raise ValueError(
            f"prompt + response ({int(batch.layout.lengths.max())} combined tokens, padded to "
            f"{batch.layout.seq_len}) must be <= language_max_sequence_length "
            f"({_max_len(model)})"
        )
    if qwen.is_qwen_vl(model):
        return combined, batch, pos
    text_ids = ids.clone()
    text_ids[text_ids == token] = 0
    pos = torch.arange(ids.shape[1])[None]
    text = model.language_model.embedding(input_ids=text_ids, position_ids=pos)
    text = text.transpose(0, 1).reshape(-1, text.shape[-1])
    combined = reshard_to_llm(visual.local, text, batch, group).transpose(0, 1).contiguous()
    return combined, batch, None


def _rope(model, positions: torch.Tensor, length: int):
    """Megatron's RoPE table for the given global positions ``[s, 1, 1, d]`` (no CP cut);
    Qwen2.5-VL: M-RoPE of the ids ``positions [3, 1, s]``."""
    lm = model.language_model
    if qwen.is_qwen_vl(model):
        return lm.rotary_pos_emb(
            positions.to(lm.embedding.word_embeddings.weight.device), lm.mrope_section
        )
    emb = lm.rotary_pos_emb(length, packed_seq=True)
    return emb.index_select(0, positions.to(emb.device))


def _lm(model, hidden, mask, rope):
    """Megatron's decoder + output layer on ``hidden [s, b, h]``: full-vocabulary logits."""
    lm = model.language_model
    out = lm.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rope)
    weight = (
        lm.shared_embedding_or_output_weight() if lm.share_embeddings_and_output_weights else None
    )
    logits, _ = lm.output_layer(out, weight=weight, runtime_gather_output=True)
    return logits  # [s, b, V]


# ----------------------------------------------------------------------------------------------
# rollouts
# ----------------------------------------------------------------------------------------------
def _sample(logits: torch.Tensor, gen: torch.Generator, temperature: float, top_p: float) -> int:
    """One token from ``logits [V]`` (float64): greedy at temperature 0 (lowest index on ties),
    else nucleus sampling with one uniform draw from ``gen``."""
    logits = logits.double()
    if temperature == 0:
        return int(torch.argmax(logits))
    p = torch.softmax(logits / temperature, dim=-1)
    order = torch.sort(-p, stable=True).indices
    ps = p[order]
    keep = (torch.cumsum(ps, 0) - ps) < top_p
    ps = torch.where(keep, ps, torch.zeros_like(ps))
    cdf = torch.cumsum(ps, 0)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    return int(order[min(int(torch.searchsorted(cdf, u, right=True)), int(keep.sum()) - 1)])


def _prefill(model, visual, prompt_ids):
    """Prefill the prefix once: ``(cache, P, logits of the last prefix token [V])``."""
    group, _, cp = _cp(model)
    combined, batch, mpos = _llm_input(model, visual, prompt_ids, prompt_ids.shape[1])
    P, seq = int(batch.layout.lengths[0]), batch.layout.seq_len
    pos_all = torch.cat([shard_global_ids(r, cp, seq, "zigzag") for r in range(cp)])

    def causal_real(qi, ki):  # new-token indices (contiguous over CP ranks) -> zigzag positions
        return (pos_all[ki] <= pos_all[qi]) & (pos_all[ki] < P)

    cache = KVCache()
    step = CacheStep(cache, pos_all, append=True, new_mask=masks.predicate(causal_real))
    rope = _rope(model, batch.plan.positions if mpos is None else mpos, seq)
    logits = _lm(model, combined, step, rope)
    cache.keep(lambda tags: tags < P)  # padding never enters the cache
    logits = comm.all_gather_cat(logits[:, 0].contiguous(), group, tag="rl.prefill_logits")
    return cache, P, logits[int(torch.nonzero(pos_all == P - 1)[0, 0])]


def _decode_step(model, cache, P, L, last, t, offset=None):
    """Logits ``[G, V]`` of every response's token ``t`` from its token ``t - 1`` (``last [G]``):
    one new token per response at position ``P + t - 1``, cut over the CP ranks (padded to a
    multiple of CP), attending the prefix and its own earlier tokens in the cache (``cache_mask``
    on the tags: prefix ``< P``, response ``g``'s token ``j``: ``P + g * L + j``); its keys /
    values are appended (the padding's evicted), so no token is ever recomputed. ``offset``
    (Qwen2.5-VL): the token's M-RoPE id on every axis is ``P + t - 1 + offset``."""
    group, _, cp = _cp(model)
    G = last.shape[0]
    n = -(-G // cp) * cp
    ids = torch.zeros(n, dtype=torch.long)
    ids[:G] = last
    s, rank = n // cp, group.rank()
    mine = torch.arange(rank * s, (rank + 1) * s)
    new = torch.arange(n)
    tags = torch.where(new < G, P + new * L + (t - 1), torch.full_like(new, -1))

    def own(qi, tag):  # the prefix, and this response's cached tokens
        return (tag < P) | ((tag - P) // L == qi)

    lm = model.language_model
    hidden = lm.embedding(input_ids=ids[mine][None], position_ids=None)  # [s, 1, h]
    if offset is None:
        rope = _rope(model, torch.full((s,), P + t - 1), P + t)
    else:
        rope = _rope(model, torch.full((3, 1, s), P + t - 1 + offset), P + t)
    step = CacheStep(
        cache,
        tags,
        append=True,
        new_mask=masks.predicate(lambda qi, ki: qi == ki),
        cache_mask=masks.predicate(own),
    )
    logits = _lm(model, hidden, step, rope)[:, 0].contiguous()
    cache.keep(lambda tg: tg >= 0)
    return comm.all_gather_cat(logits, group, tag="rl.decode_logits")[:G]  # [G, V]


def _recompute_logits(model, visual, prompt_ids, tokens, t):
    """The same logits without a cache: Megatron's language forward of prompt + each response's
    first ``t`` tokens in the MM-SP layout, the whole prefix recomputed (the reference of
    ``rollout(kv_cache=False)``)."""
    group, _, cp = _cp(model)
    out = []
    for g in range(tokens.shape[0]):
        ids = torch.cat([prompt_ids, tokens[g : g + 1, :t]], 1)
        combined, batch, mpos = _llm_input(model, visual, ids, prompt_ids.shape[1])
        seq, last = batch.layout.seq_len, int(batch.layout.lengths[0]) - 1
        pos_all = torch.cat([shard_global_ids(r, cp, seq, "zigzag") for r in range(cp)])
        logits = model.language_model(
            input_ids=None,
            position_ids=mpos,
            attention_mask=None,
            decoder_input=combined,
            runtime_gather_output=True,
        )[0].contiguous()
        logits = comm.all_gather_cat(logits, group, tag="rl.recompute_logits")
        out.append(logits[int(torch.nonzero(pos_all == last)[0, 0])])
    return torch.stack(out)


def _check_prompt(model, visual, prompt_ids):
    if qwen.is_qwen_vl(model):
        return qwen.check_prompt(model, visual, prompt_ids)
    n_img = int((prompt_ids == model.image_token_index).sum())
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or n_img != 1:
        raise ValueError(
            f"prompt_ids ({tuple(prompt_ids.shape)}, {n_img} image tokens) must be [1, T] with "
            f"one image token ({model.image_token_index})"
        )


@torch.no_grad()
def rollout(
    model,
    visual: torch.Tensor,
    prompt_ids: torch.Tensor,
    cfg: RLConfig,
    prompt_seed: int,
    eos_id: Optional[int] = None,
    kv_cache: bool = True,
) -> Rollout:
    """``cfg.group_size`` responses to one prompt (``prompt_ids [1, T]``, one image token;
    ``visual`` from ``encode_video``). Response ``g`` samples from the generator of ``(cfg.seed,
    prompt_seed, g)`` (``rl.seeding.rollout_generator``), so any layout draws the same tokens; a
    response ends at ``eos_id`` (included) or after ``cfg.max_new_tokens``. ``kv_cache``: decode against the
    prefix's and the responses' cached keys / values (one new token per response and step);
    False: recompute the whole sequence for every token (the reference; benchmarks)."""
    _check_prompt(model, visual, prompt_ids)
    G, L = cfg.group_size, cfg.max_new_tokens
    offset = None
    if qwen.is_qwen_vl(model):
        combined_len = prompt_ids.shape[1]
        offset = qwen.text_offset(model, visual, prompt_ids)
    else:
        combined_len = prompt_ids.shape[1] - 1 + visual.num_frames * model.img_seq_len
    if combined_len + L > _max_len(model):
        raise ValueError(
            f"prompt ({combined_len} combined tokens) + rl.max_new_tokens ({L}) must be <= "
            f"language_max_sequence_length ({_max_len(model)})"
        )
    cache, P, last = _prefill(model, visual, prompt_ids)
    temp = logprob_temperature(cfg)
    gens = [rollout_generator(cfg.seed, prompt_seed, g) for g in range(G)]
    tokens = torch.zeros(G, L, dtype=torch.long)
    logprobs = torch.zeros(G, L, dtype=torch.float64)
    lengths = torch.full((G,), L, dtype=torch.long)
    done = torch.zeros(G, dtype=torch.bool)
    logits = last.expand(G, -1)
    for t in range(L):
        if t > 0 and kv_cache:
            logits = _decode_step(model, cache, P, L, tokens[:, t - 1], t, offset)
        elif t > 0:
            logits = _recompute_logits(model, visual, prompt_ids, tokens, t)
        lp = torch.log_softmax(logits.double() / temp, dim=-1)
        for g in range(G):
            if done[g]:
                continue
            tok = _sample(logits[g], gens[g], cfg.temperature, cfg.top_p)
            tokens[g, t], logprobs[g, t] = tok, lp[g, tok]
            if eos_id is not None and tok == eos_id:
                done[g], lengths[g] = True, t + 1
        if bool(done.all()):
            break
    return Rollout(tokens, lengths, logprobs)


# ----------------------------------------------------------------------------------------------
# log-probs and the GRPO objective
# ----------------------------------------------------------------------------------------------
def response_logprobs(model, visual, prompt_ids, tokens, lengths, temperature=1.0) -> List[tuple]:
    """Per response ``g``: ``(lp [s_local], index [s_local], valid [s_local])``, this rank's
    per-token log-probs of response tokens under ``model`` (Megatron's language forward in the
    MM-SP layout, log-softmax of the full-vocabulary logits / ``temperature``, gradients when
    enabled);
    ``index``: the response offset of each."""
    group, _, cp = _cp(model)
    out = []
    for g in range(tokens.shape[0]):
        n = int(lengths[g])
        ids = torch.cat([prompt_ids, tokens[g : g + 1, :n]], dim=1)
        combined, batch, mpos = _llm_input(model, visual, ids, prompt_ids.shape[1])
        P = int(batch.layout.lengths[0]) - n
        seq = batch.layout.seq_len
        labels = torch.zeros(seq, dtype=torch.long)
        labels[P - 1 : P - 1 + n] = tokens[g, :n]
        pos = batch.plan.positions
        index = pos - (P - 1)
        valid = (index >= 0) & (index < n)
        logits = model.language_model(
            input_ids=None,
            position_ids=mpos,
            attention_mask=None,
            decoder_input=combined,
            runtime_gather_output=True,
        )  # [1, s_local, V] (Megatron's loss would cast them to float32: log-probs here instead)
        logits = logits[0].to(torch.promote_types(logits.dtype, torch.float32))
        lp = torch.log_softmax(logits / temperature, -1)
        out.append((lp.gather(1, labels[pos][:, None])[:, 0], index.clamp(0, n - 1), valid))
    return out


def grpo_loss(
    policy, reference, visual, prompt_ids, ro: Rollout, rewards, cfg, total_tokens, ref_visual=None
):
    """This rank's share of the GRPO loss of one group: the sum over this rank's response tokens
    of ``grpo_token_terms``, divided by ``total_tokens`` (``token_normalisers``: by default every
    response token of the global batch, all groups and DP ranks). Summed over the CP group (as
    gradient reduction does) it is the loss. Log-probs at ``logprob_temperature``. ``visual``
    feeds the policy; ``ref_visual`` (default ``visual``) the reference: its own encoding when the
    encoder trains (``rl.train_encoder``). Returns ``(loss, stats)`` (stats: this rank's sums of
    kl and clipped tokens)."""
    adv = group_advantages(rewards, cfg.eps)
    temp = logprob_temperature(cfg)
    pol = response_logprobs(policy, visual, prompt_ids, ro.tokens, ro.lengths, temp)
    with torch.no_grad():
        ref_visual = visual if ref_visual is None else ref_visual
        ref = response_logprobs(reference, ref_visual, prompt_ids, ro.tokens, ro.lengths, temp)
    loss, kl, clipped = 0.0, 0.0, 0.0
    for g, ((lp, idx, valid), (rlp, _, _)) in enumerate(zip(pol, ref)):
        old = ro.logprobs[g].index_select(0, idx)
        terms, k3, cl = grpo_token_terms(lp, old, rlp, adv[g], cfg)
        m = valid.to(lp.dtype)
        loss = loss + (terms * m).sum()
        kl += float((k3 * m).sum().detach())
        clipped += float((cl & valid).sum())
    return loss / total_tokens, {"kl_sum": kl, "clipped": clipped}


def exact_match_reward(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    answer_id: int,
    format_ids: Sequence[int] = (),
    **_sample,
) -> torch.Tensor:
    """The built-in reward of the synthetic video QA: 1 when the response's first token is the
    answer, plus 0.1 (format) when it is one of ``format_ids`` (an attribute word). Other sample
    fields (``answer``, ``decode``) are ignored."""
    first = tokens[:, 0]
    fmt = torch.tensor([int(t) in set(format_ids) for t in first.tolist()], dtype=torch.float64)
    return (first == answer_id).double() + 0.1 * fmt


def score(cfg: RLConfig, ro: Rollout, **sample) -> torch.Tensor:
    """Rewards ``[G]`` of one group: ``cfg.reward`` on ``(tokens, lengths, **sample)``, checked
    (``check_rewards``) before anything uses them, identically on every rank. Any exception of
    the function becomes a ``ValueError`` naming it and the exception's type and message (the
    trainer's agree-then-raise path: every rank raises, none waits in a collective)."""
    fn = resolve_reward(cfg.reward)
    try:
        rewards = fn(ro.tokens, ro.lengths, **sample)
    except Exception as e:
        raise ValueError(f"rl.reward function {cfg.reward} raised {type(e).__name__}: {e}") from e
    return check_rewards(rewards, cfg.group_size, cfg.reward)
