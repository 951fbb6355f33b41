"""Long-RL's GRPO loss options beside ours (``rl.clip_high``, ``rl.dual_clip``, ``rl.kl_clamp``,
``rl.loss_agg``, log-probs at the rollout temperature), float64 at U2xR2 on 4 gloo ranks.

Fixed rollouts (two groups, two micro-batches of different token counts, old log-probs set so that
ratios spread over [0.3, 3.5]) feed ``mmsp.rl.grpo_loss`` at U2xR2; the oracle is Megatron's CP = 1
``LLaVAModel`` forward with the loss written out below in float64, transcribed from Long-RL
(NVlabs/Long-RL, verl/trainer/core_algos.py: ``compute_policy_loss``, ``compute_kl`` with
``low_var_kl``, ``average_loss`` with ``mode="token"``; verl/workers/actor/dp_actor.py
``update_policy``: ``logits / temperature``, each micro-batch's loss divided by the gradient
accumulation steps). Loss and every gradient must match for each option; the oracle without the
clip, without the dual clip or without the KL clamp must not. Rollouts decoded with the KV cache
(3 responses, not a multiple of CP = 4) equal decoding that recomputes everything per token.
"""

import pytest
import torch
from torch.testing import assert_close

from megatron_video.testing.grpo_options_case import (
    LENGTHS,
    OPTIONS,
    REWARDS,
    G,
    L,
    T,
    _rollouts,
    oracle_loss,
)
from megatron_video.testing.mrsp_case import (
    SIZES,
    _data,
    _freeze_vision,
    _full,
    _load,
    _oracle_lp,
    _perturb,
)


def _run():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import destroy_model_parallel
    from megatron_video.mmsp import rl
    from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_model
    from megatron_video.rl.config import RLConfig
    from megatron_video.rl.grpo import token_normalisers

    sizes = VideoLLaVASizes(**SIZES)
    images, ids = _data()
    tokens, offsets = _rollouts()
    out = {}
    ps.initialize_model_parallel()
    try:  # the weights and the oracle at CP = 1
        model_parallel_cuda_manual_seed(3)
        torch.manual_seed(3)
        m = video_llava_model(sizes, two_d_attention=False).double()
        _freeze_vision(m)
        _perturb(m, "w0", 0.3)
        w0 = _full(m, "param")
        _perturb(m, "ref", 0.6)
        wref = _full(m, "param")
        _load(m, w0)
        _perturb(m, "w1", 0.05)
        w1 = _full(m, "param")
        for w in (w1, wref):  # one frozen encoder
            w.update(
                {k: v for k, v in w0.items() if k.startswith(("vision_model.", "vision_proj"))}
            )
        _load(m, w0)
        old = [_oracle_lp(m, images, ids, t, temperature=T) + o for t, o in zip(tokens, offsets)]
        _load(m, wref)
        ref = [_oracle_lp(m, images, ids, t, temperature=T) for t in tokens]
        _load(m, w1)
        for name, opt in OPTIONS.items():
            m.zero_grad(set_to_none=True)
            lp = [_oracle_lp(m, images, ids, t, grad=True, temperature=T) for t in tokens]
            loss = oracle_loss(lp, old, ref, REWARDS, opt)
            loss.backward()
            lpd = [x.detach() for x in lp]
            variants = {
                k: float(oracle_loss(lpd, old, ref, REWARDS, opt, **{k: False}))
                for k in ("clip", "dual", "clamp")
            }
            out[(name, "oracle")] = (float(loss), _full(m, "grad"), variants)
        out["lp"] = [x.detach() for x in lp]
        out["old"], out["ref"] = old, ref
    finally:
        destroy_model_parallel()
    ps.initialize_model_parallel(
        context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]
    )
    try:
        policy = video_llava_model(sizes, cp=4, cp_comm_type="a2a+p2p").double()
        reference = video_llava_model(sizes, cp=4, cp_comm_type="a2a+p2p").double()
        _load(policy, w1)
        _load(reference, wref)
        _freeze_vision(policy)
        visual = rl.encode_video(policy, images)
        ros = [
            rl.Rollout(t, torch.tensor(n), torch.where(t > 0, o_lp, torch.zeros_like(o_lp)))
            for t, n, o_lp in zip(tokens, LENGTHS, old)
        ]
        for name, opt in OPTIONS.items():
            cfg = RLConfig(group_size=G, max_new_tokens=L, temperature=T, **opt)
            norms = token_normalisers(cfg, [sum(n) for n in LENGTHS], sum(map(sum, LENGTHS)), 1)
            policy.zero_grad(set_to_none=True)
            total, clipped = torch.zeros(1, dtype=torch.float64), 0.0
            for ro, r, norm in zip(ros, REWARDS, norms):
                rewards = torch.tensor(r, dtype=torch.float64)
                loss, stats = rl.grpo_loss(policy, reference, visual, ids, ro, rewards, cfg, norm)
                loss.backward()
                total += loss.detach()
                clipped += stats["clipped"]
            stats = torch.tensor([float(total), clipped], dtype=torch.float64)
            dist.all_reduce(stats, group=ps.get_context_parallel_group())
            out[(name, "u2xr2")] = (float(stats[0]), _full(policy, "grad"), float(stats[1]))
        # rollouts: the KV cache (prefix and responses cached) = recomputing everything per token
        for name, kw in (("sampled", dict(temperature=1.3, top_p=0.9)), ("greedy", {})):
            cfg = RLConfig(group_size=3, max_new_tokens=4, **kw)
            out[("kv", name)] = [
                rl.rollout(policy, visual, ids, cfg, prompt_seed=2, kv_cache=kv) for kv in (1, 0)
            ]
    finally:
        destroy_model_parallel()
    return out


