"""GRPO / MR-SP on Qwen2.5-VL (``mmsp.rl`` with ``mmsp.rl_qwen_vl``), float64, tiny random config.

* CP = 1, in process: the KV-cache greedy rollout equals transformers' own
  ``Qwen2_5_VLForConditionalGeneration.generate`` (greedy, the same converted weights) token for
  token, its log-probs equal transformers' (float64 forward of the generated sequence: the 3-D
  M-RoPE ids of the prefill and of every decoded token are transformers'); decoding at a 1-D text position (no
  ``rope_deltas``) must not. The vision tower runs once per prompt.
* U2xR2 on 4 gloo ranks: greedy and seeded sampled rollouts equal CP = 1's (tokens; log-probs to
  rounding), KV cache = recompute; on fixed rollouts (test_grpo_loss_options' fixtures) the GRPO
  loss and every gradient equal the explicit float64 formula (``oracle_loss``) on the CP = 1
  ``QwenVLModel`` forward of prompt + response, for ours and Long-RL's options; the vision tower
  runs once per prompt (its share of the temporal patches on each rank).
"""

import zlib
from pathlib import Path

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
from megatron_video.testing.qwen_vl_case import _rmsnorm_in_input_dtype, token_type_ids

NEW = 6  # greedy tokens compared with transformers
GRPO = Path(__file__).resolve().parents[1] / "examples" / "configs" / "qwen_vl_grpo.yaml"
SFT = GRPO.with_name("qwen_vl.yaml")
CP_OPTIONS = ("ours", "long_rl")


def _hf(cfg, scale=1.0, seed=0):
    """transformers' model, float64, weights moved well away from the init (greedy decoding of a
    near-init model repeats one token: the comparison would not see the positions)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _prompt(cfg):
    """``(prompt ids [1, T], pixel_values_videos, video_grid_thw [1, 3])``: text, ``<start>``,
    a video of 5 temporal patches (>= CP = 4, odd) on a 4 x 4 patch grid, ``<end>``, text."""
    g = torch.Generator().manual_seed(11)
    t, h, w = 5, 4, 4
    n = t * h * w // 4
    ids = [*torch.randint(3, 90, (3,), generator=g).tolist(), cfg.vision_start_token_id]
    ids += [cfg.video_token_id] * n + [cfg.vision_end_token_id]
    ids += torch.randint(3, 90, (4,), generator=g).tolist()
    pv = torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=g, dtype=torch.float64)
    return torch.tensor([ids]), pv, torch.tensor([[t, h, w]])


def _ours_empty(cfg, tp=1, cp=1, comm_type=None):
    from megatron_video.mmsp.qwen_vl import MMSPQwenVLModel
    from megatron_video.models.qwen_vl import language_config

    lcfg = language_config(cfg, tp, cp, comm_type, params_dtype=torch.float64)
    return MMSPQwenVLModel(cfg, lcfg).double()


def _ours(cfg, weights, tp=1, cp=1, comm_type=None):
    model = _ours_empty(cfg, tp, cp, comm_type)
    model.load_state_dict(weights, strict=True)
    return model


def _count_vision(model):
    """Wrap the vision tower's forward: returns the list its calls append to."""
    calls, fwd = [], model.visual.forward

    def counted(*a, **k):
        calls.append(1)
        return fwd(*a, **k)

    model.visual.forward = counted
    return calls


