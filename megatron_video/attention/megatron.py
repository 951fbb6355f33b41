"""Megatron-Core drop-in: a core-attention module that runs ``dist_attention`` (Ulysses x ring).

``DistAttention2D`` has the constructor and forward of Megatron's core attention
(``DotProductAttention`` / ``TEDotProductAttention``), so ``models.specs.with_2d_attention`` can put
it into any layer spec. It takes ``query [s_local, b, heads/TP, d]`` and ``key, value
[s_local, b, kv_heads/TP, d]`` (RoPE / QK-norm already applied by ``Attention``) and returns
``[s_local, b, heads/TP * d]``.

Groups (docs/architecture.md, "Groups"): from Megatron, at the first forward -- the
``pg_collection`` Megatron's ``Attention`` hands over, else ``parallel_state`` -- with
``cp_comm_type`` choosing the scheme exactly as for Transformer Engine: ``"a2a+p2p"`` = Ulysses over
the hierarchical level 0 x ring over level 1, ``"p2p"`` (or unset) = ring, ``"a2a"`` = Ulysses,
``"all_gather"`` = ``ValueError``. A stock Megatron job therefore needs nothing but the spec. Explicit
control: pass ``groups=init_video_parallel(...)`` in the spec's params, or call
``init_video_parallel`` (its groups are used on the CP group they were made for; the one rule is
``parallel.topology.resolve_video_groups``, shared with the video-DiT layers). The token layout is
``scheme`` over the CP group; the default ``"zigzag"`` is Megatron-LM's ``get_batch_on_this_cp_rank``
cut (2*CP chunks, CP rank c keeps chunks c and 2CP-1-c). A packed micro-batch placed per call
(``layouts.placement``) passes ``placement=`` to ``forward``, which wins over ``scheme``.

Masks: an ``AttentionMask`` passed as ``attention_mask`` (per call; the video layers use it for
teacher forcing and the ST-DiT baselines) wins; else ``attn_mask_type`` causal ->
``masks.causal()``, no_mask -> full (a dense ``attention_mask``
is then ignored, as Transformer Engine's core attention does: the type decides); a spec may instead
pass any ``AttentionMask`` as ``params={"mask": ...}`` (block-causal video, teacher forcing, ...),
which wins. Other mask types, ``attention_bias`` and packed ``thd`` input with CP > 1 raise
``ValueError`` (masks here are functions of global token ids, which is what lets ring steps be
derived and skipped; use ``masks.packed(...)`` over the laid-out sequence instead). Packed ``thd``
input is supported with CP = 1 (documents from ``cu_seqlens_q``); ``PackedSeqParams`` with
``qkv_format="sbhd"`` at any CP size gives the documents of the global (unsharded) ``[s, b]``
sequence, ``masks.packed(cu_seqlens_q, inner=causal)`` (Megatron's RoPE stays the zigzag one:
positions are global; what ``mmsp.MMSPLLaVAModel`` uses for packed samples). ``apply_query_key_layer_scaling``
is exact: Megatron divides the scores by the layer number and multiplies it back inside its softmax,
so the softmax sees ``softmax_scale`` either way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..compat.cp_comm_type import core_cp_comm_type
from ..layouts.zigzag import SCHEMES, as_placement
from ..parallel.comm import check_same_shape
from ..parallel.topology import VideoParallelGroups, check_cp_comm_type, resolve_video_groups
from . import masks as masks_mod
from .attention_2d import dist_attention
from .engine import local_attention
from .kv_cache import CacheStep
from .ulysses import check_heads, heads_to_seq, prepare_kv, seq_to_heads

__all__ = ["DistAttention2D", "UlyssesAttention", "LocalDotProductAttention"]


class DistAttention2D(MegatronModule):
    """Exact 2D context-parallel core attention with Megatron's core-attention interface."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        mask: Optional[masks_mod.AttentionMask] = None,
        scheme: str = "zigzag",
        backend: str = "auto",
        groups: Optional[VideoParallelGroups] = None,
        **kwargs,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"attention_dropout ({dropout}) must be 0 for DistAttention2D (dropout on "
                f"attention probabilities is not part of the exact ring)"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"softmax_type ({config.softmax_type!r}) must be 'vanilla' for DistAttention2D"
            )
        if getattr(config, "window_size", None) is not None:
            raise ValueError(
                f"window_size ({config.window_size}) is not supported by DistAttention2D; "
                f"pass a masks.predicate(...) as the spec's mask instead"
            )
        if attention_type != "self":
            raise ValueError(
                f"attention_type ({attention_type!r}) must be 'self' (cross-attention to a "
                f"short context does not use CP)"
            )
        if mask is not None and not isinstance(mask, masks_mod.AttentionMask):
            raise ValueError(f"mask ({mask!r}) must be None or a megatron_video AttentionMask")
        if scheme not in SCHEMES:
            raise ValueError(f"scheme ({scheme!r}) must be one of {SCHEMES} (the CP token layout)")
        if groups is not None and not isinstance(groups, VideoParallelGroups):
            raise ValueError(
                f"groups ({type(groups).__name__}) must be None or the "
                f"VideoParallelGroups of init_video_parallel(...)"
            )
        self.layer_number = max(1, layer_number)
        # the layer's entry of a list-valued config.cp_comm_type (compat.cp_comm_type)
        self.cp_comm_type = check_cp_comm_type(
            core_cp_comm_type(config, self.layer_number, cp_comm_type)
        )
        self.pg_collection = pg_collection
        self.attn_mask_type = attn_mask_type
        self.mask, self.scheme, self.backend = mask, scheme, backend
        self._groups, self._resolved = groups, groups is not None
        head_dim = config.kv_channels
        # apply_query_key_layer_scaling needs nothing here: Megatron's 1/layer_number on the scores
        # is undone by the same factor inside its softmax (see the module docstring).
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

    def video_groups(self) -> Optional[VideoParallelGroups]:
        """The U x R groups this layer runs on (resolved at the first call by
        ``parallel.topology.resolve_video_groups``: spec ``groups``, else ``init_video_parallel``'s,
        else Megatron's ``pg_collection`` / parallel state with ``cp_comm_type``)."""
        if not self._resolved:
            self._groups = resolve_video_groups(self._groups, self.pg_collection, self.cp_comm_type)
            self._resolved = True
        return self._groups

    def _mask(self, attn_mask_type, packed_seq_params, attention_mask=None):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if isinstance(attention_mask, masks_mod.AttentionMask):  # per call (video layers)
            return attention_mask
        if self.mask is not None:
            return self.mask
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        inner = masks_mod.causal() if causal else None
        if packed_seq_params is not None:
            return _packed_mask(packed_seq_params, self.video_groups(), inner)
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(
                f"attn_mask_type ({mask_type}) needs a dense attention_mask, which "
                f"DistAttention2D does not take; give the spec a megatron_video "
                f"AttentionMask (params={{'mask': ...}})"
            )
        return inner

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        placement=None,
        **kwargs,
    ):
        if isinstance(attention_mask, CacheStep):  # a call against a KV cache (generation)
            return self._cached(query, key, value, attention_mask)
        if placement is not None and as_placement(placement) is None:
            raise ValueError(
                f"placement ({type(placement).__name__}) must be None or a "
                f"megatron_video.layouts.placement.Placement"
            )
        if attention_bias is not None:
            raise ValueError(
                f"attention_bias ({type(attention_bias).__name__} "
                f"{tuple(getattr(attention_bias, 'shape', ()))}) is not supported by "
                f"DistAttention2D: it must be None (express the bias-free mask as a "
                f"megatron_video AttentionMask on global token ids)"
            )
        groups = self.video_groups()
        cp = groups.cp_size if groups is not None else 1
        if cp != self.config.context_parallel_size:
            raise ValueError(
                f"config.context_parallel_size ({self.config.context_parallel_size}) "
                f"must equal the size of the CP group Megatron set up ({cp}): call "
                f"initialize_model_parallel(context_parallel_size=...) before the "
                f"forward"
            )
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed_seq_params is not None:  # checked even when another mask wins
            _packed_mask(packed_seq_params, groups, None)
        mask = self._mask(attn_mask_type, packed_seq_params, attention_mask)
        if thd:  # [t, h, d] -> [1, t, h, d]
            q, k, v = query[None], key[None], value[None]
        else:  # Megatron's [s, b, h, d] -> [b, s, h, d]
            q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        out = dist_attention(
            q,
            k,
            v,
            groups,
            mask=mask,
            softmax_scale=self.softmax_scale,
            scheme=self.scheme if placement is None else placement,
            backend=self.backend,
        )
        if thd:
            return out[0].reshape(out.shape[1], -1)
        return out.transpose(0, 1).reshape(out.shape[1], out.shape[0], -1)

    def _cached(self, query, key, value, step: CacheStep):
        """``kv_cache.cached_attention`` on this layer's cache shard (Megatron ``[s, b, h, d]``)."""
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        out = step.attend(self, q, k, v, self.video_groups(), self.softmax_scale, self.backend)
        return out.transpose(0, 1).reshape(out.shape[1], out.shape[0], -1)