def test_loss_options_u2xr2_equal_long_rl_formula(pool4):
    per_rank = pool4.run(_run, ranks_per_node=4)
    # the fixtures exercise every rule: ratios beyond both clips, beyond the dual clip with A < 0,
    # and k3 beyond the clamp
    res = per_rank[0]
    ratio = torch.cat([torch.exp(a - b).flatten() for a, b in zip(res["lp"], res["old"])])
    k3 = torch.cat(
        [(torch.exp(r - a) - (r - a) - 1).flatten() for a, r in zip(res["lp"], res["ref"])]
    )
    assert float(ratio.max()) > 3.0 and float(ratio.min()) < 0.8, ratio
    assert float(k3.max()) > 2.0, k3
    for rank, res in enumerate(per_rank):
        for name, opt in OPTIONS.items():
            loss_ref, grads_ref, variants = res[(name, "oracle")]
            loss, grads, clipped = res[(name, "u2xr2")]
            assert loss == pytest.approx(loss_ref, rel=1e-10, abs=1e-12), (name, rank)
            assert clipped > 0, name
            # teeth: the oracle without the clip (or the dual clip, the KL clamp when set) differs
            assert abs(variants["clip"] - loss) > 1e-4, name
            if opt.get("dual_clip"):
                assert abs(variants["dual"] - loss) > 1e-4, name
            if opt.get("kl_clamp"):
                assert abs(variants["clamp"] - loss) > 1e-4, name
            for k, g in grads_ref.items():
                scale = float(g.abs().max()) + 1e-30
                assert_close(grads[k], g, rtol=1e-8, atol=1e-10 * scale, msg=f"{name}/{rank} {k}")
            assert any(float(g.abs().max()) > 0 for g in grads.values())
        for name in ("sampled", "greedy"):  # token for token, log-probs to rounding
            kv, recompute = res[("kv", name)]
            assert torch.equal(kv.tokens, recompute.tokens), (name, kv.tokens, recompute.tokens)
            assert_close(kv.logprobs, recompute.logprobs, rtol=0, atol=1e-10)
        assert kv.tokens.unique().numel() > 2, kv.tokens
    # the aggregations differ on these micro-batches (9 and 7 tokens)
    assert abs(per_rank[0][("ours", "u2xr2")][0] - per_rank[0][("ours_micro", "u2xr2")][0]) > 1e-6


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("clip_high", 0.0, r"rl.clip_high \(0.0\) must be null or a finite number > 0"),
        ("clip_high", float("inf"), r"rl.clip_high \(inf\) must be null or a finite number > 0"),
        ("dual_clip", 1.0, r"rl.dual_clip \(1.0\) must be null or a finite number > 1"),
        ("kl_clamp", -1.0, r"rl.kl_clamp \(-1.0\) must be null or a finite number > 0"),
        ("loss_agg", "seq", r"rl.loss_agg \('seq'\) must be one of global_token_mean, micro"),
        ("mini_batches", 0, r"rl.mini_batches \(0\) must be >= 1"),
        ("mini_batches", 1.5, r"rl.mini_batches \(1.5\) must be an integer"),
    ],
)
def test_new_rl_fields_refuse_bad_values(field, value, match):
    from megatron_video.rl.config import RLConfig

    with pytest.raises(ValueError, match=match):
        RLConfig(**{field: value})


