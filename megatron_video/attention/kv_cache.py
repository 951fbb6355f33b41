"""Queries against a key / value cache sharded over the CP group (streaming AR generation, decoding).

``cached_attention`` is the one operation: new tokens (any count, cut contiguously over the CP
ranks) attend to (a) the cached keys / values, which stay where they were written -- the Ulysses
rank holds its heads, the ring rank its share of the cached sequence, so each rank keeps 1/N of
the cache -- and (b) the new tokens' own keys / values under an optional mask on their indices.
Per rank: the Ulysses all-to-all of the new q / k / v (as in ``dist_attention``), an all-gather of
the new queries and keys / values over the ring, one local attention against the rank's cache
slice for every ring rank's queries, an all-to-all of those partial (out, LSE) back to the
queries' ring rank, an LSE merge, the inverse all-to-all. No gradient (inference).

``KVCache`` holds one such shard per attention layer, each cached token tagged (e.g. with its
latent frame) so that a caller evicts by tag (``keep``); ``CacheStep`` is what a model passes as
the attention mask of one call so that its core attention (``attention.megatron.DistAttention2D``)
runs ``cached_attention`` on its layer's shard, appending the new keys / values when asked.
Cross-attention (text, no CP) caches its keys / values per prompt in the same ``KVCache``
(``text_kv``): a layer that gets a ``CacheStep`` projects the text once and reuses the keys /
values while the text stays the same, row by row (CFG's positive and negative rows apart).
Map: docs/attention.md ("Cached attention").
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from ..parallel import comm
from .kernels import attention_forward
from .masks import AttentionMask
from .ulysses import check_heads, heads_to_seq, prepare_kv, seq_to_heads

__all__ = ["cached_attention", "KVCache", "CacheStep", "text_kv"]


def _sizes(groups) -> Tuple[int, int, object, object]:
    if groups is None:
        return 1, 1, None, None
    return groups.ulysses_size, groups.ring_size, groups.ulysses_group, groups.ring_group


_IDS: Dict[tuple, torch.Tensor] = {}


def _ring_ids(groups, s: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(ids of this ring rank's new tokens after the Ulysses gather, ids of all ring ranks'
    in ring order)``: CP rank ``c`` holds new tokens ``[c*s, (c+1)*s)`` (contiguous cut)."""
    if groups is None or groups.cp_size == 1:
        ids = torch.arange(s)
        return ids, ids
    key = (tuple(groups.cp_ranks), tuple(groups.ulysses_ranks), tuple(groups.ring_ranks), s)
    if key not in _IDS:
        U, R, ug, rg = _sizes(groups)  # a size-1 group may be None: never gather over it
        mine = groups.cp_rank * s + torch.arange(s)
        mine = comm.all_gather_cat(mine, ug, tag="kv_cache.ids") if U > 1 else mine
        _IDS[key] = (mine, comm.all_gather_cat(mine, rg, tag="kv_cache.ids") if R > 1 else mine)
    return _IDS[key]


def _merge(parts):
    """LSE merge of partial ``(out [b, m, h, d], lse [b, h, m])``; rows with no key give zeros."""
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    out = 0
    for o, part_lse in parts:
        w = torch.exp(part_lse - safe).transpose(1, 2)[..., None]  # [b, m, h, 1]
        out = out + w * o.to(w.dtype)
    return out


def _partial(q, k, v, mask, scale, backend):
    if k.shape[1] == 0:
        b, m, h, d = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        return q.new_zeros(b, m, h, d), torch.full((b, h, m), float("-inf"), dtype=acc)
    return attention_forward(q, k, v, mask, scale, backend)