_PACKED_MEMO = "_megatron_video_packed_masks"


def _packed_mask(params, groups, inner):
    """The checked ``masks.packed`` of a ``PackedSeqParams``, memoised on the params object: Megatron
    hands the same object to every layer of a micro-batch, so its ``cu_seqlens`` are read on the
    host (and compared) once per micro-batch, not once per layer. A field replaced or modified in
    place (tensor identity, ``_version``) is read again."""
    fields = (params.cu_seqlens_q, params.cu_seqlens_kv, params.cu_seqlens_q_padded)
    state = (params.qkv_format, tuple(getattr(t, "_version", None) for t in fields))
    memo = params.__dict__.setdefault(_PACKED_MEMO, {})
    hit = memo.get("state")
    if hit is None or hit[1] != state or any(a is not b for a, b in zip(hit[0], fields)):
        memo.clear()
        memo["state"] = (fields, state)
        memo["host_cu"] = _check_packed(params, groups.cp_size if groups is not None else 1)
    if inner not in memo:
        memo[inner] = masks_mod.packed(memo["host_cu"], inner=inner)
    return memo[inner]


def _check_packed(params, cp: int) -> torch.Tensor:
    """``cu_seqlens_q`` on the host, or ``ValueError`` for a layout DistAttention2D cannot run."""
    cu_q, padded = params.cu_seqlens_q, params.cu_seqlens_q_padded
    thd, sbhd = params.qkv_format == "thd", params.qkv_format == "sbhd"
    host = cu_q.cpu()
    if (
        not (thd or sbhd)
        or (thd and cp > 1)
        or (padded is not None and not torch.equal(padded.cpu(), host))
        or not torch.equal(params.cu_seqlens_kv.cpu(), host)
    ):
        raise ValueError(
            f"packed_seq_params (qkv_format {params.qkv_format!r}, context_parallel_size {cp}): "
            f"supported are qkv_format 'thd' at context_parallel_size 1 and 'sbhd' (documents "
            f"on the global, unsharded sequence, any CP size), both without padding and with "
            f"cu_seqlens_q == cu_seqlens_kv; or give the spec a masks.packed(...) mask"
        )
    return host


