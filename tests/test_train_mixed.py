"""Training on a mixed dataset (``data.buckets``: packed micro-batches, training/packed_data.py).

* Exactness (float64): one step of packed micro-batches of mixed-shape clips (images included)
  through the family's packed objective at CP 4 (U2xR2, the planner's placement) equals CP 1:
  loss and every parameter gradient (summed over CP) -- ``video_dit`` (flow and EDM), ``ar_dit``,
  ``wan``, ``wan_ar``. Through the ``Trainer`` (fp32): DP 4 x CP 1 and DP 1 x CP 4 (4 micro-batches)
  give the same loss and reduced gradients (the Σ/Σ normalisation over the global step).
* A short run on 4 ranks (DP 2 x CP 2) trains from a mixed shard set with images: finite losses.
* Resume: the ledger in the checkpoint; every clip exactly once per epoch across an interruption,
  at the same DP size and at another one (DP 2 -> DP 1 and DP 1 -> DP 4), also through the trainer.
* Pipeline: PP 2 x CP 2 equals PP 1 (Megatron's schedule with ``variable_seq_lengths``).
* TI2V with data.buckets (``wan``, ``wan_ar``): CP 4 equals CP 1; train and resume.
* Bad input: a clip over the token budget, ``stdit`` / ``data.source`` with ``data.buckets``:
  ``ValueError`` naming the field; the CLI exits 2.
"""

import zlib
from pathlib import Path

import pytest
import torch

from megatron_video.testing.mixed import tiny_mixed_config, write_tiny_mixed_shards

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]
AR = ("ar_dit", "wan_ar")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    write_tiny_mixed_shards("video_dit", root / "dit")
    write_tiny_mixed_shards("wan", root / "wan")
    return root


def _config(family, root, budget=None, **parallel):
    shards = root / ("wan" if family.startswith("wan") else "dit")
    budget = budget or (80 if family in AR else 48)
    return tiny_mixed_config(family, root, shards, budget=budget, **parallel)


def _maker(cfg, store=None, dp_rank=0, dp_size=1, U=1, R=1, cp_rank=0, log=None, source=None):
    from megatron_video.testing.mixed import packed_maker

    return packed_maker(
        cfg,
        cp_rank=cp_rank,
        U=U,
        R=R,
        dp_rank=dp_rank,
        dp_size=dp_size,
        log=log,
        store=store,
        source=source,
    )


