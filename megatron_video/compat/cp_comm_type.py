"""Per-layer ``cp_comm_type``: the one lookup every layer and core attention uses.

megatron-core 0.19 ``TransformerLayer.__init__`` reads ``config.cp_comm_type[layer_number - 1]``
(layers 1-based); 0.16.1 reads ``[layer_number]``: one layer off, and ``IndexError`` on the last
layer of the full-length list its config requires. ``megatron_cp_comm_type_index_base`` finds out
which (by running the installed ``TransformerLayer``), ``megatron_reads_layer_cp_comm_type`` makes
it read 0.19's entry. Design: docs/architecture.md, "Groups".
"""

from __future__ import annotations

import functools
import types
import warnings
from contextlib import contextmanager
from typing import Optional

__all__ = [
    "layer_cp_comm_type",
    "core_cp_comm_type",
    "megatron_cp_comm_type_index_base",
    "megatron_reads_layer_cp_comm_type",
]


def layer_cp_comm_type(config, layer_number: int) -> Optional[str]:
    """The ``cp_comm_type`` of 1-based (global) layer ``layer_number``: ``config.cp_comm_type``
    itself, or its entry ``layer_number - 1`` when it is a list (megatron-core 0.19's rule)."""
    comm = getattr(config, "cp_comm_type", None)
    comm = getattr(comm, "unshifted", comm)  # inside megatron_reads_layer_cp_comm_type
    if not isinstance(comm, list):
        return comm
    if not 1 <= layer_number <= len(comm):
        raise ValueError(
            f"layer_number ({layer_number}) must be in [1, {len(comm)}] for the "
            f"list-valued config.cp_comm_type ({comm!r}): layers are 1-based and "
            f"read entry layer_number - 1"
        )
    return comm[layer_number - 1]


def core_cp_comm_type(config, layer_number: int, given: Optional[str]) -> Optional[str]:
    """``given``, the ``cp_comm_type`` a core attention of layer ``layer_number`` was handed by its
    layer; with a list-valued ``config.cp_comm_type`` it must be ``layer_cp_comm_type``'s entry,
    else ``ValueError`` (the layer read another entry, as megatron-core 0.16.1's own
    ``TransformerLayer`` does), so a layer and its core attention never pick different schemes."""
    comm = getattr(config, "cp_comm_type", None)
    if given is None or not isinstance(getattr(comm, "unshifted", comm), list):
        return given
    mine = layer_cp_comm_type(config, layer_number)
    if given != mine:
        raise ValueError(
            f"cp_comm_type ({given!r}) handed to the core attention of layer {layer_number} must "
            f"be config.cp_comm_type[layer_number - 1] ({mine!r}); this megatron-core's "
            f"TransformerLayer reads entry layer_number - 1 + "
            f"{megatron_cp_comm_type_index_base()}: give cp_comm_type as one string"
        )
    return given


class _Read(Exception):
    pass


class _ShiftedForMegatron(list):
    """``cp_comm_type`` as megatron-core 0.16.1 indexes it; ``unshifted`` is the config's list."""

    def __init__(self, unshifted: list):
        super().__init__(unshifted[:1] + unshifted)
        self.unshifted = unshifted


class _RaiseOnRead(list):
    def __getitem__(self, index):
        raise _Read(index)


@functools.lru_cache(maxsize=None)
def megatron_cp_comm_type_index_base() -> Optional[int]:
    """Which entry of a list-valued ``cp_comm_type`` the installed ``TransformerLayer`` reads for
    its layer 1: 0 (megatron-core 0.19), 1 (0.16.1), or ``None`` if it reads none. Found by
    running its ``__init__`` up to the read (no process group, no parameters built)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=2,
            hidden_size=8,
            num_attention_heads=1,
            context_parallel_size=2,
            cp_comm_type=["p2p", "p2p"],
            use_cpu_initialization=True,
        )
        config.cp_comm_type = _RaiseOnRead(config.cp_comm_type)
        layer = TransformerLayer.__new__(TransformerLayer)
        groups = types.SimpleNamespace(tp=None, pp=None, cp=None)
        try:
            TransformerLayer.__init__(
                layer, config, TransformerLayerSubmodules(), layer_number=1, pg_collection=groups
            )
        except _Read as read:
            return int(read.args[0]) - (layer.layer_number - 1)
        except Exception as e:  # noqa: BLE001 -- the probe itself no longer fits this Megatron
            raise RuntimeError(
                f"cannot tell which cp_comm_type entry this megatron-core's "
                f"TransformerLayer reads (probe failed: {e!r})"
            ) from e
    return None


@contextmanager
def megatron_reads_layer_cp_comm_type(config):
    """While a ``TransformerLayer.__init__`` runs inside: Megatron reads ``layer_cp_comm_type``'s
    entry. With megatron-core 0.16.1 (index base 1) ``config.cp_comm_type`` shows a list shifted by
    one; restored on exit. Nothing changes for a string, for CP 1 or with 0.19."""
    comm = config.cp_comm_type
    base = (
        megatron_cp_comm_type_index_base()
        if isinstance(comm, list) and comm and config.context_parallel_size > 1
        else 0
    )
    if not base:
        yield
        return
    if base != 1:
        raise RuntimeError(
            f"this megatron-core's TransformerLayer reads cp_comm_type entry "
            f"layer_number - 1 + {base}; only offsets 0 and 1 are known"
        )
    config.cp_comm_type = _ShiftedForMegatron(comm)
    try:
        yield
    finally:
        config.cp_comm_type = comm