class UlyssesAttention(DistAttention2D):
    """``DistAttention2D`` with the whole CP group as one Ulysses (all-to-all) group, no ring.

    The ST-DiT "Ulysses everywhere" baseline: 4 all-to-alls per attention (q, k, v, out). With a
    ``masks.VideoRows`` mask (spatial / temporal attention) the gathered whole sequence is cut into
    its rows (frames / positions) and attended row by row, as a Ulysses implementation would."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        groups = self.video_groups()
        if (
            not isinstance(attention_mask, masks_mod.VideoRows)
            or groups is None
            or groups.cp_size == 1
            or attention_bias is not None
            or packed_seq_params is not None
        ):
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type,
                attention_bias,
                packed_seq_params,
                **kwargs,
            )
        if self.scheme != "contiguous":
            raise ValueError(f"scheme ({self.scheme!r}) must be 'contiguous' for video rows")
        P, group = groups.cp_size, groups.cp_group
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s_local, h, d]
        s_local = q.shape[1]
        check_heads(q.shape[2], k.shape[2], P)
        check_same_shape({"q": q, "k": k, "v": v}, group, "UlyssesAttention")
        q = seq_to_heads(q, group, "ulysses.q")  # [b, S, h/P, d]
        k = seq_to_heads(prepare_kv(k, P), group, "ulysses.k")
        v = seq_to_heads(prepare_kv(v, P), group, "ulysses.v")
        b, S, _, d = q.shape
        n = attention_mask.positions
        if S % n:
            raise ValueError(
                f"sequence length ({S}) must be a multiple of the mask's positions ({n})"
            )
        t = S // n

        def rows(x):
            if attention_mask.pattern == "spatial":
                return x.reshape(b * t, n, x.shape[2], d)
            return (
                x.reshape(b, t, n, x.shape[2], d).transpose(1, 2).reshape(b * n, t, x.shape[2], d)
            )

        o = local_attention(
            rows(q), rows(k), rows(v), None, self.softmax_scale, backend=self.backend
        )[0]
        h = o.shape[2]
        if attention_mask.pattern == "temporal":
            o = o.reshape(b, n, t, h, d).transpose(1, 2)
        o = heads_to_seq(o.reshape(b, S, h, d), group, "ulysses.out")  # [b, s_local, h, d]
        return o.transpose(0, 1).reshape(s_local, b, -1)

    def video_groups(self) -> Optional[VideoParallelGroups]:
        if not self._resolved:
            g = resolve_video_groups(self._groups, self.pg_collection, self.cp_comm_type)
            if g is not None and g.ring_size > 1:
                me = g.cp_ranks[g.cp_rank]
                g = dataclasses.replace(
                    g,
                    ulysses_group=g.cp_group,
                    ring_group=None,
                    ulysses_size=g.cp_size,
                    ring_size=1,
                    ulysses_ranks=list(g.cp_ranks),
                    ring_ranks=[me],
                    ulysses_rank=g.cp_rank,
                    ring_rank=0,
                    placement="ulysses_inner",
                )
            self._groups, self._resolved = g, True
        return self._groups


class LocalDotProductAttention(MegatronModule):
    """Core attention on this rank only (no context parallelism), Megatron's core-attention interface.

    For attention over short sequences a layer has already made local (ST-DiT spatial / temporal
    attention, whose rows are whole frames or whole positions): ``query [s, b, h, d]``, ``key,
    value [s, b, h_kv, d]`` -> ``[s, b, h*d]``; full attention (no mask) or causal by
    ``attn_mask_type``; an ``AttentionMask`` as ``attention_mask`` is applied on local positions.
    """

    def __init__(
        self,
        config,
        layer_number: int = 1,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        backend: str = "auto",
        **kwargs,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"attention_dropout ({dropout}) must be 0 for LocalDotProductAttention"
            )
        self.attn_mask_type, self.backend = attn_mask_type, backend
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "attention_bias and packed_seq_params must be None for LocalDotProductAttention"
            )
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask = None
        if isinstance(attention_mask, masks_mod.AttentionMask):
            mask = attention_mask
        elif mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
            mask = masks_mod.causal()
        out = local_attention(q, k, v, mask, self.softmax_scale, backend=self.backend)[0]
        return out.transpose(0, 1).reshape(out.shape[1], out.shape[0], -1)