def test_token_normalisers():
    from megatron_video.rl.config import RLConfig
    from megatron_video.rl.grpo import token_normalisers

    assert token_normalisers(RLConfig(), [9, 7], 40, 2) == [40.0, 40.0]
    micro = RLConfig(loss_agg="micro_token_mean")
    assert token_normalisers(micro, [9, 7], 40, 2) == [36.0, 28.0]  # mean / 2 micro / DP 2


CHARS = "<>/ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,()-+:\n"


def _encode(texts):
    """Texts as character ids (a toy tokenizer) ``[G, L]`` and their lengths."""
    L = max(map(len, texts))
    tokens = torch.zeros(len(texts), L, dtype=torch.long)
    for g, t in enumerate(texts):
        tokens[g, : len(t)] = torch.tensor([CHARS.index(c) for c in t])
    return tokens, torch.tensor([len(t) for t in texts])


def _decode(ids):
    return "".join(CHARS[i] for i in ids)


def test_shipped_choice_numeric_and_text_rewards():
    """Long-RL's R1-V rules (examples/reward_function/r1v.py): format = the whole response is
    <think>..</think> <answer>..</answer>; the answer inside <answer> (spaces removed) else the
    response; 0.9 * accuracy + 0.1 * format; through rl.score as rl.reward module:function."""
    from megatron_video.mmsp import rewards, rl
    from megatron_video.rl.config import RLConfig

    good = "<think>the ball moves left</think> <answer>(B) left</answer>"
    texts = [good, "<answer>b.</answer>", "B", "<think>x</think><answer>C</answer>", "A or B"]
    tokens, lengths = _encode(texts)
    r = rewards.choice_reward(tokens, lengths, answer="B", decode=_decode, answer_id=3)
    assert r.tolist() == pytest.approx([1.0, 0.9, 0.9, 0.1, 0.0])
    texts = ["<think>2+2</think><answer>1,024.0</answer>", "about 1024 px", "<answer>1023</answer>"]
    tokens, lengths = _encode(texts)
    r = rewards.numeric_reward(tokens, lengths, answer="1024", decode=_decode)
    assert r.tolist() == pytest.approx([1.0, 0.9, 0.0])
    texts = [
        "<think>the end</think> <answer> Red </answer>",
        "red",
        "red blue",
        "<answer>r</answer>",
    ]
    words = rewards.text_reward(*_encode(texts), answer="red", decode=_decode)
    assert words.tolist() == pytest.approx([1.0, 0.9, 0.0, 0.0])
    assert rewards.format_score("<think>a</think>\n<answer>b</answer>") == 1.0
    assert rewards.format_score("<answer>b</answer> <think>a</think>") == 0.0
    # as rl.reward: the trainer's sample fields pass through; a missing answer names the function
    cfg = RLConfig(group_size=3, reward="megatron_video.mmsp.rewards:numeric_reward")
    ro = rl.Rollout(tokens, lengths, torch.zeros(tokens.shape, dtype=torch.float64))
    assert rl.score(cfg, ro, answer="1024", decode=_decode).tolist() == pytest.approx(r.tolist())
    with pytest.raises(ValueError, match=r"rewards:numeric_reward raised TypeError: .*answer"):
        rl.score(cfg, ro, answer_id=3, format_ids=())
    with pytest.raises(ValueError, match=r"answer \('left'\) must hold a number"):
        rewards.numeric_accuracy("1", "left")