# ---------------------------------------------------------------------------------------------
# CP = 1: greedy KV-cache rollout = transformers' generate
# ---------------------------------------------------------------------------------------------
def test_greedy_rollout_equals_transformers_generate(monkeypatch):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    from megatron_video.mmsp import rl, rl_qwen_vl
    from megatron_video.models.qwen_vl import tiny_hf_config, to_megatron
    from megatron_video.models.wan.convert import _one_process
    from megatron_video.rl.config import RLConfig

    monkeypatch.setattr(m.Qwen2_5_VLRMSNorm, "forward", _rmsnorm_in_input_dtype)
    cfg = tiny_hf_config()
    hf = _hf(cfg)
    ids, pv, grid = _prompt(cfg)
    out = hf.generate(
        input_ids=ids,
        pixel_values_videos=pv,
        video_grid_thw=grid,
        mm_token_type_ids=token_type_ids(ids),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
    )
    P, want = ids.shape[1], out[0, ids.shape[1] :]
    with torch.no_grad():  # generate's scores are float32: the log-probs from its float64 forward
        logits = hf(
            input_ids=out,
            pixel_values_videos=pv,
            video_grid_thw=grid,
            mm_token_type_ids=token_type_ids(out),
        ).logits[0]
    want_lp = torch.log_softmax(logits[P - 1 : P - 1 + NEW], -1)[torch.arange(NEW), want]
    assert want.unique().numel() > 2, want  # the weights decode varied tokens
    cfg_rl = RLConfig(group_size=2, max_new_tokens=NEW, temperature=0)
    with _one_process():
        model = _ours(cfg, to_megatron(hf.state_dict(), cfg))
        calls = _count_vision(model)
        visual = rl.encode_video(model, (pv, grid[0]))
        ro = rl.rollout(model, visual, ids, cfg_rl, prompt_seed=0)
        assert len(calls) == 1  # the vision tower ran once: the rollout reuses its tokens
        for g in range(2):
            assert torch.equal(ro.tokens[g], want), (ro.tokens, want)
            assert_close(ro.logprobs[g], want_lp, rtol=0, atol=1e-9)
        # teeth: decoded tokens at the 1-D text position (no M-RoPE offset) score differently
        monkeypatch.setattr(rl_qwen_vl, "text_offset", lambda *a: 0)
        flat = rl.rollout(model, visual, ids, cfg_rl, prompt_seed=0)
        assert float((flat.logprobs[0, 1:] - want_lp[1:]).abs().max()) > 1e-4
        # bad input names the parameter: a prompt missing a placeholder, a video of the wrong size
        short = ids[ids != cfg.video_token_id][None]
        with pytest.raises(ValueError, match=r"prompt_ids \(\(1, 9\), 0 video tokens\) must"):
            rl.rollout(model, visual, short, cfg_rl, prompt_seed=0)
        with pytest.raises(ValueError, match=r"pixel_values_videos rows \(79\) must equal"):
            rl.encode_video(model, (pv[:-1], grid[0]))


# ---------------------------------------------------------------------------------------------
# U2xR2: rollouts = CP 1, loss and gradients = the explicit formula on fixed rollouts
# ---------------------------------------------------------------------------------------------
def _oracle_lp(model, visual_in, ids, tokens, grad=False, temperature=1.0):
    """``QwenVLModel`` (CP = 1) forward of prompt + each response: log-probs ``[G, L]``."""
    pv, grid = visual_in
    P = ids.shape[1]
    rows = []
    for g in range(tokens.shape[0]):
        full = torch.cat([ids, tokens[g : g + 1]], dim=1)
        with torch.set_grad_enabled(grad):
            logits = model(full, pv, grid)
            lp = torch.log_softmax(logits[0].double() / temperature, dim=-1)
            rows.append(lp[P - 1 + torch.arange(L), tokens[g]])
    return torch.stack(rows)


def _perturbed(full, salt, scale):
    out = {}
    for k, v in full.items():
        g = torch.Generator().manual_seed(zlib.crc32((salt + k).encode()))
        out[k] = v if k.startswith("visual.") else v + scale * torch.randn(v.shape, generator=g)
    return out


def _grads(model, group, tp_group=None):
    from megatron_video.models.qwen_vl.weights import tp_gather
    from megatron_video.parallel import comm

    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        if group is not None:
            comm.all_reduce(g, group)  # what DDP's dp_cp reduction sums
        out[name] = tp_gather(name, g, p, tp_group)
    return out


def _freeze_visual(model):
    for name, p in model.named_parameters():
        if name.startswith("visual."):
            p.requires_grad_(False)


