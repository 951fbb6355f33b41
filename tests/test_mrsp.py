"""MR-SP (GRPO of the video LLaVA under CP), float64, 4 gloo ranks against independent oracles.

Oracle: Megatron's own CP = 1 ``LLaVAModel`` forward (its local core attention, its vision call)
of prompt + response, with explicit float64 formulas for log-probs, advantages, ratio, clip and
k3. Checked per layout (U2xR2, R4, U4, TP2xCP2): the rollout log-probs of every response token,
greedy tokens = the argmax of the oracle's logits, seeded sampled tokens = the CP = 1 run's, the
GRPO loss and every parameter gradient; the vision encoder runs once per step on each rank (its
share).
"""

import pytest
import torch
from torch.testing import assert_close

from megatron_video.testing.mrsp_case import (
    SIZES,
    F,
    G,
    L,
    _data,
    _freeze_vision,
    _full,
    _load,
    _oracle_lp,
    _perturb,
)

CASES = {  # name -> (tp, cp, hierarchical sizes, cp_comm_type)
    "cp1": (1, 1, None, None),
    "u2xr2": (1, 4, [2, 2], "a2a+p2p"),
    "r4": (1, 4, None, "p2p"),
    "u4": (1, 4, None, "a2a"),
    "tp2xcp2": (2, 2, None, "p2p"),
}
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.2], dtype=torch.float64)


def _oracle_loss(lp, old, ref, rewards, clip, kl):
    """Explicit float64 GRPO: advantages, ratio, clip, k3, mean over response tokens."""
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    ratio = torch.exp(lp - old)
    surr = torch.minimum(
        ratio * adv[:, None], torch.clamp(ratio, 1 - clip, 1 + clip) * adv[:, None]
    )
    k3 = torch.exp(ref - lp) - (ref - lp) - 1
    return (-surr + kl * k3).sum() / lp.numel()


def _run(case_names):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import destroy_model_parallel
    from megatron_video.mmsp import rl
    from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_model
    from megatron_video.rl.config import RLConfig

    sizes = VideoLLaVASizes(**SIZES)
    images, ids = _data()
    out = {}
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(3)
    torch.manual_seed(3)
    base = video_llava_model(sizes, two_d_attention=False).double()
    _perturb(base, "w0", 0.3)
    w0 = _full(base, "param")
    _perturb(base, "w1", 0.05)
    w1 = _full(base, "param")
    _load(base, w0)
    _perturb(base, "ref", 0.1)
    wref = _full(base, "param")
    for w in (w1, wref):  # the encoder is frozen in RL: one encoder for policy and reference
        w.update({k: v for k, v in w0.items() if k.startswith(("vision_model.", "vision_proj"))})
    destroy_model_parallel()
    cfgs = {
        "greedy": RLConfig(group_size=G, max_new_tokens=L, temperature=0.0),
        "sampled": RLConfig(group_size=G, max_new_tokens=L, temperature=1.3, top_p=0.9),
    }
    for case in case_names:
        tp, cp, hier, comm_type = CASES[case]
        kw = dict(tensor_model_parallel_size=tp, context_parallel_size=cp)
        if hier:
            kw["hierarchical_context_parallel_sizes"] = hier
        ps.initialize_model_parallel(**kw)
        try:
            policy = video_llava_model(sizes, tp=tp, cp=cp, cp_comm_type=comm_type).double()
            reference = video_llava_model(sizes, tp=tp, cp=cp, cp_comm_type=comm_type).double()
            _load(policy, w0)
            _load(reference, wref)
            _freeze_vision(policy)
            calls = []
            inner = policy.vision_model.forward
            policy.vision_model.forward = lambda x: calls.append(x.shape[0]) or inner(x)
            ro = {}
            for name, cfg in cfgs.items():
                visual = rl.encode_video(policy, images)  # once per step
                ro[name] = rl.rollout(policy, visual, ids, cfg, prompt_seed=11)
                if name == "sampled":
                    _load(policy, w1)  # the policy moved since the rollout: ratios != 1
                    policy.zero_grad(set_to_none=True)
                    loss, stats = rl.grpo_loss(
                        policy, reference, visual, ids, ro[name], REWARDS, cfg, G * L
                    )
                    loss.backward()
                    total = loss.detach().clone()
                    stats = torch.tensor([stats["kl_sum"], stats["clipped"]])
                    if cp > 1:
                        dist.all_reduce(total, group=ps.get_context_parallel_group())
                        dist.all_reduce(stats, group=ps.get_context_parallel_group())
                    out[(case, "loss")] = (float(total), _full(policy, "grad"), stats.tolist())
            out[(case, "rollouts")] = {k: (v.tokens, v.logprobs) for k, v in ro.items()}
            try:  # a prompt that does not fit: ValueError on every rank, before any collective
                rl.rollout(policy, visual, ids, RLConfig(max_new_tokens=200), prompt_seed=0)
                out[(case, "too_long")] = None
            except ValueError as e:
                out[(case, "too_long")] = str(e)
            out[(case, "calls")] = list(calls)
        finally:
            destroy_model_parallel()
    # the oracle: Megatron's CP = 1 LLaVA forward
    ps.initialize_model_parallel()
    try:
        oracle = video_llava_model(sizes, two_d_attention=False).double()
        _freeze_vision(oracle)
        for case in case_names:
            res = {}
            for name, cfg in cfgs.items():
                tokens = out[(case, "rollouts")][name][0]
                T = cfg.temperature or 1.0
                _load(oracle, w0)
                old, best, gap = _oracle_lp(oracle, images, ids, tokens, temperature=T, argmax=True)
                res[name] = old
                if name == "greedy":  # the oracle's argmax, and its margin over the runner-up
                    res["argmax"], res["argmax_gap"] = best, gap
                if name == "sampled":
                    _load(oracle, wref)
                    ref = _oracle_lp(oracle, images, ids, tokens, temperature=T)
                    _load(oracle, w1)
                    oracle.zero_grad(set_to_none=True)
                    lp = _oracle_lp(oracle, images, ids, tokens, grad=True, temperature=T)
                    loss = _oracle_loss(lp, old, ref, REWARDS, 0.2, 0.04)
                    loss.backward()
                    res["loss"] = (float(loss), _full(oracle, "grad"))
                    res["noclip"] = float(_oracle_loss(lp, old, ref, REWARDS, 1e9, 0.04))
                    res["ref_is_policy"] = float(_oracle_loss(lp, old, lp, REWARDS, 0.2, 0.04))
                    ratio = torch.exp(lp - old).detach()
                    res["ratio_range"] = (float(ratio.min()), float(ratio.max()))
            out[(case, "oracle")] = res
    finally:
        destroy_model_parallel()
    dist.barrier()
    return out


