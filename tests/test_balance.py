"""Balance of a global batch over DP ranks x micro-batches (megatron_video/data/balance.py) against
brute-force optima and Graham's LPT bound, the token budget, the cost-vs-token-count comparison on
a realistic mix; the sample ledger (megatron_video/data/ledger.py): every clip exactly once per
epoch across an interruption, at the same and at another DP size."""

import dataclasses
import functools
import io
import itertools
import json
import random

import pytest
import torch

from megatron_video.data.balance import balance_clips, clip_costs
from megatron_video.data.buckets import BucketConfig, BucketGrid
from megatron_video.data.ledger import SampleLedger, StepSampler
from megatron_video.layouts.placement import Clip, CostModel
from megatron_video.layouts.vae_halo import windows_for_bounds


def _check_assignment(a, tokens, costs, D, M, budget):
    flat = sorted(i for rank in a.bins for b in rank for i in b)
    assert flat == list(range(len(tokens)))  # every clip exactly once
    assert len(a.bins) == D and all(len(rank) == M for rank in a.bins)
    for d, rank in enumerate(a.bins):
        assert sum(costs[i] for b in rank for i in b) == pytest.approx(a.rank_cost[d])
        for m, b in enumerate(rank):
            assert sum(tokens[i] for i in b) == a.bin_tokens[d][m] <= budget


def _brute_force_max(costs, D):
    """The optimal largest per-rank cost over every clip-to-rank map (no budget)."""
    best = float("inf")
    for ranks in itertools.product(range(D), repeat=len(costs)):
        load = [0.0] * D
        for c, r in zip(costs, ranks):
            load[r] += c
        best = min(best, max(load))
    return best


@pytest.mark.parametrize("D", [2, 3])
def test_lpt_within_grahams_bound_of_the_brute_force_optimum(D):
    rng = random.Random(D)
    for _ in range(40):
        n = rng.randint(D + 1, 8)
        costs = [rng.choice([rng.uniform(1, 10), float(rng.randint(1, 5))]) for _ in range(n)]
        tokens = [rng.randint(1, 50) for _ in range(n)]
        a = balance_clips(costs, tokens, D, 2, sum(tokens))
        _check_assignment(a, tokens, costs, D, 2, sum(tokens))
        opt = _brute_force_max(costs, D)
        assert max(a.rank_cost) <= (4 / 3 - 1 / (3 * D)) * opt + 1e-9


def _improving_exchanges(a, costs, tokens, budget):
    """Every single-clip move or swap off the busiest rank that lowers the pair's max (test-side
    enumeration)."""
    load = list(a.rank_cost)
    top = max(range(len(load)), key=lambda r: load[r])
    found = []
    for m, b in enumerate(a.bins[top]):
        for i in b:
            for d, rank in enumerate(a.bins):
                for m2, b2 in enumerate(rank):
                    if d == top:
                        continue
                    for j in [None, *b2]:
                        dc = costs[i] - (costs[j] if j is not None else 0)
                        dt = tokens[i] - (tokens[j] if j is not None else 0)
                        fits = a.bin_tokens[d][m2] + dt <= budget >= a.bin_tokens[top][m] - dt
                        if fits and max(load[top] - dc, load[d] + dc) < load[top] - 1e-9:
                            found.append((i, j, d, m2))
    return found


def test_no_single_move_or_swap_lowers_the_busiest_rank():
    rng = random.Random(11)
    for _ in range(60):
        D, M, budget = rng.randint(2, 4), rng.randint(1, 2), 40
        tokens = [rng.randint(1, 20) for _ in range(rng.randint(3, 12))]
        while sum(tokens) > D * M * budget / 2:
            tokens.pop()
        costs = [float(t * t + rng.randint(0, 50)) for t in tokens]
        a = balance_clips(costs, tokens, D, M, budget)
        _check_assignment(a, tokens, costs, D, M, budget)
        assert _improving_exchanges(a, costs, tokens, budget) == []


