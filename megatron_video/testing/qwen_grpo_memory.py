"""One GRPO step of a tiny random Qwen2.5-VL (``mmsp.qwen_vl.MMSPQwenVLModel``, MR-SP) under
``testing.LiveTensors``: its peak live tensor bytes per rank at CP 1 or CP 4 (U2 x R2), for
``benchmarks/qwen_grpo_memory.py`` and its smoke test (``tests/test_qwen_grpo_memory.py``)."""

from __future__ import annotations

import time

import torch

__all__ = ["grpo_step_memory", "prompt"]


def prompt(cfg, frames: int, size: int):
    """``(ids [1, T], pixel_values_videos [t*h*w, 3*2*4*4], grid (t, h, w))`` of one video."""
    g = torch.Generator().manual_seed(11)
    t, h, w = frames // 2, size // 4, size // 4
    n = t * h * w // 4
    ids = [*torch.randint(3, 90, (3,), generator=g).tolist(), cfg.vision_start_token_id]
    ids += [cfg.video_token_id] * n + [cfg.vision_end_token_id]
    ids += torch.randint(3, 90, (4,), generator=g).tolist()
    pv = torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=g)
    return torch.tensor([ids]), pv, torch.tensor([t, h, w])


def _models(cfg, cp: int, seq: int):
    from megatron_video.mmsp.qwen_vl import MMSPQwenVLModel
    from megatron_video.models.qwen_vl import language_config

    comm = "a2a+p2p" if cp > 1 else None
    out = []
    for _ in range(2):  # policy, reference (the same start)
        torch.manual_seed(0)
        out.append(MMSPQwenVLModel(cfg, language_config(cfg, 1, cp, comm), max_sequence_length=seq))
    for name, p in out[0].named_parameters():
        if name.startswith("visual."):
            p.requires_grad_(False)
    return out


def _step(policy, reference, video, ids, G, L):
    from megatron_video.mmsp import rl
    from megatron_video.rl.config import RLConfig

    cfg = RLConfig(group_size=G, max_new_tokens=L, temperature=1.0)
    visual = rl.encode_video(policy, video)
    ro = rl.rollout(policy, visual, ids, cfg, prompt_seed=0)
    rewards = torch.arange(G, dtype=torch.float64)
    policy.zero_grad(set_to_none=True)
    loss, _ = rl.grpo_loss(policy, reference, visual, ids, ro, rewards, cfg, int(ro.lengths.sum()))
    loss.backward()


def grpo_step_memory(frames_list, cp, size, G, L):
    """``{frames: (peak bytes, seconds)}`` of this rank (None on the idle ranks at CP 1)."""
    import torch.distributed as dist

    from megatron_video.models.qwen_vl.config import tiny_hf_config
    from megatron_video.testing.live_memory import LiveTensors
    from megatron_video.testing.parallel import model_parallel

    seq = max(frames_list) // 2 * (size // 4) ** 2 // 4 + 64
    cfg = tiny_hf_config(max_position_embeddings=seq)
    rank = dist.get_rank()
    out = {}
    with model_parallel(cp=cp, hierarchical_cp=[2, 2] if cp == 4 else None):
        if cp == 1 and rank:
            return None
        policy, reference = _models(cfg, cp, seq)
        held = tuple(policy.parameters()) + tuple(reference.parameters())
        for frames in frames_list:
            ids, pv, grid = prompt(cfg, frames, size)
            t0 = time.perf_counter()
            with LiveTensors(exclude=held + (pv, ids)) as live:
                _step(policy, reference, (pv, grid), ids, G, L)
            out[frames] = (live.peak, time.perf_counter() - t0)
    return out