# ---------------------------------------------------------------------------------------------
# exactness: the family's packed pieces, float64, CP 4 (U2xR2) == CP 1
# ---------------------------------------------------------------------------------------------
def _perturb(model):
    """The same full weights on every layout (AdaLN-zero would leave most gradients zero)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(full + (1.0 if name.endswith("layernorm.weight") else 0.0))


def _model64(cfg):
    from megatron_video.training.families import get_family

    fam = get_family(cfg.model.family)
    if cfg.model.family.startswith("wan"):
        from megatron_video.training.families.wan import wan_transformer_config

        model = fam.build_model(wan_transformer_config(cfg, params_dtype=torch.float64), config=cfg)
    else:
        tcfg = fam.transformer_config(cfg)
        tcfg.params_dtype = torch.float64
        model = fam.build_model(tcfg, config=cfg)
    model = model.double()
    _perturb(model)
    return model


def _float64(mb):
    for k, v in vars(mb).items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            setattr(mb, k, v.double())
    return mb


def _piece_step(family, root, U, R, objective):
    """Rank side: step 0 (2 micro-batches of mixed clips) of the packed pieces; the CP-summed
    loss and gradients."""
    from megatron_video.parallel import comm
    from megatron_video.testing.parallel import video_parallel
    from megatron_video.training.families import get_family

    parallel = dict(context_parallel_size=U * R, ulysses_size=U, ring_size=R)
    cfg = _config(family, root, ranks_per_node=2, **parallel)
    cfg.diffusion.objective = objective
    cfg.train.global_batch_size = 2  # 2 micro-batches of the one DP rank (4 at CP 1 : DP 4)
    with video_parallel(U, R, ranks_per_node=2, seed=0) as groups:
        model = _model64(cfg)
        maker = _maker(cfg, U=U, R=R, cp_rank=groups.cp_rank)
        obj = get_family(family).make_packed_objective(cfg)
        total, mbs = torch.zeros((), dtype=torch.float64), list(maker.step_batches(0))
        for mb in mbs:
            args, kwargs = obj.model_call(_float64(mb), True)
            share = obj.loss(model(*args, **kwargs), mb)
            share.backward()
            total += share.detach()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if groups.cp_size > 1:
            comm.all_reduce(total, groups.cp_group, tag="test.loss")
            for g in grads.values():
                comm.all_reduce(g, groups.cp_group, tag="test.grad")
        plans = [mb.plan.summary() for mb in mbs]
        return dict(loss=float(total), grads=grads, clips=[mb.clip_ids for mb in mbs], plans=plans)


CASES = [("video_dit", "flow"), ("video_dit", "edm"), ("ar_dit", "flow"), ("wan", "flow")]
CASES += [("wan_ar", "flow")]


@pytest.mark.parametrize("family,objective", CASES, ids=[f"{f}-{o}" for f, o in CASES])
def test_packed_step_cp4_equals_cp1(pool4, root, family, objective):
    ref = pool4.run(_piece_step, family, root, 1, 1, objective)[0]
    per_rank = pool4.run(_piece_step, family, root, 2, 2, objective)
    assert sum(len(c) for c in ref["clips"]) >= 3  # several clips of different shapes
    for res in per_rank:
        assert res["clips"] == ref["clips"]
        d_loss = abs(res["loss"] - ref["loss"])
        d_grad = max(float((res["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
        nonzero = sum(float(g.abs().max()) > 1e-8 for g in ref["grads"].values())
        assert nonzero >= 0.8 * len(ref["grads"])
        assert d_loss < 1e-12 and d_grad < 1e-11, (d_loss, d_grad)
    print(
        family,
        objective,
        f"loss {ref['loss']:.6f}",
        f"|dloss| {d_loss:.1e}",
        f"|dgrad| {d_grad:.1e}",
    )
    print(per_rank[0]["plans"])


def _trainer_step(family, root, parallel, gbs, perturb=False):
    """Rank side: the trainer's forward-backward of step 0; loss and reduced gradients, named
    globally (a pipeline stage's local layer ``i`` is global layer ``stage * per_stage + i``);
    ``perturb``: the same random weights by global name on every layout first."""
    import re
    import warnings

    from megatron.core import parallel_state as ps

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = _config(family, root, **parallel)
    cfg.train.global_batch_size = gbs
    trainer = Trainer(cfg, progress=False, cpu=True)
    try:
        stage = ps.get_pipeline_model_parallel_rank()
        per = cfg.model.num_layers // ps.get_pipeline_model_parallel_world_size()

        def name_of(n):
            return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{stage * per + int(m[1])}.", n)

        if perturb:
            with torch.no_grad():
                for n, p in trainer.model.named_parameters():
                    g = torch.Generator().manual_seed(zlib.crc32(name_of(n).encode()))
                    p.copy_(0.2 * torch.randn(p.shape, generator=g) + ("norm.weight" in n))
        loss = trainer.forward_backward(0)
        grads = {
            name_of(n): p.main_grad.detach().clone() for n, p in trainer.model.named_parameters()
        }
        return dict(loss=loss, grads=grads)
    finally:
        trainer.close()


def test_trainer_dp4_equals_cp4(pool4, root):
    """The same global step (cap 4 micro-batches of the budget) as DP 4 x 1 micro-batch and as
    DP 1 x CP 4 x 4 micro-batches: the loss is Σ token losses / Σ loss tokens of the step."""
    dp4 = pool4.run(_trainer_step, "wan", root, {}, 4)
    cp4 = dict(context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2)
    cp = pool4.run(_trainer_step, "wan", root, cp4, 4, ranks_per_node=2)
    ref = dp4[0]
    for res in dp4 + cp:
        d_grad = max(float((res["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
        assert abs(res["loss"] - ref["loss"]) < 1e-5 * abs(ref["loss"]) and d_grad < 1e-5
    print("trainer DP4 vs CP4 loss", ref["loss"], cp[0]["loss"], "max |dgrad|", d_grad)


def test_trainer_pp2_equals_pp1(pool4, root):
    """Packed micro-batches through Megatron's pipeline schedule (PP 2 x CP 2, U1xR2; the stages
    exchange each micro-batch's shape, ``variable_seq_lengths``) give the loss and gradients of
    PP 1 (CP 2 x DP 2) for the same global step."""
    cp2 = dict(context_parallel_size=2, ulysses_size=1, ring_size=2, ranks_per_node=2)
    ref = pool4.run(_trainer_step, "wan", root, cp2, 2, True, ranks_per_node=2)
    pp = pool4.run(_trainer_step, "wan", root, dict(cp2, pipeline_model_parallel_size=2), 2, True)
    want = ref[0]["grads"]
    seen, worst = set(), 0.0
    for res in pp:
        if res["loss"] is not None:
            assert abs(res["loss"] - ref[0]["loss"]) < 1e-5 * abs(ref[0]["loss"])
        for n, g in res["grads"].items():
            rel = float((g - want[n]).abs().max()) / (float(want[n].abs().max()) + 1e-12)
            assert rel < 1e-5, (n, rel)
            seen.add(n)
            worst = max(worst, rel)
    assert seen == set(want)  # every parameter on some stage
    assert sum(r["loss"] is not None for r in pp) == 2  # the last stage's two CP ranks
    print(
        "trainer PP2 vs PP1 loss", ref[0]["loss"], [r["loss"] for r in pp], "max rel dgrad", worst
    )


# ---------------------------------------------------------------------------------------------
# a short run, resume through the trainer
# ---------------------------------------------------------------------------------------------
def _run(family, root, out, steps, parallel, budget=None, gbs=None):
    import json
    import warnings

    from megatron_video.training import checkpoint as ckpt
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = _config(family, root, budget=budget, **parallel)
    cfg.output, cfg.train.steps = str(out), steps
    cfg.train.save, cfg.train.resume = True, True
    cfg.train.global_batch_size = gbs or cfg.train.global_batch_size
    trainer = Trainer(cfg, progress=False, cpu=True)
    trained, step_fn = [], trainer.train_step
    trainer.train_step = lambda step: trained.append(step) or step_fn(step)  # the steps it ran
    try:
        metrics = trainer.run()
        step = ckpt.latest_step(trainer.checkpoint_dir)
        ledger = ckpt.read_data_state(trainer.checkpoint_dir, step, "ledger")
        losses = [h["loss"] for h in json.loads((out / "metrics.json").read_text())["history"]]
        return dict(metrics=metrics, ledger=ledger, losses=losses, trained=trained)
    finally:
        trainer.close()


def _epoch_steps(cfg, store, dp_size):
    """Steps of epoch 0 as the sampler draws them at ``dp_size`` (pure)."""
    m = _maker(cfg, store=store, dp_size=dp_size)
    steps = 0
    while m.sampler.ledger.epoch == 0:
        m.step_batches(steps)
        steps += 1
    return steps - 1, len(m.ids)


def test_short_run_then_resume_at_another_dp_size(pool4, root, tmp_path):
    """DP 2 x CP 2 trains 1 step (saved with the ledger); resumed at DP 1 x CP 4 it trains the 3
    steps left of the epoch (the same global batch of 2 micro-batches: the same clips at any DP
    size): every clip exactly once, and the losses of the uninterrupted DP 2 x CP 2 run (fp32,
    1e-5: the same global step reduced in another order; a resume that drops the optimizer's
    state moves the third loss by ~1e-3)."""
    from megatron_video.data.ledger import SampleLedger
    from megatron_video.training.batches.packed import load_clip_store

    dp2 = dict(context_parallel_size=2, ring_size=2, ranks_per_node=2)
    cp4 = dict(context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2)
    kw = dict(budget=24, gbs=2, ranks_per_node=2)  # 4 steps per epoch
    cfg = _config("wan", root, budget=24)
    cfg.train.global_batch_size = 2
    store = load_clip_store(cfg)
    end, _ = _epoch_steps(cfg, store, 1)
    assert end == 4 == _epoch_steps(cfg, store, 2)[0]
    first = pool4.run(_run, "wan", root, tmp_path / "a", 1, dp2, **kw)[0]
    assert first["trained"] == [0] and SampleLedger.from_json(first["ledger"]).next_step == 1
    second = pool4.run(_run, "wan", root, tmp_path / "a", end, cp4, **kw)[0]
    assert second["trained"] == [1, 2, 3]  # resumed at step 1, not retrained from step 0
    whole = pool4.run(_run, "wan", root, tmp_path / "b", end, dp2, **kw)[0]
    final = SampleLedger.from_json(second["ledger"])
    assert final.epoch == 0 and final.steps == SampleLedger.from_json(whole["ledger"]).steps
    ids = [c for _, clips in final.steps for c in clips]
    assert sorted(ids) == sorted(store) and len(ids) == len(set(ids))  # each clip exactly once
    assert second["losses"][:1] == first["losses"]
    assert second["losses"] == pytest.approx(whole["losses"], rel=1e-5)
    print("resumed", second["losses"], "uninterrupted", whole["losses"])


@pytest.mark.parametrize("before,after", [(2, 2), (2, 1), (1, 4)])
def test_ledger_resume_every_clip_once(root, before, after):
    """Pure: the ledger saved after 2 steps at DP ``before`` resumes at DP ``after``: the epoch
    consumes every clip exactly once; empty micro-batches at its end run the dummy clip."""
    from megatron_video.training.batches.packed import load_clip_store

    cfg = _config("video_dit", root)
    store = load_clip_store(cfg)
    a = _maker(cfg, store=store, dp_size=before)
    seen = []
    for step in range(2):
        for d in range(before):
            b = _maker(cfg, store=store, dp_rank=d, dp_size=before)
            b.restore_data_state(a.data_state())
            seen += [c for mb in b.step_batches(step) for c in mb.clip_ids]
        a.step_batches(step)
    text = a.data_state()
    step, dummies = 2, 0
    while True:
        ranks = [_maker(cfg, store=store, dp_rank=d, dp_size=after) for d in range(after)]
        for r in ranks:
            r.restore_data_state(text)
        if ranks[0].sampler.cursor == len(ranks[0].sampler.queue):
            break  # epoch 0 is consumed
        for r in ranks:
            mbs = list(r.step_batches(step))
            dummies += sum(mb.scale == 0 for mb in mbs)
            seen += [c for mb in mbs for c in mb.clip_ids]
        text, step = ranks[0].data_state(), step + 1
    assert sorted(seen) == sorted(store) and len(seen) == len(set(seen))
    print(f"DP {before} -> {after}: {len(seen)} clips once each, {dummies} dummy micro-batches")


def test_replay_and_restart_give_the_same_draws(root):
    """Megatron-LM's entry resumes by replaying the ledger from the seed (``replay_to``) and
    restarts the evaluation draws at every evaluation (``restart``): both reproduce the
    sequential draws; replaying backwards is refused."""
    from megatron_video.training.batches.packed import load_clip_store

    cfg = _config("video_dit", root)
    store = load_clip_store(cfg)
    a = _maker(cfg, store=store, dp_size=2)
    draws = [[mb.clip_ids for mb in a.step_batches(s)] for s in range(3)]
    b = _maker(cfg, store=store, dp_size=2)
    b.replay_to(2)
    assert [mb.clip_ids for mb in b.step_batches(2)] == draws[2]
    assert a.data_state() == b.data_state()
    a.restart()
    assert [mb.clip_ids for mb in a.step_batches(0)] == draws[0]
    with pytest.raises(ValueError, match=r"step \(0\) must not be before the sample ledger's next"):
        b.replay_to(0)


def test_middle_pipeline_stages_read_no_clip(root):
    """``need_latents=False`` (a middle pipeline stage, whose input is the previous stage's): no
    clip's latents are read, and everything the stage does use -- placement, timesteps, CFG
    drop, captions, loss mask -- equals a first stage's."""
    from megatron_video.training.batches.packed import load_clip_store

    cfg = _config("wan", root)
    store = load_clip_store(cfg)
    first = _maker(cfg, store=store, U=2, R=2, cp_rank=1)
    middle = _maker(cfg, store=store, U=2, R=2, cp_rank=1)
    middle.need_latents = False

    def refuse(*a, **k):
        raise AssertionError("a middle stage read a clip")

    middle.source.latents = refuse
    for a, b in zip(first.step_batches(0), middle.step_batches(0)):
        assert a.clip_ids == b.clip_ids and a.placement == b.placement
        for name in ("t", "sigma", "drop", "caption_ids", "caption_mask", "loss_mask", "noise"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert not b.x.any() and a.x.any()


def test_empty_micro_batches_run_the_dummy_clip(root):
    """12 clips over DP 4 x 4 micro-batches: the empty ones hold the one-token zero clip with
    loss weight 0 on every rank (the schedule is the same everywhere, nothing hangs)."""
    from megatron_video.training.batches.packed import load_clip_store

    cfg = _config("video_dit", root)
    cfg.train.global_batch_size = 16
    store = load_clip_store(cfg)
    mbs = [mb for d in range(4) for mb in _maker(cfg, store, d, 4).step_batches(0)]
    empty = [mb for mb in mbs if not mb.clip_ids]
    assert len(mbs) == 16 and len(empty) == 4 and sum(len(mb.clip_ids) for mb in mbs) == 12
    for mb in empty:
        assert mb.scale == 0.0 and repr(mb.packed) == "PackedVideo([1x1x1], seq_len=2)"
    assert all(mb.scale == 16.0 for mb in mbs if mb.clip_ids)


@pytest.mark.parametrize("family", ["wan", "ar_dit"])
def test_lazy_shards_read_only_the_index_up_front(root, family, monkeypatch):
    """Training's shards source (``LazyShardClipSource``): building it reads the tar headers,
    captions and meta only (no tensor is loaded: ``torch.load`` is refused meanwhile); its
    micro-batches equal those of the in-memory store, each clip's tensors read from its tar
    offsets when a micro-batch needs them."""
    import megatron_video.data.shards as shards
    from megatron_video.training.batches.clips import LazyShardClipSource
    from megatron_video.training.batches.packed import load_clip_store

    cfg = _config(family, root)
    cfg.train.global_batch_size = 2
    with monkeypatch.context() as mp:
        mp.setattr(shards.torch, "load", lambda *a, **k: pytest.fail("loaded a tensor"))
        lazy = LazyShardClipSource(cfg, cache=2)
    assert lazy.loads == 0 and len(lazy.ids) == 12
    eager = load_clip_store(cfg)
    a = _maker(cfg, U=2, R=2, cp_rank=1, source=lazy)
    b = _maker(cfg, store=eager, U=2, R=2, cp_rank=1)
    assert a.ids == b.ids and a.costs == b.costs
    for step in range(3):
        for x, y in zip(a.step_batches(step), b.step_batches(step)):
            assert x.clip_ids == y.clip_ids and torch.equal(x.x, y.x)
            assert torch.equal(x.caption_ids, y.caption_ids)
            assert torch.equal(x.caption_mask, y.caption_mask)
    assert 0 < lazy.loads and len(lazy._recent) <= 2
    for k in lazy.ids:
        assert lazy.caption(k) == eager[k]["caption"]
        assert torch.equal(lazy.latents(k, []), eager[k]["latent"])
    # a tensor that disagrees with the grid its meta.json declared is refused when it is read
    key = lazy.ids[0]
    lazy._recent.clear()
    lazy.grids[key] = (99, 1, 1)
    with pytest.raises(ValueError, match=rf"shard sample '{key}': latent .* must match its meta"):
        lazy.latents(key, [])


# ---------------------------------------------------------------------------------------------
# the planner's report, bad input
# ---------------------------------------------------------------------------------------------
def test_planner_decision_printed_once(root):
    from megatron_video.training.batches.packed import load_clip_store

    cfg = _config("video_dit", root)
    cfg.train.global_batch_size = 2
    lines = []
    m = _maker(cfg, store=load_clip_store(cfg), U=2, R=2, log=lines.append)
    m.step_batches(0)
    m.step_batches(1)
    assert len(lines) == 1
    text = lines[0]
    assert "budget 48 tokens per micro-batch" in text and "12 clips (4 images)" in text
    assert text.count("placement U2xR2") == 2 and "micro-batch 1:" in text


def test_bad_input_names_the_field(root):
    from megatron_video.training.batches.packed import load_clip_store
    from megatron_video.training.config import validate

    cfg = _config("video_dit", root, budget=20)
    with pytest.raises(
        ValueError,
        match=r"data.buckets.tokens_per_microbatch \(20\) must hold every clip: clip 'm0000' "
        r"has 36 tokens",
    ):
        _maker(cfg, store=load_clip_store(cfg))
    cfg = _config("stdit", root)
    cfg.model.stdit_full_attention_layers = [1]
    with pytest.raises(ValueError, match=r"data.buckets is not supported by model.family 'stdit'"):
        validate(cfg, 1)
    cfg = _config("video_dit", root)
    cfg.data.source = "synthetic"
    with pytest.raises(
        ValueError, match=r"data.source \('synthetic'\) must be 'shards' or 'energon'"
    ):
        validate(cfg, 1)
    cfg = _config("video_dit", root)
    cfg.train.micro_batch_size = 2
    with pytest.raises(
        ValueError, match=r"train.micro_batch_size \(2\) must be 1 with data.buckets"
    ):
        validate(cfg, 1)
    cfg = _config("ar_dit", root)
    cfg.model.frames_per_block = 2
    with pytest.raises(ValueError, match=r"multiple of model.frames_per_block \(2\)"):
        _maker(cfg, store=load_clip_store(cfg))


def test_cli_stdit_with_buckets_exits_2(root, capsys):
    from megatron_video.training.cli import main

    args = ["validate", "--nproc", "4", "--config", str(ROOT / "examples/configs/mixed_tiny.yaml")]
    args += ["model.family=stdit", "model.stdit_full_attention_layers=[1]"]
    assert main(args + [f"data.shards={root / 'wan'}"]) == 2
    assert "data.buckets is not supported by model.family 'stdit'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Wan's 81 frames in a mixed set, and TI2V with data.buckets (docs/wan.md, "Any length at any CP")
# ---------------------------------------------------------------------------------------------
SHAPES_81 = ((21, 4, 4), (1, 4, 6), (3, 6, 4), (21, 4, 6), (2, 4, 4), (21, 6, 4))


@pytest.fixture(scope="module")
def root81(tmp_path_factory):
    """Clips of 81 raw frames (21 latent frames, 84 / 126 tokens) among short clips and images."""
    from megatron_video.testing.mixed import TEXT, write_mixed_latent_shards

    root = tmp_path_factory.mktemp("mixed81")
    write_mixed_latent_shards(root / "wan", len(SHAPES_81), shapes=SHAPES_81, text=TEXT)
    return root


def _config81(root, i2v, **parallel):
    cfg = tiny_mixed_config("wan", root, root / "wan", budget=128, **parallel)
    cfg.data.buckets["max_frames"] = 81
    cfg.data.i2v_probability = i2v
    return cfg


def _config_ar(root, i2v, **parallel):
    """``wan_ar`` (teacher forcing, blocks of 1 latent frame) on the mixed set, TI2V ``i2v``."""
    cfg = _config("wan_ar", root, **parallel)
    cfg.data.i2v_probability = i2v
    return cfg


def _ti2v_piece_step(root, U, R, i2v, make=_config81):
    """``_piece_step`` of ``make``'s config (``wan`` on the 81-frame set, or ``wan_ar``) with
    first-frame conditioning ``i2v``; ``conds``: the first-frame tokens held (no loss)."""
    from megatron_video.parallel import comm
    from megatron_video.testing.parallel import video_parallel
    from megatron_video.training.families import get_family

    cfg = make(root, i2v, context_parallel_size=U * R, ulysses_size=U, ring_size=R)
    cfg.parallel.ranks_per_node = 2
    cfg.train.global_batch_size = 2
    with video_parallel(U, R, ranks_per_node=2, seed=0) as groups:
        model = _model64(cfg)
        maker = _maker(cfg, U=U, R=R, cp_rank=groups.cp_rank)
        obj = get_family(cfg.model.family).make_packed_objective(cfg)
        total, mbs = torch.zeros((), dtype=torch.float64), list(maker.step_batches(0))
        conds = []
        for mb in mbs:
            # held: tokens that would bear loss and do not (the I2V first frames)
            held = mb.packed.loss_mask(mb.local)[None] & ~mb.loss_mask
            conds.append(int(held.sum()))
            if mb.condition is not None:  # full clips: the model's condition is the held tokens
                assert torch.equal(mb.condition, held)
            if mb.t.dim() == 2:  # teacher forcing: the noisy frame 0 at timestep 0
                assert bool((mb.t[held] == 0).all())
            args, kwargs = obj.model_call(_float64(mb), True)
            share = obj.loss(model(*args, **kwargs), mb)
            share.backward()
            total += share.detach()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if groups.cp_size > 1:
            comm.all_reduce(total, groups.cp_group, tag="test.loss")
            for g in grads.values():
                comm.all_reduce(g, groups.cp_group, tag="test.grad")
        n_loss = mbs[0].num_loss_tokens
        clips = [mb.clip_ids for mb in mbs]
        return dict(loss=float(total), grads=grads, clips=clips, conds=conds, n_loss=n_loss)


@pytest.mark.parametrize("family", ["wan", "wan_ar"])
def test_ti2v_with_buckets_at_cp4_equals_cp1(pool4, root, root81, family):
    """TI2V (every clip I2V) with data.buckets, float64 -- ``wan``: 81-frame clips packed with
    short ones; ``wan_ar``: packed teacher-forcing clips, whose noisy frame 0 is the clean latent
    at timestep 0: CP 4 (U2xR2) equals CP 1 (loss, every gradient); the first-frame tokens are
    held (no loss, counted out of the step's loss tokens: ``h·w`` per clip) and change the loss."""
    from megatron_video.testing.mixed import packed_maker

    make, root = (_config81, root81) if family == "wan" else (_config_ar, root)
    ref = pool4.run(_ti2v_piece_step, root, 1, 1, 1.0, make)[0]
    t2v = pool4.run(_ti2v_piece_step, root, 1, 1, 0.0, make)[0]
    cfg = make(root, 1.0)
    clips = packed_maker(cfg).clips
    ids = [k for c in ref["clips"] for k in c]
    assert family == "wan_ar" or any(clips[k].frames == 21 for k in ids)
    positions = sum(clips[k].positions for k in ids)
    assert ref["n_loss"] == t2v["n_loss"] - positions and sum(ref["conds"]) == positions
    assert abs(ref["loss"] - t2v["loss"]) > 1e-6 and sum(t2v["conds"]) == 0
    for res in pool4.run(_ti2v_piece_step, root, 2, 2, 1.0, make):
        assert res["clips"] == ref["clips"] and sum(res["conds"]) <= positions
        d_loss = abs(res["loss"] - ref["loss"])
        d_grad = max(float((res["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
        assert d_loss < 1e-12 and d_grad < 1e-11, (d_loss, d_grad)


def _run81(root, out, i2v, make=_config81):
    """3 steps saved after each (a constant LR: a step's LR does not depend on
    ``train.steps``), then a fresh trainer resumed from step 1 runs steps 1 and 2 again (step 2
    after an optimizer step from the restored state): ``(losses of the run, the resumed steps'
    losses, the ledger after them)``."""
    import json
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")

    def config(name):
        cfg = make(root, i2v, context_parallel_size=4, ulysses_size=2, ring_size=2)
        cfg.parallel.ranks_per_node, cfg.output, cfg.train.steps = 2, str(out / name), 3
        cfg.train.save, cfg.train.save_interval = True, 1
        cfg.train.lr_decay_style = "constant"
        return cfg

    trainer = Trainer(config("a"), progress=False, cpu=True)
    try:
        trainer.run()
    finally:
        trainer.close()
    history = json.loads((out / "a" / "metrics.json").read_text())["history"]
    trainer = Trainer(config("b"), progress=False, cpu=True)
    try:
        step = trainer.load(out / "a" / "checkpoints", step=1)  # model, optimizer, ledger
        resumed = [trainer.train_step(s)["loss"] for s in (step, step + 1)]
        ledger = trainer.batches.data_state()
    finally:
        trainer.close()
    return dict(losses=[h["loss"] for h in history], step=step, resumed=resumed, ledger=ledger)


def test_81_frame_bucket_trains_and_resumes_at_cp4(pool4, root81, tmp_path):
    """An 81-frame bucket among short clips, TI2V with data.buckets, at CP 4 (U2xR2): 3 steps
    (finite losses, an 81-frame clip among them); a fresh trainer resumed from step 1's
    checkpoint (model, optimizer, sample ledger) repeats steps 1 and 2 bitwise."""
    from megatron_video.data.ledger import SampleLedger
    from megatron_video.testing.mixed import packed_maker

    got = pool4.run(_run81, root81, tmp_path, 0.5, ranks_per_node=2)[0]
    assert got["step"] == 1 and len(got["losses"]) == 3
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    assert got["resumed"] == got["losses"][1:]
    clips = packed_maker(_config81(root81, 0.5)).clips
    trained = [k for _, keys in SampleLedger.from_json(got["ledger"]).steps for k in keys]
    assert len(SampleLedger.from_json(got["ledger"]).steps) == 3
    assert any(clips[k].frames == 21 for k in trained)  # an 81-frame clip in the run


def test_wan_ar_ti2v_with_buckets_trains_and_resumes_at_cp4(pool4, root, tmp_path):
    """``wan_ar`` TI2V (``data.i2v_probability`` 0.5) with data.buckets at CP 4 (U2xR2): 3 steps
    with I2V clips among them (finite losses); resumed from step 1's checkpoint, steps 1 and 2
    repeat bitwise."""
    from megatron_video.data.ledger import SampleLedger
    from megatron_video.testing.mixed import packed_maker

    got = pool4.run(_run81, root, tmp_path, 0.5, _config_ar, ranks_per_node=2)[0]
    assert got["step"] == 1 and len(got["losses"]) == 3
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    assert got["resumed"] == got["losses"][1:]
    maker = packed_maker(_config_ar(root, 0.5))
    steps = SampleLedger.from_json(got["ledger"]).steps
    assert len(steps) == 3 and any(maker._i2v(s, k) for s, keys in steps for k in keys)
