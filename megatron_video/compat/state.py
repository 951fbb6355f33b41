"""Parallel-state teardown that also clears what some Megatron versions forget."""

import torch.distributed as dist


def destroy_model_parallel() -> None:
    """``parallel_state.destroy_model_parallel`` that also frees the process groups it created.

    megatron-core 0.16.1 drops its references to the groups but neither destroys them (with gloo
    every group keeps its TCP loop threads alive, so processes that re-initialise many times pile
    up thousands of threads) nor clears ``_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``. Both are
    feature-detected by attribute, not by version. Collective: call it on every rank.
    """
    from megatron.core import parallel_state as ps

    groups = [g for g in (getattr(ps, "_global_process_group_list", None) or []) if g is not None]
    ps.destroy_model_parallel()
    if getattr(ps, "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS", None) is not None:
        ps._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    if hasattr(ps, "_global_process_group_list"):
        ps._global_process_group_list = None
    if dist.is_initialized():
        for g in groups:
            if g is not dist.GroupMember.WORLD and g != dist.GroupMember.NON_GROUP_MEMBER:
                try:
                    dist.destroy_process_group(g)
                except (ValueError, RuntimeError):  # already destroyed
                    pass
