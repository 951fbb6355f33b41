"""The engine's FlexAttention: a plan's tile status as a ``BlockMask`` and one block call with its
log-sum-exp, compiled with dynamic lengths inside the compile bound on CUDA; on CPU (the
``backend="flex"`` check path) torch's unfused flex math path, which also has a backward there."""

from __future__ import annotations

import functools
import math
import warnings

from .. import kernels
from .planning import BlockPlan

__all__ = ["block_mask", "flex_lse"]

_LN2 = math.log(2.0)


def block_mask(plan: BlockPlan, device):
    """FlexAttention ``BlockMask`` of the block: PARTIAL tiles masked by ``mask_mod`` on global ids,
    FULL tiles without it, EMPTY tiles absent (built once per plan)."""
    from torch.nn.attention.flex_attention import BlockMask

    from ...ops.masks import flex_block_fields

    if plan.flex is None:
        qi, ki = plan.q_ids.to(device), plan.k_ids.to(device)
        mod = plan.mask.mask_mod(qi, ki) if plan.mask is not None else None
        fields = flex_block_fields(plan.status.to(device))
        plan.flex = BlockMask.from_kv_blocks(
            *fields,
            BLOCK_SIZE=(plan.tile, plan.tile),
            mask_mod=mod,
            seq_lengths=(qi.numel(), ki.numel()),
        )
    return plan.flex


@functools.lru_cache(maxsize=None)
def _cpu_hop():
    """torch's flex higher-order op and its kernel options (feature-detected): the public call
    refuses inputs that require grad on CPU, the op itself runs its math path with a backward."""
    try:
        from torch._higher_order_ops.flex_attention import flex_attention as hop
        from torch.nn.attention.flex_attention import _apply_kernel_options, _identity
    except ImportError:
        return None
    return hop, _apply_kernel_options, _identity


def flex_lse(q, k, v, bm, scale: float):
    """``(out [b, h, s, d], lse [b, h, s])`` of ``q [b, h, s, d]`` over ``k, v [b, hk, s, d]`` under
    BlockMask ``bm``; differentiable when the inputs require grad."""
    gqa = k.shape[1] != q.shape[1]
    if q.is_cuda:
        with kernels.flex_compile_bound():
            return kernels._compiled_flex("cuda")(
                q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa, return_lse=True
            )
    hop = _cpu_hop()
    if hop is None:
        raise ValueError("backend ('flex') on CPU needs torch's flex_attention higher-order op")
    op, options, identity = hop
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out, lse2, _ = op(q, k, v, identity, bm.as_tuple(), scale, options(q, k, v, True, None))
    return out, lse2 * _LN2  # the math path's log-sum-exp is in base 2
