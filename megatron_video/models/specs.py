"""Megatron ModuleSpecs: the drop-in surface of megatron_video. ``with_2d_attention(layer_spec,
**params)`` puts ``DistAttention2D`` into any Megatron layer (or block) spec, local or TE; the
module-level specs work with Megatron-LM's ``--spec megatron_video.models.specs <name>``.
Design: docs/architecture.md, "Megatron integration" and "Groups".
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from ..attention.megatron import DistAttention2D

__all__ = [
    "with_2d_attention",
    "gpt_layer_local_2d_spec",
    "gpt_layer_local_2d_qknorm_spec",
    "SKIPPED_SLOTS",
]


# Attention slots whose core is not sequence-wide self-attention and is left alone: cross-attention
# to short text (no CP), and ST-DiT's spatial / temporal attention (local rows of one frame / one
# position, cut by the layer; docs/architecture.md, "Megatron integration").
SKIPPED_SLOTS = ("cross_attention", "spatial_attention", "temporal_attention")


def _swap(obj, params) -> int:
    """Replace every self-attention ``core_attention`` below ``obj`` in place; return the count.

    A slot that already holds a ``DistAttention2D`` keeps its parameters (e.g. the video DiTs'
    ``scheme="contiguous"``) where ``params`` does not override them."""
    if isinstance(obj, ModuleSpec):
        return _swap(obj.submodules, params)
    if isinstance(obj, (list, tuple)):
        return sum(_swap(x, params) for x in obj)
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return 0
    count = 0
    for f in dataclasses.fields(obj):
        if f.name in SKIPPED_SLOTS:
            continue
        if f.name == "core_attention":
            old = getattr(obj, f.name)
            kept = {}
            if (
                isinstance(old, ModuleSpec)
                and isinstance(old.module, type)
                and issubclass(old.module, DistAttention2D)
            ):
                kept = dict(old.params or {})
            setattr(obj, f.name, ModuleSpec(module=DistAttention2D, params={**kept, **params}))
            count += 1
        else:
            count += _swap(getattr(obj, f.name), params)
    return count


def _copy_tree(obj):
    """A copy of a spec tree's structure (ModuleSpecs, submodule dataclasses, lists, tuples, dicts,
    ``functools.partial`` builders); the leaves -- module classes, enums, masks, process groups --
    are shared, not copied (they need not be copyable)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _copy_tree(getattr(obj, f.name)))
        return new
    if isinstance(obj, list):
        return [_copy_tree(x) for x in obj]
    if type(obj) is tuple:
        return tuple(_copy_tree(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _copy_tree(v) for k, v in obj.items()}
    if isinstance(obj, functools.partial):
        return functools.partial(
            obj.func,
            *(_copy_tree(a) for a in obj.args),
            **{k: _copy_tree(v) for k, v in obj.keywords.items()},
        )
    return obj


def with_2d_attention(layer_spec, **params):
    """A copy of ``layer_spec`` (local or TE, layer or block) with 2D attention as core attention.

    ``layer_spec``: Megatron's GPT specs or the video DiT specs (``models.dit_layer_specs``);
    every self-attention core becomes :class:`~megatron_video.attention.megatron.DistAttention2D`
    (Ulysses x ring, exact, masks on global token ids) with ``params`` for its constructor
    (``mask``, ``scheme``, ``backend``, ``groups``). Without ``groups`` the layer takes its groups
    from Megatron (``pg_collection`` / parallel state) and its scheme from ``config.cp_comm_type``
    at the first forward, so a stock Megatron job needs nothing else.
    """
    spec = _copy_tree(layer_spec)
    if _swap(spec, params) == 0:
        raise ValueError(
            f"layer_spec ({type(layer_spec).__name__}) has no self-attention "
            f"core_attention submodule to replace"
        )
    return spec


# Module-level specs for ``--spec megatron_video.models.specs <name>`` (Megatron-core modules only).
gpt_layer_local_2d_spec = with_2d_attention(get_gpt_layer_local_spec())
gpt_layer_local_2d_qknorm_spec = with_2d_attention(get_gpt_layer_local_spec(qk_layernorm=True))

try:  # TE layers (fused linears / norms) around our attention, where TransformerEngine is installed
    import transformer_engine  # noqa: F401

    gpt_layer_te_2d_spec = with_2d_attention(get_gpt_layer_with_transformer_engine_spec())
    __all__.append("gpt_layer_te_2d_spec")
except ImportError:
    pass