def _oracle(model, weights, video, ids, tokens):
    """``(old, ref, {option: (loss, gradients)})``: the explicit formula at CP = 1 on the fixed
    rollouts (``model`` holds ``w0``: the old log-probs, offset so the ratio and the clip act)."""
    w0, w1, wref = weights
    offsets = [
        1.2 * (2 * torch.rand(G, L, generator=torch.Generator().manual_seed(i)) - 1).double()
        for i in range(len(tokens))
    ]
    old = [_oracle_lp(model, video, ids, t, temperature=T) + o for t, o in zip(tokens, offsets)]
    model.load_state_dict(wref)
    ref = [_oracle_lp(model, video, ids, t, temperature=T) for t in tokens]
    model.load_state_dict(w1)
    _freeze_visual(model)
    out = {}
    for name in CP_OPTIONS:
        model.zero_grad(set_to_none=True)
        lp = [_oracle_lp(model, video, ids, t, grad=True, temperature=T) for t in tokens]
        loss = oracle_loss(lp, old, ref, REWARDS, OPTIONS[name])
        loss.backward()
        out[name] = (float(loss), _grads(model, None))
    return old, ref, out


def _cp1(cfg, w0, w1, wref, video, ids, tokens):
    """Rollouts and the oracle's loss / gradients at CP = 1."""
    from megatron_video.mmsp import rl
    from megatron_video.rl.config import RLConfig
    from megatron_video.testing.parallel import model_parallel

    out = {}
    with model_parallel():
        model = _ours(cfg, w0)
        visual = rl.encode_video(model, video)
        for name, kw in (("greedy", dict(temperature=0)), ("sampled", dict(temperature=1.3))):
            c = RLConfig(group_size=3, max_new_tokens=4, **kw)
            out[("ro", name)] = rl.rollout(model, visual, ids, c, prompt_seed=2)
        out["old"], out["ref"], oracle = _oracle(model, (w0, w1, wref), video, ids, tokens)
        for name, res in oracle.items():
            out[(name, "oracle")] = res
    return out


def _grpo_losses(policy, reference, visual, ids, tokens, old, group, tp_group=None):
    """``{option: (loss summed over CP, gradients reduced over CP and gathered over TP)}`` of
    ``rl.grpo_loss`` on the fixed rollouts (two micro-batches), per option."""
    from megatron_video.mmsp import rl
    from megatron_video.parallel import comm
    from megatron_video.rl.config import RLConfig
    from megatron_video.rl.grpo import token_normalisers

    ros = [
        rl.Rollout(t, torch.tensor(n), torch.where(t > 0, o, torch.zeros_like(o)))
        for t, n, o in zip(tokens, LENGTHS, old)
    ]
    out = {}
    for name in CP_OPTIONS:
        c = RLConfig(group_size=G, max_new_tokens=L, temperature=T, **OPTIONS[name])
        norms = token_normalisers(c, [sum(n) for n in LENGTHS], sum(map(sum, LENGTHS)), 1)
        policy.zero_grad(set_to_none=True)
        total = torch.zeros(1, dtype=torch.float64)
        for ro, r, norm in zip(ros, REWARDS, norms):
            rewards = torch.tensor(r, dtype=torch.float64)
            loss, _ = rl.grpo_loss(policy, reference, visual, ids, ro, rewards, c, norm)
            loss.backward()
            total += loss.detach()
        comm.all_reduce(total, group)
        out[name] = (float(total), _grads(policy, group, tp_group))
    return out