def test_budget_respected_and_half_full_batches_always_fit():
    rng = random.Random(7)
    for _ in range(200):
        D, M, budget = rng.randint(1, 4), rng.randint(1, 3), rng.randint(10, 100)
        tokens = [rng.randint(1, budget // 2) for _ in range(rng.randint(1, 20))]
        while sum(tokens) > D * M * budget / 2:  # the documented guarantee's condition
            tokens.pop()
        costs = [t * t + rng.random() for t in tokens]
        if tokens:
            a = balance_clips(costs, tokens, D, M, budget)
            _check_assignment(a, tokens, costs, D, M, budget)


def test_tight_budget_packs_or_raises_never_overflows():
    rng = random.Random(3)
    packed = 0
    for _ in range(200):
        tokens = [rng.randint(1, 10) for _ in range(rng.randint(2, 9))]
        costs = [float(t * t) for t in tokens]
        try:
            a = balance_clips(costs, tokens, 2, 2, 10)
        except ValueError as e:
            assert "must fit dp_size (2) x num_microbatches (2)" in str(e)
            continue
        _check_assignment(a, tokens, costs, 2, 2, 10)
        packed += 1
    assert packed > 50


def test_deterministic_and_ties_by_index():
    a = balance_clips([5.0] * 4, [1] * 4, 2, 1, 10)
    assert a.bins == (((0, 2),), ((1, 3),))
    assert balance_clips([3, 1, 2], [1, 1, 1], 2, 2, 5) == balance_clips(
        [3, 1, 2], [1, 1, 1], 2, 2, 5
    )


@pytest.mark.parametrize(
    "args,match",
    [
        (([1.0], [5], 0, 1, 10), r"dp_size \(0\) must be an integer >= 1"),
        (([1.0], [11], 1, 1, 10), r"tokens\[0\] \(11\) must be an integer in \[1, tokens_per_mi"),
        (([-1.0], [1], 1, 1, 10), r"costs\[0\] \(-1.0\) must be a number >= 0"),
        (([1.0, 2.0], [1], 1, 1, 10), r"costs \(2\) and tokens \(1\) must be"),
        (([1.0] * 3, [8] * 3, 1, 2, 10), r"tokens \(24 in 3 clips\) must fit dp_size \(1\)"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        balance_clips(*args)


@functools.lru_cache(maxsize=None)
def _realistic_clips(n, seed):
    """Durations 2-16 s at 16 fps, three aspect buckets (16:9, 1:1, 9:16), 20 % images."""
    rng = random.Random(seed)
    grid = BucketGrid(
        BucketConfig(
            aspect_ratios=["16:9", "1:1", "9:16"], max_frames=257, tokens_per_microbatch=2**17
        )
    )
    sizes = [(720, 1280), (1080, 1080), (1280, 720)]
    plans = []
    for i in range(n):
        h, w = rng.choice(sizes)
        frames = 1 if rng.random() < 0.2 else round(rng.uniform(2, 16) * 16)
        plans.append(grid.plan(i, frames, h, w, fps=16.0))
    assert {p.bucket for p in plans} == {0, 1, 2}
    return tuple(plans), grid


@functools.lru_cache(maxsize=None)
def _costs(n, seed):
    return clip_costs([p.placement_clip() for p in _realistic_clips(n, seed)[0]])


@pytest.mark.parametrize("D,M", [(8, 4), (16, 2)])  # 64 clips: 8 or 4 per DP rank
def test_cost_balance_beats_token_count_balance_on_a_realistic_mix(D, M):
    ratios = []
    for seed in range(5):
        plans, grid = _realistic_clips(64, seed)
        tokens = [p.tokens for p in plans]
        costs = _costs(64, seed)
        by_cost = balance_clips(costs, tokens, D, M, 2**17)
        by_tokens = balance_clips([float(t) for t in tokens], tokens, D, M, 2**17)
        _check_assignment(by_cost, tokens, costs, D, M, 2**17)
        real = [sum(costs[i] for b in rank for i in b) for rank in by_tokens.bins]
        token_ratio = max(real) / (sum(real) / len(real))
        assert by_cost.imbalance() <= token_ratio + 1e-12
        ratios.append((by_cost.imbalance(), token_ratio))
    assert sum(a for a, _ in ratios) < sum(b for _, b in ratios)
    print(f"DP{D} x M{M} max/mean cost, cost-balanced / token-balanced:")
    print(" ".join(f"{a:.3f}/{b:.3f}" for a, b in ratios))


def test_clip_costs_are_the_cost_model():
    clips = [Clip(10), Clip(8, "causal"), Clip(8, "block_causal", 4)]
    assert clip_costs(clips, CostModel(pair=1, token=0)) == [100, 36, 48]  # n^2, n(n+1)/2, blocks
    assert clip_costs([Clip(10)], CostModel(pair=0, token=2)) == [20]


# -- sample ledger ---------------------------------------------------------------------------------
def _sampler(data, dp, ledger=None, seed=11, **kw):
    """A sampler over ``_realistic_clips(*data)``."""
    plans = _realistic_clips(*data)[0]
    tokens = [p.tokens for p in plans]
    costs = _costs(*data)
    ids = [f"clip{p.key}" for p in plans]
    return StepSampler(
        ids, tokens, costs, dp_size=dp, num_microbatches=2, tokens_per_microbatch=2**17,
        seed=seed, ledger=ledger, **kw,
    )  # fmt: skip


def _run_epoch(sampler, ledger_json=None, stop_at=None):
    """Steps until the epoch's clips are used up (or ``stop_at`` steps); the batches."""
    out = []
    while sampler.cursor < len(sampler.queue) and (stop_at is None or len(out) < stop_at):
        out.append(sampler.next_step())
    return out


@pytest.mark.parametrize("dp_after", [4, 2, 8, 1])
def test_every_clip_exactly_once_across_an_interruption(dp_after):
    first = _sampler((300, 0), 4)
    saved = None
    for k in range(7):  # checkpoint after step 4; steps 5, 6 are lost with the interruption
        first.next_step()
        if k == 4:
            saved = first.ledger.to_json()
    resumed = _sampler((300, 0), dp_after, SampleLedger.from_json(saved))
    assert resumed.ledger.next_step == 5
    later = _run_epoch(resumed)
    steps = SampleLedger.from_json(saved).steps + [(b.step, list(b.clip_ids)) for b in later]
    assert [s for s, _ in steps] == list(range(len(steps)))
    used = [c for _, ids in steps for c in ids]
    assert sorted(used) == sorted(f"clip{i}" for i in range(300))  # each clip exactly once
    for b in later:
        assert sorted(c for rank in b.bins for mb in rank for c in mb) == sorted(b.clip_ids)
        assert len(b.bins) == dp_after
        assert all(t <= 2**17 for rank in b.assignment.bin_tokens for t in rank)


def test_replayed_draws_are_the_same_at_any_dp_size():
    """Which clips a step takes depends on the global batch (DP x micro-batches), not on DP:
    Megatron-LM's entry replays the ledger from the seed and resumes at another DP size."""

    def ledger(dp, m):
        plans, costs = _realistic_clips(120, 1)[0], _costs(120, 1)
        s = StepSampler(
            [f"clip{p.key}" for p in plans], [p.tokens for p in plans], costs, dp_size=dp,
            num_microbatches=m, tokens_per_microbatch=2**17, seed=3,
        )  # fmt: skip
        _run_epoch(s)
        return s.ledger.steps

    ref = ledger(4, 1)
    assert len(ref) > 3 and ledger(2, 2) == ref and ledger(1, 4) == ref


def test_fixed_shape_steps_are_whole_and_drop_the_epoch_tail():
    """One clip per sequence (tokens 1, budget = micro-batch size): every micro-batch full; the
    clips that cannot fill a last step wait for the next epoch (``drop_last``)."""
    s = StepSampler(list(range(10)), [1] * 10, [1.0] * 10, dp_size=2, num_microbatches=1,
                    tokens_per_microbatch=2, drop_last=True)  # fmt: skip
    steps = [s.next_step() for _ in range(4)]
    assert all(len(mb) == 2 for b in steps for rank in b.bins for mb in rank)
    assert [b.epoch for b in steps] == [0, 0, 1, 1]  # 8 of 10 clips in epoch 0, 2 left over
    with pytest.raises(ValueError, match="must fill one step"):
        StepSampler([0, 1], [1, 1], [1.0, 1.0], dp_size=2, num_microbatches=1,
                    tokens_per_microbatch=2, drop_last=True)  # fmt: skip


def test_same_dp_resume_repeats_the_uninterrupted_batches():
    whole = _run_epoch(_sampler((120, 1), 2))
    part = _sampler((120, 1), 2)
    _run_epoch(part, stop_at=3)
    rest = _run_epoch(_sampler((120, 1), 2, SampleLedger.from_json(part.ledger.to_json())))
    assert [b.bins for b in whole[3:]] == [b.bins for b in rest]


def test_epochs_roll_over_with_a_new_permutation():
    s = _sampler((40, 2), 2, max_clips=8)
    e0 = _run_epoch(s)
    assert all(len(b.clip_ids) <= 8 for b in e0)
    b = s.next_step()
    assert b.epoch == 1 and s.ledger.steps_before == len(e0) and b.step == len(e0)
    assert s.permutation(0) != s.permutation(1)
    blob = json.loads(s.ledger.to_json())
    assert blob["epoch"] == 1 and blob["steps"] == [[b.step, list(b.clip_ids)]]


def test_ledger_refuses_repeats_wrong_steps_and_foreign_state():
    led = SampleLedger(seed=1)
    led.record(0, ["a", "b"])
    with pytest.raises(ValueError, match=r"step 1: clip ids \['a'\] must not repeat"):
        led.record(1, ["a"])
    with pytest.raises(ValueError, match=r"step \(5\) must be the ledger's next step \(1\)"):
        led.record(5, ["c"])
    with pytest.raises(ValueError, match="must be a megatron_video.sample_ledger/1 JSON"):
        SampleLedger.from_json(json.dumps({"format": "pickle"}))
    with pytest.raises(ValueError, match=r"seed \(11\) must equal the ledger's seed \(1\)"):
        _sampler((10, 3), 1, SampleLedger(seed=1))
    with pytest.raises(ValueError, match=r"the ledger names clip ids \['zz'\] not in clip_ids"):
        _sampler((10, 3), 1, SampleLedger(seed=11, steps=[(0, ["zz"])]))
    with pytest.raises(ValueError, match=r"sample ledger is malformed \(KeyError"):
        SampleLedger.from_json(json.dumps({"format": "megatron_video.sample_ledger/1"}))
    with pytest.raises(ValueError, match=r"clip 'y': tokens \(10\) must be in \[1, tokens_per_m"):
        StepSampler(
            ["x", "y"], [1, 10], [1, 1], dp_size=1, num_microbatches=1, tokens_per_microbatch=9
        )
    with pytest.raises(ValueError, match=r"clip_ids must be unique; repeated: \['x'\]"):
        StepSampler(
            ["x", "x"], [1, 1], [1, 1], dp_size=1, num_microbatches=1, tokens_per_microbatch=9
        )


def _write_images(folder, sizes):
    """Random RGB pngs with captions; ``{source path under SRC: pixels [H, W, 3]}``."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    out = {}
    for n, (h, w) in enumerate(sizes):
        px = np.random.default_rng(n).integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(px).save(folder / f"pic{n}.png")
        (folder / f"pic{n}.txt").write_text(f"picture {n}")
        out[f"{folder.name}/pic{n}.png"] = px
    return out


def test_energon_clips_by_key_resume_at_another_dp_size(tmp_path):
    """A prepared energon dataset of mixed shapes (videos, images) read by key from a
    StepSampler's bins: every clip once across an interruption at DP 2 resumed at DP 1 (energon's
    own loader state refuses a DP change); frames equal the full decode where no resize is
    needed."""
    pytest.importorskip("megatron.energon")
    from megatron.energon.av import AVDecoder

    from megatron_video.data.energon_video import (
        KeyedClips,
        dataset_records,
        prepare_dataset,
        write_procedural_videos,
    )

    src = tmp_path / "src"
    write_procedural_videos(src / "land", 3, num_frames=17, height=32, width=48)
    write_procedural_videos(src / "port", 3, num_frames=9, height=48, width=32, seed=1)
    write_procedural_videos(src / "img", 2, num_frames=1, height=40, width=40, seed=2)
    pics = _write_images(src / "pics", [(32, 48), (40, 40), (24, 36)])
    (src / "pics" / "bad.png").write_bytes(b"not a png")
    (src / "pics" / "bad.txt").write_text("broken")
    summary = prepare_dataset(src, tmp_path / "dst")
    assert [(f.split("/")[-1], why.split(":")[0]) for f, why in summary["skipped"]] == [
        ("bad.png", f"image {str(src / 'pics' / 'bad.png')!r} is unreadable")
    ]
    cfg = BucketConfig(area=24, aspect_ratios=["3:2", "2:3"], patch_size=[1, 1, 1], max_frames=17)
    plans = {p.key: p for p in BucketGrid(cfg).plan_many(dataset_records(tmp_path / "dst"))}
    keys = sorted(plans)
    tokens = [plans[k].tokens for k in keys]
    costs = clip_costs([plans[k].placement_clip() for k in keys])
    kw = dict(num_microbatches=1, tokens_per_microbatch=150, seed=5)
    first = StepSampler(keys, tokens, costs, dp_size=2, **kw)
    first.next_step()
    saved = first.ledger.to_json()
    first.next_step()  # lost with the interruption
    resumed = StepSampler(
        keys, tokens, costs, dp_size=1, ledger=SampleLedger.from_json(saved), **kw
    )
    _run_epoch(resumed)
    used = [k for _, ids in resumed.ledger.steps for k in ids]
    assert sorted(used) == keys
    clips = KeyedClips(tmp_path / "dst")
    for k in keys:
        p, video = plans[k], clips.read(plans[k])
        F, h, w = p.latent
        assert video.shape == (3, p.num_frames, 8 * h, 8 * w)
        if p.resized == (8 * h, 8 * w) and clips.records[k]["ext"] == "mp4":  # no resize: the
            data, _ = clips.store[f"{k}.mp4"]  # planned frames of the full decode
            n = clips.records[k]["num_frames"]
            full = AVDecoder(io.BytesIO(data)).get_video_clips([(0, n - 1)], "frames")[0][0]
            want = full[p.source_frames()].float() / 127.5 - 1
            torch.testing.assert_close(video, want.permute(1, 0, 2, 3), atol=0, rtol=0)
    assert {plans[k].latent for k in keys} == {(5, 4, 6), (3, 6, 4), (1, 4, 6)}
    land = next(plans[k] for k in keys if plans[k].latent[0] == 5)
    for w in windows_for_bounds([(0, 2), (2, 5)], 1):  # a CP rank decodes only its window
        torch.testing.assert_close(clips.read(land, w), w.slice_raw(clips.read(land)[None])[0])
    with pytest.raises(ValueError, match=r"window \(0, 21\) must lie in its 17 planned frames"):
        clips.read(land, windows_for_bounds([(0, 6)], 0)[0])
    for k in keys:  # images (one-frame clips, read with PIL): an unresized one equals its pixels
        rec = clips.records[k]
        if rec["ext"] == "png" and (rec["height"], rec["width"]) == (32, 48):
            want = torch.from_numpy(pics[rec["source"]]).float() / 127.5 - 1
            torch.testing.assert_close(clips.read(plans[k]), want.permute(2, 0, 1)[:, None])
    assert sum(clips.records[k]["ext"] == "png" for k in keys) == 3
    with pytest.raises(ValueError, match=r"clip 'nope' is not in the dataset"):
        clips.read(dataclasses.replace(plans[keys[0]], key="nope"))
