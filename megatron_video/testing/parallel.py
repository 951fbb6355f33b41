"""Megatron set-up for tests: ``model_parallel(...)`` and ``video_parallel(...)`` context managers.

Like Megatron-LM's ``tests/unit_tests/test_utilities.Utils``: destroy any earlier state, call
``initialize_model_parallel`` (the kwargs this megatron-core accepts), optionally seed the
model-parallel RNG, and destroy everything on exit, also when the body raises. Collective: enter
and leave on every rank of the process group.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

__all__ = ["model_parallel", "video_parallel"]


def _destroy() -> None:
    from megatron_video.compat import destroy_model_parallel
    from megatron_video.parallel import destroy_video_parallel

    destroy_video_parallel()
    destroy_model_parallel()


@contextlib.contextmanager
def model_parallel(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    hierarchical_cp: Optional[Sequence[int]] = None,
    seed: Optional[int] = None,
    **kwargs,
):
    """Megatron parallel state with TP ``tp``, PP ``pp``, CP ``cp`` (``hierarchical_cp``: Megatron's
    ``hierarchical_context_parallel_sizes``); ``seed``: ``model_parallel_cuda_manual_seed(seed)``.
    Other ``kwargs`` go to ``initialize_model_parallel`` as they are."""
    from megatron.core import parallel_state as ps

    from megatron_video.compat import ensure_cpu_mode, initialize_model_parallel

    ensure_cpu_mode()
    if ps.model_parallel_is_initialized():
        _destroy()
    kw = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        **kwargs,
    )
    if hierarchical_cp is not None:
        kw["hierarchical_context_parallel_sizes"] = list(hierarchical_cp)
    initialize_model_parallel(**kw)
    try:
        if seed is not None:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        _destroy()


@contextlib.contextmanager
def video_parallel(
    ulysses: int,
    ring: int,
    placement: str = "ulysses_inner",
    *,
    tp: int = 1,
    pp: int = 1,
    hierarchical: Optional[bool] = None,
    ranks_per_node: Optional[int] = None,
    seed: Optional[int] = None,
):
    """``model_parallel`` with CP = ``ulysses * ring``, then ``init_video_parallel``; yields the
    groups. ``hierarchical`` (default: both degrees > 1) also makes Megatron's hierarchical CP
    groups, ordered by ``placement``; ``ranks_per_node`` goes to ``init_video_parallel`` (None:
    ``LOCAL_WORLD_SIZE``)."""
    from megatron_video.parallel import init_video_parallel

    if hierarchical is None:
        hierarchical = ulysses > 1 and ring > 1
    hier = None
    if hierarchical:
        hier = [ulysses, ring] if placement == "ulysses_inner" else [ring, ulysses]
    with model_parallel(tp=tp, pp=pp, cp=ulysses * ring, hierarchical_cp=hier, seed=seed):
        yield init_video_parallel(ulysses, ring, ranks_per_node=ranks_per_node, placement=placement)
