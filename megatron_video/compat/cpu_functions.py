"""CPU versions of the Megatron-Core functions that the ``torch`` stand-in cannot fix.

Each keeps the signature of the function it replaces (checked when CPU mode is activated) and
differs from it only where the original is CUDA-specific; the reason is given per function.
"""

from __future__ import annotations

import torch

__all__ = [
    "get_rng_state",
    "set_rng_state",
    "clip_grad_by_total_norm_fp32",
    "get_pos_emb_on_this_cp_rank",
]


def get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """``tensor_parallel.random._get_cuda_rng_state`` on CPU: the CPU generator's state (a copy)."""
    if graph_safe:
        raise RuntimeError(
            "CPU mode: graph-safe RNG states need CUDA graphs; "
            "use_cudagraphable_rng must be False without a GPU"
        )
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
    """``tensor_parallel.random._set_cuda_rng_state`` on CPU.

    The original defers the update through ``torch.cuda._lazy_call``, which without a GPU queues it
    forever, so the RNG tracker's ``fork`` and activation recomputation would silently reuse states.
    """
    if graph_safe:
        raise RuntimeError(
            "CPU mode: graph-safe RNG states need CUDA graphs; "
            "use_cudagraphable_rng must be False without a GPU"
        )
    torch.set_rng_state(new_state)


def clip_grad_by_total_norm_fp32(
    parameters, max_norm, total_norm, use_decoupled_grad: bool = False
):
    """``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` without its CUDA tensor-type assert.

    The original asserts ``grad.type() == 'torch.cuda.FloatTensor'``; here the same rule (fp32
    gradients) is checked on the dtype. Scaling is the same in-place multiply.
    """
    from megatron.core.utils import to_local_if_dtensor

    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        if grad.dtype not in allowed:
            raise TypeError(
                f"clip_grad_by_total_norm_fp32: gradient dtype ({grad.dtype}) must be one "
                f"of {allowed}"
            )
        grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """``rope_utils.get_pos_emb_on_this_cp_rank`` on CPU.

    Same zigzag selection (chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``2*cp_size``); the
    original builds the index in pinned memory and moves it with ``.cuda()``.
    """
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size = cp_group.size()
    cp_rank = cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])
