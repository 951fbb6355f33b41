"""Exact context-parallel attention (Ulysses x ring), local kernels with LSE, and masks."""

from . import masks
from .attention_2d import dist_attention, resolve_scheme, ring_token_ids
from .engine import EngineStats, local_attention
from .kernels import attention_backward, attention_forward, dense_local_attention
from .masks import AttentionMask
from .ring import RingStats

__all__ = [
    "masks",
    "dist_attention",
    "resolve_scheme",
    "ring_token_ids",
    "attention_backward",
    "attention_forward",
    "local_attention",
    "dense_local_attention",
    "AttentionMask",
    "RingStats",
    "EngineStats",
]