def _check(per_rank, cases):
    for rank, res in enumerate(per_rank):
        for case in cases:
            ro, orc = res[(case, "rollouts")], res[(case, "oracle")]
            for name in ("greedy", "sampled"):
                tokens, lps = ro[name]
                assert_close(lps, orc[name], rtol=0, atol=1e-10, msg=f"{case}/{name}/{rank}")
                assert torch.equal(tokens, per_rank[0][("cp1", "rollouts")][name][0]), case
            # greedy tokens are the oracle's argmax; no tie (margin measured 0.13, > 1e-6 asked)
            greedy = ro["greedy"][0]
            assert torch.equal(greedy, orc["argmax"]), (case, rank, greedy, orc["argmax"])
            assert float(orc["argmax_gap"].min()) > 1e-6, (case, rank, orc["argmax_gap"])
            loss, grads, stats = res[(case, "loss")]
            loss_ref, grads_ref = orc["loss"]
            assert loss == pytest.approx(loss_ref, rel=1e-10, abs=1e-12), (case, rank)
            # the test has teeth: the clip and the separate reference both change the loss
            assert (
                abs(orc["noclip"] - loss_ref) > 1e-4 and abs(orc["ref_is_policy"] - loss_ref) > 1e-4
            )
            assert stats[0] > 0 and stats[1] > 0, stats  # KL > 0, some tokens clipped
            for k, g in grads_ref.items():
                scale = float(g.abs().max()) + 1e-30
                assert_close(grads[k], g, rtol=1e-8, atol=1e-10 * scale, msg=f"{case}/{rank} {k}")
            assert any(float(g.abs().max()) > 0 for g in grads.values())
            # the embedding cache: 2 steps (greedy, sampled) -> 2 encoder calls on every rank,
            # each on this rank's share of the frames only (G x 3 passes would need 2 * G * 3)
            assert "rl.max_new_tokens (200)" in (res[(case, "too_long")] or ""), case
            calls = res[(case, "calls")]
            cp = CASES[case][1]
            assert len(calls) == 2 and all(c in (F // cp, -(-F // cp)) for c in calls), calls
    greedy = per_rank[0][("cp1", "rollouts")]["greedy"][0]
    assert greedy.unique().numel() > 1  # not a degenerate rollout


@pytest.mark.parametrize("cases", [["cp1", "u2xr2", "tp2xcp2"], ["cp1", "r4", "u4"]])
def test_mrsp_exact_vs_megatron_cp1(pool4, cases):
    _check(pool4.run(_run, cases, ranks_per_node=4), cases)


def _nan_reward(tokens, lengths):
    return torch.full((tokens.shape[0],), float("nan"))


def test_rl_config_bad_input():
    from megatron_video.mmsp import rl
    from megatron_video.rl.config import RLConfig
    from megatron_video.rl.rewards import check_rewards, resolve_reward

    with pytest.raises(ValueError, match="rl.group_size"):
        RLConfig(group_size=1)
    with pytest.raises(ValueError, match="rl.top_p"):
        RLConfig(top_p=0.0)
    with pytest.raises(ValueError, match="my_reward.*shape"):
        check_rewards(torch.zeros(3), 4, "my_reward")
    with pytest.raises(ValueError, match="my_reward.*non-finite"):
        check_rewards(torch.tensor([0.0, float("nan")]), 2, "my_reward")
    with pytest.raises(ValueError, match="rl.reward"):
        resolve_reward("megatron_video.mmsp.rl:nope")
    cfg = RLConfig(group_size=2)
    ro = rl.Rollout(torch.tensor([[5, 1], [6, 2]]), torch.tensor([2, 2]), torch.zeros(2, 2))
    assert rl.score(cfg, ro, answer_id=6, format_ids=[5, 6]).tolist() == [0.1, 1.1]
    bad = RLConfig(group_size=2, reward="test_mrsp:_nan_reward")
    with pytest.raises(ValueError, match="test_mrsp:_nan_reward.*non-finite"):
        rl.score(bad, ro)
    r = rl.exact_match_reward(torch.tensor([[5, 1], [6, 2]]), torch.tensor([2, 2]), 5, [5, 6])
    assert r.tolist() == [1.1, 0.1]


def test_a_group_of_one_response_is_refused():
    """G = 1: no standard deviation, so no advantage; a named ValueError, never NaN."""
    from megatron_video.mmsp import rl
    from megatron_video.rl.config import RLConfig
    from megatron_video.rl.grpo import group_advantages

    with pytest.raises(ValueError, match=r"group size \(1\) must be >= 2"):
        group_advantages(torch.tensor([1.0]), 1e-6)
    ro = rl.Rollout(torch.tensor([[5, 1]]), torch.tensor([2]), torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"group size \(1\) must be >= 2"):  # before the model
        rl.grpo_loss(None, None, None, None, ro, torch.tensor([1.0]), RLConfig(), 2)
    adv = group_advantages(torch.tensor([0.5, 0.5]), 1e-6)  # equal rewards: 0, not NaN
    assert adv.tolist() == [0.0, 0.0]


@pytest.fixture(scope="module")
def megatron_one_rank():
    """One-process gloo group (torn down if created here) + Megatron parallel state (TP = 1)."""
    import socket

    import torch.distributed as dist

    from megatron_video.testing.parallel import model_parallel

    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with model_parallel(tp=1, seed=0):
        yield
    if created:
        dist.destroy_process_group()


def test_frame_vit_one_frame_gradients_accumulate(megatron_one_rank):
    """A CP rank that encodes one frame (``rl.train_encoder``): two backward passes accumulated
    in ``.grad`` (plain autograd, no DDP) equal the float64 sum of the two separate gradients;
    ``class_token`` and ``position_embeddings`` never share a gradient buffer."""
    from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_model

    torch.manual_seed(0)
    model = video_llava_model(VideoLLaVASizes(), params_dtype=torch.float32)
    vit = model.vision_model
    frames = [torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    w = torch.randn(vit(frames[0]).shape, generator=torch.Generator().manual_seed(3))
    params = dict(vit.named_parameters())
    single = []
    for x in frames:  # each pass alone
        vit.zero_grad(set_to_none=True)
        (vit(x) * w).sum().backward()
        single.append({n: p.grad.double().clone() for n, p in params.items()})
    vit.zero_grad(set_to_none=True)
    for x in frames:  # accumulated
        (vit(x) * w).sum().backward()
    for n, p in params.items():
        assert_close(p.grad.double(), single[0][n] + single[1][n], rtol=1e-6, atol=1e-7, msg=n)