def _u2xr2(cfg, weights, video, ids, tokens, old):
    """Rollouts with ``w0``, the GRPO loss of ``w1`` against ``wref`` at U2xR2."""
    from megatron.core import parallel_state as ps

    from megatron_video.mmsp import rl
    from megatron_video.rl.config import RLConfig
    from megatron_video.testing.parallel import model_parallel

    w0, w1, wref = weights
    out = {}
    with model_parallel(cp=4, hierarchical_cp=[2, 2]):
        group = ps.get_context_parallel_group()
        policy = _ours(cfg, w1, cp=4, comm_type="a2a+p2p")
        reference = _ours(cfg, wref, cp=4, comm_type="a2a+p2p")
        _freeze_visual(policy)
        calls = _count_vision(policy)
        visual = rl.encode_video(policy, video)
        policy.load_state_dict(w0)  # rollouts with the old policy
        for name, kw in (("greedy", dict(temperature=0)), ("sampled", dict(temperature=1.3))):
            c = RLConfig(group_size=3, max_new_tokens=4, **kw)
            out[("ro", name)] = [
                rl.rollout(policy, visual, ids, c, prompt_seed=2, kv_cache=kv) for kv in (1, 0)
            ]
        policy.load_state_dict(w1)
        for name, res in _grpo_losses(policy, reference, visual, ids, tokens, old, group).items():
            out[(name, "u2xr2")] = res
        out["vision_calls"] = len(calls)
        out["units"] = visual.local.shape[0] // int(video[1][0, 1:].prod() // 4)
    return out


def _case():
    """``(config, (w0, w1, wref), video, prompt ids, fixed rollout tokens)``."""
    from megatron_video.models.qwen_vl import tiny_hf_config, to_megatron

    cfg = tiny_hf_config()
    w0 = to_megatron(_hf(cfg, scale=0.6).state_dict(), cfg)
    w1, wref = _perturbed(w0, "w1", 0.05), _perturbed(w0, "ref", 0.3)
    ids, pv, grid = _prompt(cfg)
    return cfg, (w0, w1, wref), (pv, grid), ids, _rollouts()[0]


def _run():
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    saved = m.Qwen2_5_VLRMSNorm.forward
    m.Qwen2_5_VLRMSNorm.forward = _rmsnorm_in_input_dtype
    try:
        cfg, weights, video, ids, tokens = _case()
        cp1 = _cp1(cfg, *weights, video, ids, tokens)
        return cp1, _u2xr2(cfg, weights, video, ids, tokens, cp1["old"])
    finally:
        m.Qwen2_5_VLRMSNorm.forward = saved


def test_rollouts_and_grpo_loss_u2xr2_equal_cp1(pool4):
    per_rank = pool4.run(_run)
    for rank, (cp1, res) in enumerate(per_rank):
        for name in ("greedy", "sampled"):  # token for token, log-probs to rounding
            want = cp1[("ro", name)]
            for ro in res[("ro", name)]:  # KV cache, recompute
                assert torch.equal(ro.tokens, want.tokens), (name, rank, ro.tokens, want.tokens)
                assert_close(ro.logprobs, want.logprobs, rtol=0, atol=1e-10)
        assert want.tokens.unique().numel() > 2, want.tokens
        for name in CP_OPTIONS:
            loss_ref, grads_ref = cp1[(name, "oracle")]
            loss, grads = res[(name, "u2xr2")]
            assert loss == pytest.approx(loss_ref, rel=1e-10, abs=1e-12), (name, rank)
            assert grads.keys() == grads_ref.keys()
            for k, g in grads_ref.items():
                scale = float(g.abs().max()) + 1e-30
                assert_close(grads[k], g, rtol=1e-8, atol=1e-10 * scale, msg=f"{name}/{rank} {k}")
            assert any(float(g.abs().max()) > 0 for g in grads.values())
        assert res["vision_calls"] == 1  # once per prompt and step: rollouts + loss reuse it
        assert res["units"] in (1, 2)  # this rank's share of the 5 temporal patches
    assert sum(r["units"] for _, r in per_rank) == 5
    losses = [per_rank[0][0][(name, "oracle")][0] for name in CP_OPTIONS]
    assert abs(losses[0] - losses[1]) > 1e-6  # the options differ on these rollouts


