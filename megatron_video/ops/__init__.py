"""Python front of the ``megatron_video._C`` kernels, each with a pure-PyTorch reference.

The extension is optional: without it every op runs its reference (one warning per process says
so). ``MEGATRON_VIDEO_OPS=auto|reference|extension`` forces either path (see ``_backend``).
"""

from ._backend import ENV_VAR, active_backend
from .halo import (
    LAYOUTS,
    PackedWindows,
    halo_gather,
    halo_gather_packed,
    halo_gather_reference,
    halo_scatter,
    halo_scatter_reference,
)
from .masks import (
    RULES,
    FlexBlockFields,
    TokenIds,
    block_mask_status,
    block_mask_status_reference,
    dense_mask,
    dense_mask_reference,
    flex_block_fields,
    flex_block_mask,
    lower_triangle,
    mask_mod,
)

__all__ = [
    "ENV_VAR",
    "LAYOUTS",
    "RULES",
    "FlexBlockFields",
    "PackedWindows",
    "TokenIds",
    "active_backend",
    "block_mask_status",
    "block_mask_status_reference",
    "dense_mask",
    "dense_mask_reference",
    "flex_block_fields",
    "flex_block_mask",
    "halo_gather",
    "halo_gather_packed",
    "halo_gather_reference",
    "halo_scatter",
    "halo_scatter_reference",
    "lower_triangle",
    "mask_mod",
]