@torch.no_grad()
def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: Optional[torch.Tensor],
    cache_v: Optional[torch.Tensor],
    groups=None,
    *,
    new_mask: Optional[AttentionMask] = None,
    cache_mask: Optional[AttentionMask] = None,
    cache_tags: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of new tokens to a CP-sharded cache plus themselves.

    ``q [b, s, h, d]``, ``k, v [b, s, h_kv, d]``: this CP rank's new tokens, CP rank ``c`` holding
    new tokens ``[c*s, (c+1)*s)``; ``cache_k, cache_v [b, n_c, h_kv', d]`` (or None): this rank's
    cache shard in the layout this function returns (the Ulysses rank's heads, any number
    ``n_c`` of cached tokens, which may differ between ring ranks). Every query sees every cached
    token unless ``cache_mask`` (an ``AttentionMask`` on (new-token index, ``cache_tags [n_c]``:
    the shard's tags), e.g. the decoding of several responses that share a cached prefix, each
    seeing only its own cached tokens); among the new tokens ``new_mask`` (an ``AttentionMask`` on
    new-token indices ``0 .. N*s-1``; None: all). Returns ``(out [b, s, h, d], k_shard,
    v_shard)``: the output in ``q``'s layout and the new keys / values in the cache layout
    (append them to the shard to cache the new tokens). Collective over ``groups`` (None: one process).
    """
    U, R, ug, rg = _sizes(groups)
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [b, s, h, d] "
            f"and [b, s, h_kv, d] with the same b, s"
        )
    if (cache_k is None) != (cache_v is None):
        raise ValueError("cache_k and cache_v must both be given or both be None")
    if new_mask is not None and not isinstance(new_mask, AttentionMask):
        raise ValueError(f"new_mask ({type(new_mask).__name__}) must be None or an AttentionMask")
    check_heads(q.shape[2], k.shape[2], U)
    if groups is not None and groups.cp_size > 1:
        comm.check_same_shape({"q": q, "k": k}, groups.cp_group, "cached_attention")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    s = q.shape[1]
    if U > 1:
        q = seq_to_heads(q, ug, "kv_cache.q")
        k = seq_to_heads(prepare_kv(k, U), ug, "kv_cache.k")
        v = seq_to_heads(prepare_kv(v, U), ug, "kv_cache.v")
    q_ids, all_ids = _ring_ids(groups, s)
    k_all = comm.all_gather_cat(k, rg, dim=1, tag="kv_cache.new_kv") if R > 1 else k
    v_all = comm.all_gather_cat(v, rg, dim=1, tag="kv_cache.new_kv") if R > 1 else v
    dense = None if new_mask is None else new_mask.dense(q_ids, all_ids).to(q.device)
    parts = [_partial(q, k_all, v_all, dense, scale, backend)]
    if cache_k is not None:
        if cache_k.shape[0] != q.shape[0] or cache_k.shape[2:] != k.shape[2:]:
            raise ValueError(
                f"cache_k {tuple(cache_k.shape)} must be [b = {q.shape[0]}, n, "
                f"{k.shape[2]}, {k.shape[3]}] (this rank's shard of the cache)"
            )
        q_all = comm.all_gather_cat(q, rg, dim=1, tag="kv_cache.q_ring") if R > 1 else q
        cdense = None
        if cache_mask is not None:
            if cache_tags is None or cache_tags.numel() != cache_k.shape[1]:
                raise ValueError("cache_mask needs cache_tags, one per cached token of the shard")
            cdense = cache_mask.dense(all_ids, cache_tags.cpu()).to(q.device)
        o, lse = _partial(q_all, cache_k, cache_v, cdense, scale, backend)
        if R > 1:  # ring rank i's partial of my queries -> me
            m = q.shape[1]
            o = comm.all_to_all_single(o.unflatten(1, (R, m)).movedim(1, 0), rg, "kv_cache.partial")
            lse = comm.all_to_all_single(
                lse.unflatten(2, (R, m)).movedim(2, 0), rg, "kv_cache.partial"
            )
            parts += [(o[i], lse[i]) for i in range(R)]
        else:
            parts.append((o, lse))
    out = _merge(parts).to(q.dtype)
    if U > 1:
        out = heads_to_seq(out, ug, "kv_cache.out")
    return out, k, v


class KVCache:
    """Per-layer cache shards of this rank (``cached_attention``'s layout), each token tagged.

    ``shard(key) -> (k, v, tags)`` or None; ``append(key, k, v, tags)``; ``keep(fn)`` keeps the
    tokens whose tag satisfies ``fn(tags) -> bool`` in every layer; ``nbytes()`` this rank's
    bytes. Layers are keyed by the core-attention module that owns them. ``text_kv`` memoises
    the cross-attention keys / values per prompt (``clear`` / ``keep`` leave them)."""

    def __init__(self):
        self._layers: Dict[object, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._text: Dict[object, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def shard(self, key):
        return self._layers.get(key)

    def append(self, key, k: torch.Tensor, v: torch.Tensor, tags: torch.Tensor) -> None:
        old = self._layers.get(key)
        if old is not None:
            k, v = torch.cat([old[0], k], dim=1), torch.cat([old[1], v], dim=1)
            tags = torch.cat([old[2], tags])
        self._layers[key] = (k, v, tags)

    def keep(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for key, (k, v, tags) in list(self._layers.items()):
            idx = torch.nonzero(fn(tags), as_tuple=False).flatten()
            if idx.numel() != tags.numel():
                dev = idx.to(k.device)
                self._layers[key] = (k.index_select(1, dev), v.index_select(1, dev), tags[idx])

    def clear(self) -> None:
        self._layers.clear()

    def tags(self) -> Optional[torch.Tensor]:
        """The tags of the first layer (every layer holds the same tokens)."""
        first = next(iter(self._layers.values()), None)
        return None if first is None else first[2]

    def nbytes(self) -> int:
        """This rank's bytes of the self-attention cache (``text_nbytes``: the text's)."""
        return sum(k.nbytes + v.nbytes for k, v, _ in self._layers.values())

    def text_nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for _, k, v in self._text.values())

    def text_kv(self, key, context: torch.Tensor, project) -> Tuple[torch.Tensor, torch.Tensor]:
        """The cross-attention ``(k, v)`` of ``context [B, L, ...]`` for the layer ``key``, where
        ``project(rows) -> (k, v)`` with leading dim ``rows.shape[0]``. A row equal to the stored
        context's row reuses its keys / values; the other rows (a new prompt) are projected, as
        one batch, and stored. So the text is projected once per prompt, a prompt switch
        invalidates exactly the rows it changes, and CFG's positive and negative rows are kept
        apart (a switch leaves the negative rows). The result is bitwise what ``project(context)``
        gives for rows that were projected in the same batch."""
        old = self._text.get(key)
        if old is None or old[0].shape != context.shape or old[0].dtype != context.dtype:
            k, v = project(context)
        else:
            same = (old[0] == context.to(old[0].device)).flatten(1).all(dim=1)
            changed = torch.nonzero(~same, as_tuple=False).flatten()
            k, v = old[1], old[2]
            if changed.numel() == same.numel():
                k, v = project(context)
            elif changed.numel():
                rows = changed.to(context.device)
                k_new, v_new = project(context.index_select(0, rows))
                rows = rows.to(k.device)
                k, v = k.index_copy(0, rows, k_new), v.index_copy(0, rows, v_new)
        self._text[key] = (context, k, v)
        return k, v


def text_kv(step, key, context: torch.Tensor, project) -> Tuple[torch.Tensor, torch.Tensor]:
    """A cross-attention layer's ``(k, v)``: ``project(context)``, memoised per prompt in the
    cache of ``step`` when it is a ``CacheStep`` (the layer's attention mask in a generation call;
    ``KVCache.text_kv``), computed afresh otherwise (training, no cache)."""
    if isinstance(step, CacheStep):
        return step.cache.text_kv(key, context, project)
    return project(context)


class CacheStep:
    """One model call against ``cache``: passed as the call's attention mask, it makes every core
    attention that understands it (``DistAttention2D``) run ``cached_attention`` on its layer's
    shard. ``tags [N*s]``: one tag per new token (global new-token order); ``append``: add the new
    keys / values to the cache (tagged); ``new_mask``, ``cache_mask`` (on new-token index and
    cached tag): as ``cached_attention``'s."""

    def __init__(
        self,
        cache: KVCache,
        tags: torch.Tensor,
        append: bool = False,
        new_mask: Optional[AttentionMask] = None,
        cache_mask: Optional[AttentionMask] = None,
    ):
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache ({type(cache).__name__}) must be a KVCache")
        self.cache, self.tags, self.append, self.new_mask = cache, tags.cpu(), append, new_mask
        self.cache_mask = cache_mask

    def attend(self, key, q, k, v, groups, softmax_scale=None, backend="auto") -> torch.Tensor:
        """``[b, s, h, d]`` in / out (``cached_attention``), for the layer ``key``."""
        shard = self.cache.shard(key)
        ck, cv, ctags = (None, None, None) if shard is None else shard
        out, k_new, v_new = cached_attention(
            q,
            k,
            v,
            ck,
            cv,
            groups,
            new_mask=self.new_mask,
            cache_mask=self.cache_mask,
            cache_tags=ctags,
            softmax_scale=softmax_scale,
            backend=backend,
        )
        if self.append:
            q_ids, _ = _ring_ids(groups, q.shape[1])
            if self.tags.numel() <= int(q_ids.max()):
                raise ValueError(
                    f"tags ({self.tags.numel()}) must have one entry per new token "
                    f"(at least {int(q_ids.max()) + 1})"
                )
            self.cache.append(key, k_new, v_new, self.tags[q_ids])
        return out