# ---------------------------------------------------------------------------------------------
# U4, R4, TP2xCP2: loss and gradients on the fixed rollouts = the explicit formula at CP = 1
# ---------------------------------------------------------------------------------------------
# name -> (tp, cp, cp_comm_type); one pool run (4 ranks on one simulated node: Ulysses 4) serves all
LAYOUTS = {"u4": (1, 4, "a2a"), "r4": (1, 4, "p2p"), "tp2xcp2": (2, 2, "p2p")}


def _sharded(cfg, full, tp, cp, comm_type):
    """``MMSPQwenVLModel`` at TP ``tp`` x CP ``cp`` holding this TP rank's slices of ``full``."""
    from megatron.core import parallel_state as ps

    from megatron_video.models.qwen_vl.weights import tp_shard

    model = _ours_empty(cfg, tp, cp, comm_type)
    rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tp_shard(name, full[name], p, tp, rank))
    return model


def _layouts_run(names):
    """The explicit formula's loss and gradients at CP = 1, then ``rl.grpo_loss``'s at each layout
    of ``names`` (policy ``w1``, reference ``wref``, old log-probs of ``w0``; vision frozen)."""
    from megatron.core import parallel_state as ps
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    from megatron_video.mmsp import rl
    from megatron_video.testing.parallel import model_parallel

    saved = m.Qwen2_5_VLRMSNorm.forward
    m.Qwen2_5_VLRMSNorm.forward = _rmsnorm_in_input_dtype
    try:
        cfg, (w0, w1, wref), video, ids, tokens = _case()
        with model_parallel():
            old, _, out = _oracle(_ours(cfg, w0), (w0, w1, wref), video, ids, tokens)
        res = {"cp1": out}
        for name in names:
            tp, cp, comm_type = LAYOUTS[name]
            with model_parallel(tp=tp, cp=cp):
                policy = _sharded(cfg, w1, tp, cp, comm_type)
                reference = _sharded(cfg, wref, tp, cp, comm_type)
                _freeze_visual(policy)
                visual = rl.encode_video(policy, video)
                groups = ps.get_context_parallel_group(), ps.get_tensor_model_parallel_group()
                res[name] = _grpo_losses(policy, reference, visual, ids, tokens, old, *groups)
                res[name]["units"] = visual.local.shape[0] // 4  # 4 merged tokens a patch
        return res
    finally:
        m.Qwen2_5_VLRMSNorm.forward = saved


