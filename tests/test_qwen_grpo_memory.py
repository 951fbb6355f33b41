"""benchmarks/qwen_grpo_memory.py does not rot: its GRPO step on Qwen2.5-VL
(``testing.qwen_grpo_memory``) runs at a tiny size in the shared pool, and a CP 4 rank holds less
of the step's live tensor bytes than CP 1's one rank (deterministic: ``testing.LiveTensors``)."""

from megatron_video.testing.qwen_grpo_memory import grpo_step_memory


def test_qwen_grpo_step_memory_cp4_below_cp1(pool4):
    one = [r for r in pool4.run(grpo_step_memory, [64], 1, 16, 2, 1) if r]
    four = pool4.run(grpo_step_memory, [64], 4, 16, 2, 1)
    assert len(one) == 1 and len(four) == 4  # CP 1: rank 0 alone
    peak1 = one[0][64][0]
    peaks4 = [r[64][0] for r in four]
    assert 0 < max(peaks4) <= 0.3 * peak1, (peaks4, peak1)
