"""What the 2D-attention benchmarks (``attention_memory.py``, ``attention_overhead.py``) share:
their masks and the U2 x R2 groups of 4 ranks as 2 simulated nodes x 2."""

from __future__ import annotations

from contextlib import contextmanager

U, R = 2, 2
N = U * R


def attention_mask(name: str, S: int):
    """``(mask, scheme)`` of the benchmark mask ``name`` (causal, block_causal over 32 frames,
    teacher_forcing over 32 latent frames in blocks of 2) at sequence length ``S``."""
    from megatron_video.attention import masks
    from megatron_video.diffusion.teacher_forcing import TeacherForcingMask
    from megatron_video.layouts import BalancedSPLayout

    if name == "causal":
        return masks.causal(), "zigzag"
    if name == "block_causal":
        return masks.block_causal(S // 32), "zigzag"  # 32 frames
    F = 32  # latent frames; [clean; noisy] -> 2 * F * tokens = S
    lay = BalancedSPLayout(
        num_latent_frames=F,
        tokens_per_frame=S // (2 * F),
        frames_per_block=2,
        sp_size=N,
        ring_size=R,
    )
    return TeacherForcingMask(lay), "contiguous"


@contextmanager
def u2r2_groups():
    """Megatron's model-parallel state (CP 4 as [U, R] = [2, 2]) and the U2 x R2 video groups on
    2 ranks per node, torn down on exit; yields the groups."""
    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.parallel import destroy_video_parallel, init_video_parallel

    initialize_model_parallel(
        tensor_model_parallel_size=1,
        context_parallel_size=N,
        hierarchical_context_parallel_sizes=[U, R],
    )
    groups = init_video_parallel(U, R, ranks_per_node=2)
    try:
        yield groups
    finally:
        destroy_video_parallel()
        destroy_model_parallel()