@pytest.fixture(scope="module")
def layouts(pool4):
    return pool4.run(_layouts_run, list(LAYOUTS), ranks_per_node=4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_loss_and_gradients_at_layout_equal_cp1(layouts, layout):
    """Float64: the GRPO loss and every trained gradient (LLM; the vision tower frozen as GRPO
    freezes it) at ``layout`` equal the explicit CP = 1 formula to 1e-10 relative, for ours and
    Long-RL's options; each CP rank encoded its share of the 5 temporal patches."""
    tp, cp, _ = LAYOUTS[layout]
    for rank, res in enumerate(layouts):
        for name in CP_OPTIONS:
            loss_ref, grads_ref = res["cp1"][name]
            loss, grads = res[layout][name]
            assert abs(loss - loss_ref) <= 1e-10 * abs(loss_ref), (layout, name, rank)
            assert grads.keys() == grads_ref.keys()
            for k, g in grads_ref.items():
                err = float((grads[k] - g).abs().max())
                assert err <= 1e-10 * (float(g.abs().max()) + 1e-30), (layout, name, rank, k)
            assert sum(float(g.abs().max()) > 0 for g in grads.values()) > len(grads) // 2
    units = [res[layout]["units"] for res in layouts]
    assert sum(units) == 5 * tp and max(units) - min(units) <= 1, units


# ---------------------------------------------------------------------------------------------
# the trainer: qwen_vl prompts, one GRPO step of examples/configs/qwen_vl_grpo.yaml, bad input
# ---------------------------------------------------------------------------------------------
def test_qwen_prompts_are_the_supervised_questions():
    """``prompts_of`` on a qwen_vl batch: the prompt ends where the supervised target starts, the
    answer is that target, the text is video_llava's prompt's, the video is the sample's."""
    from megatron_video.training.config import load_config
    from megatron_video.training.families.qwen_vl import END_ID, QwenVLBatches
    from megatron_video.training.grpo import prompts_of
    from megatron_video.training.vlm import VideoQABatches

    cfg = load_config(str(GRPO))
    qb, lb = QwenVLBatches(cfg, 0, 1), VideoQABatches(cfg, 0, 1)
    mb, ref = qb.from_positions([3, 8]), lb.from_positions([3, 8])
    rows = 0
    for (video, prompt, answer, pos), (_, want, want_answer, want_pos) in zip(
        prompts_of(mb), prompts_of(ref)
    ):
        pv, grid = video
        assert tuple(grid.tolist()) == (5, 4, 4) and pv.shape[0] == 80
        assert torch.equal(pv, mb.pixel_values_videos[rows : rows + 80])
        rows += 80
        assert (answer, pos) == (want_answer, want_pos)
        end = int(torch.nonzero(prompt[0] == END_ID)[0, 0])
        assert torch.equal(prompt[0, end + 1 :], want[0, 1:]), (prompt, want)  # after the video


def test_qwen_vl_tokenizer_decodes_the_samples():
    """The family's tokenizer (built offline: the questions' words + Qwen2.5-VL's vision tokens
    at the config's ids) decodes a GRPO prompt to its question and the answer id to its word;
    the trainer's ``decode`` skips the vision tokens and padded vocabulary rows."""
    from megatron_video.data.video_qa import QA_VOCAB, qa_tokenizer
    from megatron_video.training.config import load_config
    from megatron_video.training.families import get_family
    from megatron_video.training.families.qwen_vl import QwenVLBatches
    from megatron_video.training.grpo import prompts_of

    cfg = load_config(str(GRPO))
    tok = get_family("qwen_vl").tokenizer(cfg)
    batches = QwenVLBatches(cfg, 0, 1)
    mb = batches.from_positions([3, 4, 5])
    for _, prompt, answer, pos in prompts_of(mb):
        item = batches.dataset[pos]
        assert tok.decode(prompt[0], skip_special_tokens=True) == item["question"]
        assert tok.decode([answer]) == item["answer"]
        full = tok.decode(prompt[0])
        assert full.startswith("<|vision_start|> <|video_pad|>") and "<|vision_end|>" in full
    assert tok.decode([QA_VOCAB.index("red"), 63, 0], skip_special_tokens=True) == "red"
    assert tok("what shape is it ?")["input_ids"] == [
        QA_VOCAB.index(w) for w in "what shape is it ?".split()
    ]
    with pytest.raises(ValueError, match=r"special_tokens \('x': 3\) must be a new token"):
        qa_tokenizer({"x": 3})


def first_token_reward(tokens, lengths, answer_id, format_ids, answer, decode, **sample):
    """A reward that differs between responses (an untrained policy rarely says the answer, and a
    group of equal rewards has no gradient): the first token's id / 100. It also checks what the
    trainer hands text rewards: the answer word and the responses' words (``QA_VOCAB``'s; vision
    tokens and padded vocabulary rows dropped)."""
    from megatron_video.data.video_qa import QA_VOCAB

    assert answer == QA_VOCAB[answer_id], (answer, answer_id)
    for g in range(tokens.shape[0]):
        ids = tokens[g, : int(lengths[g])].tolist()
        want = " ".join(QA_VOCAB[i] for i in ids if 2 <= i < len(QA_VOCAB))
        assert decode(ids) == want, (ids, decode(ids), want)
    return tokens[:, 0].double() / 100


def _sft_then_grpo_step(out):
    """One supervised step of qwen_vl.yaml (saved), then one GRPO step of qwen_vl_grpo.yaml from
    it (``model.init_from``): per rank the trainer, vision calls, the parameters GRPO moved,
    whether it started from the supervised weights, the GRPO history (logging rank)."""
    import warnings

    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    small = ["train.steps=1", "train.micro_batch_size=1", "train.tensorboard=false"]
    sft = Trainer(load_config(str(SFT), small + [f"output={out}/sft"]), progress=False)
    try:
        sft.run()
        trained = {k: p.detach().clone() for k, p in sft.model.named_parameters()}
    finally:
        sft.close()
    over = small + ["rl.group_size=3", "train.save=false", f"model.init_from={out}/sft"]
    over += ["rl.reward=test_grpo_qwen_vl:first_token_reward"]
    t = Trainer(load_config(str(GRPO), over + [f"output={out}/grpo"]), progress=False)
    try:
        calls = _count_vision(t.model)
        before = {k: p.detach().clone() for k, p in t.model.named_parameters()}
        started = all(torch.equal(before[k], v) for k, v in trained.items())
        started = started and all(
            torch.equal(p, trained[k]) for k, p in t.reference.named_parameters()
        )
        metrics = t.run()
        moved = {k for k, p in t.model.named_parameters() if not torch.equal(before[k], p)}
        history = metrics.get("history") if metrics else None
        return type(t).__name__, len(calls), moved, started, history
    finally:
        t.close()


def test_qwen_vl_grpo_example_trains_a_step_from_sft(pool4, tmp_path):
    """One GRPO step of the example (one prompt, 3 responses) at U2xR2 from a one-step
    supervised run: policy and reference start from its weights (KL 0), the vision tower runs
    once per rank (the embedding cache) and stays frozen, the LLM moves."""
    per_rank = pool4.run(_sft_then_grpo_step, str(tmp_path))
    hist = next(r[4] for r in per_rank if r[4])
    assert len(hist) == 1 and hist[0]["kl"] == 0 and hist[0]["response_len"] == 1
    assert hist[0]["reward_std"] > 0 and hist[0]["grad_norm"] > 0, hist
    for name, calls, moved, started, _ in per_rank:
        assert name == "GRPOTrainer" and calls == 1 and started
        assert moved and not any(k.startswith("visual.") for k in moved), moved


@pytest.mark.parametrize(
    "override, match",
    [
        ("rl.mini_batches=3", r"rl\.mini_batches \(3\) must divide"),
        ("parallel.fsdp=true", r"parallel\.fsdp"),
        ("rl.clip=1.5", r"rl\.clip \(1\.5\)"),
        ("model.init_from=/nowhere", r"model\.init_from \('/nowhere'\) must be"),
    ],
)
def test_bad_qwen_vl_grpo_config_names_the_field(override, match):
    from megatron_video.training.config import load_config, validate

    with pytest.raises(ValueError, match=match):
        validate(load_config(str(GRPO), ["model.init_from=null", override]), 4)


def test_reward_benchmark_runs_two_steps(tmp_path):
    """benchmarks/qwen_vl_grpo_reward.py in this process at its smallest: one supervised step, two
    GRPO steps scored by the shipped ``text_reward`` on the decoded answers (it raises without
    ``answer`` / ``decode``), the JSON record and the curve written."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "qwen_vl_grpo_reward.py"
    spec = importlib.util.spec_from_file_location("qwen_vl_grpo_reward", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--sft-steps", "1", "--grpo-steps", "2", "--prompts", "2", "--group", "2"]
    args += ["--window", "1", "--out", str(tmp_path / "run")]
    args += ["--json", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.png")]
    record = script.main(args)
    assert json.loads((tmp_path / "r.json").read_text()) == record
    assert (tmp_path / "r.png").stat().st_size > 0
    assert len(record["reward_mean"]) == 2 and len(record["sft_loss"]) == 1
    for r in record["reward_mean"]:  # 4 answers a step, each 0 or 0.9 (one word: no format)
        assert min(abs(r - 0.225 * k) for k in range(5)) < 1e-12, record
    assert record["first_mean"] == record["reward_mean"][0]
    assert record["last_mean"] == record["reward_mean"][1]
