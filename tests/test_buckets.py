"""Bucket grid (megatron_video/data/buckets.py): shapes against brute-force enumeration, the
bucket of a clip against the first-principles kept share of its frame, the frame-count rule
against enumeration, resampling, images, and every bad input naming the clip / field and rule."""

import json
import math
import random
from pathlib import Path

import pytest

from megatron_video.data.buckets import BucketConfig, BucketGrid, aspect_ratio, resize_crop
from megatron_video.layouts.placement import Clip


def _all_shapes(area, ph, pw, tol=0.1):
    shapes = [(h, w) for h in range(ph, area + 1, ph) for w in range(pw, area // h + 1, pw)]
    return [(h, w) for h, w in shapes if h * w >= (1 - tol) * area]


@pytest.mark.parametrize("area,patch", [(60 * 104, (1, 2, 2)), (900, (1, 1, 1)), (2000, (1, 4, 2))])
def test_bucket_shapes_are_the_closest_aspect_at_the_area(area, patch):
    cfg = BucketConfig(area=area, patch_size=list(patch), max_frames=5)
    grid = BucketGrid(cfg)
    _, ph, pw = patch
    every = _all_shapes(area, ph, pw)
    ratios = [aspect_ratio(r) for r in cfg.aspect_ratios]
    assert len(grid.shapes) == len(set(grid.shapes))
    for h, w in grid.shapes:
        assert h % ph == 0 and w % pw == 0 and 0.9 * area <= h * w <= area
    for r, shape in zip(ratios, grid.shapes):  # the default ratios give distinct buckets here
        best = min(abs(math.log(w / h / r)) for h, w in every)
        assert abs(math.log(shape[1] / shape[0] / r)) == pytest.approx(best, abs=1e-12)


def test_default_grid_is_480p_like_and_frames_are_1_plus_4k():
    grid = BucketGrid()
    assert (78, 78) in grid.shapes  # 1:1 at 624 x 624 pixels
    assert grid.shapes == ((58, 104), (66, 88), (78, 78), (88, 66), (104, 58))
    assert grid.latent_frames == tuple(range(1, 34))  # raw 1, 5, ..., 129
    assert grid.tokens_per_frame(grid.shapes.index((78, 78))) == 39 * 39


def _kept_share(height, width, shape):
    """First principles: cropping a w/h = r frame to aspect q keeps min(r/q, q/r) of it."""
    r, q = width / height, shape[1] / shape[0]
    return min(r / q, q / r)


def test_bucket_of_keeps_the_most_of_the_frame():
    grid = BucketGrid()
    rng = random.Random(0)
    for _ in range(300):
        H, W = rng.randint(16, 2160), rng.randint(16, 3840)
        b = grid.bucket_of(H, W)
        shares = [_kept_share(H, W, s) for s in grid.shapes]
        assert shares[b] == pytest.approx(max(shares), abs=1e-12)
        assert b == min(i for i, s in enumerate(shares) if s >= max(shares) - 1e-12)
        p = grid.plan(f"c{_}", 9, H, W)
        assert p.bucket == b
        # pixel rounding: worst relative difference 1.05e-3 over these 300 frames (measured)
        assert p.kept_fraction == pytest.approx(shares[b], rel=1e-2)


def test_resize_crop_keeps_aspect_covers_and_centres():
    rng = random.Random(1)
    for _ in range(300):
        H, W, th, tw = (rng.randint(8, 2000) for _ in range(4))
        nh, nw, top, left = resize_crop(H, W, th, tw)
        assert nh >= th and nw >= tw
        s = max(th / H, tw / W)  # the scale that just covers the target
        assert min(nh - th, nw - tw) == 0
        assert abs(nh - H * s) <= 0.5 + 1e-9 and abs(nw - W * s) <= 0.5 + 1e-9
        assert top == (nh - th) // 2 and left == (nw - tw) // 2


def test_frame_count_is_the_largest_allowed_that_fits():
    cfg = BucketConfig(max_frames=65, frame_counts=[1, 17, 33, 65], tokens_per_microbatch=20000)
    grid = BucketGrid(cfg)
    for T in [1, 4, 16, 17, 20, 33, 64, 65, 500]:
        for H, W in [(480, 832), (720, 720), (1920, 1080)]:
            p = grid.plan("k", T, H, W)
            tpf = grid.tokens_per_frame(p.bucket)
            allowed = [n for n in cfg.frame_counts if n <= T and (1 + (n - 1) // 4) * tpf <= 20000]
            assert p.num_frames == max(allowed)
            F, h, w = p.latent
            assert p.num_frames == 1 + 4 * (F - 1)
            assert p.tokens == F * (h // 2) * (w // 2) <= 20000
            assert p.frame_offset == (T - p.num_frames) // 2  # centred in time
            assert p.source_frames()[-1] < T and p.is_image == (p.num_frames == 1)


def test_resampling_to_a_target_fps():
    grid = BucketGrid(BucketConfig(fps=15.0))
    p = grid.plan("k", 61, 480, 832, fps=30.0)  # 4 s at 30 fps -> 31 frames at 15 fps
    assert p.frame_step == 2.0 and p.num_frames == 29 and p.frame_offset == 1
    assert p.source_frames() == list(range(2, 60, 2))
    up = grid.plan("u", 21, 480, 832, fps=10.0)  # 2 s at 10 fps -> 31 frames, frames repeat
    assert up.num_frames == 29 and max(up.source_frames()) <= 20
    assert grid.plan("img", 1, 480, 832, fps=0.0).num_frames == 1  # images ignore fps


def test_images_are_one_frame_clips_and_placement_clips():
    grid = BucketGrid()
    p = grid.plan(7, 1, 1080, 1080)
    assert p.latent == (1, 78, 78) and p.tokens == 39 * 39 and p.is_image and p.key == "7"
    v = grid.plan("v", 33, 480, 832)
    assert v.placement_clip() == Clip(v.tokens)
    assert v.placement_clip("block_causal", 3) == Clip(
        v.tokens, "block_causal", 3 * v.tokens_per_frame
    )
    assert v.placement_clip("teacher_forcing", 1).tokens == 2 * v.tokens


def test_plan_many_reads_prepare_records():
    recs = [
        {"key": "000000000", "num_frames": 81, "fps": 16.0, "width": 832, "height": 480},
        {"num_frames": 1, "fps": 0.0, "width": 600, "height": 800},
    ]
    plans = BucketGrid().plan_many(recs)
    assert [p.key for p in plans] == ["000000000", "1"]
    with pytest.raises(ValueError, match=r"clip 0: record lacks \['height'\]"):
        BucketGrid().plan_many([{"num_frames": 5, "width": 8}])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(frames=0), r"clip 'bad': frames \(0\) must be an integer >= 1"),
        (dict(height=-4), r"clip 'bad': height \(-4\) must be an integer >= 1"),
        (dict(width=0), r"clip 'bad': width \(0\) must be an integer >= 1"),
        (dict(shape=(30, 50)), r"clip 'bad': shape \(\(30, 50\)\) must be one of the grid"),
    ],
)
def test_bad_clips_name_the_clip_and_rule(kwargs, match):
    args = dict(key="bad", frames=9, height=480, width=832) | kwargs
    with pytest.raises(ValueError, match=match):
        BucketGrid().plan(**args)


def test_too_long_too_short_and_missing_fps():
    strict = BucketGrid(BucketConfig(truncate=False))
    assert strict.plan("ok", 129, 480, 832).num_frames == 129
    with pytest.raises(
        ValueError, match=r"clip 'long': 33 latent frames must be at most.*\(26 latent frames"
    ):
        BucketGrid(BucketConfig(truncate=False, max_clip_tokens=40000)).plan("long", 129, 480, 832)
    with pytest.raises(ValueError, match=r"clip 'long': 34 latent frames.*truncate is false"):
        strict.plan("long", 133, 480, 832)
    pt2 = BucketGrid(BucketConfig(patch_size=[2, 2, 2]))
    with pytest.raises(ValueError, match=r"clip 'img': 1 latent frame\(s\) must reach.*2 latent"):
        pt2.plan("img", 1, 480, 832)
    with pytest.raises(ValueError, match=r"clip 'v': fps \(None\) must be a number > 0"):
        BucketGrid(BucketConfig(fps=16.0)).plan("v", 33, 480, 832)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(area=0), r"data\.buckets\.area \(0\) must be an integer >= 1"),
        (dict(aspect_ratios=["16x9"]), r"aspect_ratios\[0\] \('16x9'\) must be 'W:H'"),
        (dict(aspect_ratios=[]), r"aspect_ratios \(\[\]\) must be a non-empty list"),
        (dict(max_frames=30), r"max_frames \(30\) must be 1 \+ 4k raw frames"),
        (dict(frame_counts=[17, 133]), r"frame_counts\[1\] \(133\) must be <= .*max_frames"),
        (dict(fps=-1), r"fps \(-1\) must be a number > 0 or null"),
        (dict(frame_counts=17), r"frame_counts \(17\) must be a non-empty list or null"),
        (dict(max_clip_tokens=10**6), r"max_clip_tokens \(1000000\) must be <= .*tokens_per_mi"),
        (dict(patch_size=[1, 2]), r"patch_size \(\[1, 2\]\) must be 3 integers"),
        (dict(truncate="yes"), r"truncate \('yes'\) must be true or false"),
        (dict(colour=1), r"data\.buckets: unknown field\(s\) \['colour'\]"),
    ],
)
def test_config_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BucketConfig.from_dict(kwargs, prefix="data.buckets.")


def test_grid_refuses_a_budget_below_one_clip_of_the_biggest_bucket():
    with pytest.raises(ValueError, match=r"tokens_per_microbatch \(1000\) must hold the shortest"):
        BucketGrid(BucketConfig(tokens_per_microbatch=1000))
    with pytest.raises(ValueError, match=r"area \(3\) is too small"):
        BucketGrid(BucketConfig(area=3))


# -- where users reach it: data.buckets and `megatron-video buckets` ------------------------------
def test_config_data_buckets_builds_the_grid_at_the_model_patch():
    from megatron_video.training.config import bucket_grid, load_config, validate

    c = load_config(None, ["data.buckets.area=900", "model.patch_size=[1,2,2]"])
    c.data.validate()
    grid = bucket_grid(c)
    assert grid.patch == (1, 2, 2) and all(h * w <= 900 for h, w in grid.shapes)
    with pytest.raises(
        ValueError, match=r"data\.source \('synthetic'\) must be 'shards' or 'energon'"
    ):
        validate(
            c, 1
        )  # mixed shapes read clips by key (test_train_mixed.py, test_train_raw_mixed.py)
    bad = {
        "data.buckets.patch_size=[1,1,1]": r"data\.buckets\.patch_size \(\[1, 1, 1\]\) is not a",
        "data.buckets.max_frames=8": r"data\.buckets\.max_frames \(8\) must be 1 \+ 4k",
        "data.buckets=3": r"data\.buckets \(3\) must be a mapping",
    }
    for override, match in bad.items():
        with pytest.raises(ValueError, match=match):
            load_config(None, [override]).data.validate()
    with pytest.raises(ValueError, match=r"data\.buckets: tokens_per_microbatch \(10\) must hold"):
        bucket_grid(load_config(None, ["data.buckets.tokens_per_microbatch=10"]))


def test_buckets_command_maps_a_prepared_dataset(tmp_path, capsys):
    from megatron_video.training.cli import main

    videos = [
        {"key": "000000000", "num_frames": 81, "fps": 16.0, "width": 832, "height": 480},
        {"key": "000000001", "num_frames": 1, "fps": 0.0, "width": 512, "height": 512},
        {"key": "000000002", "num_frames": 0, "fps": 16.0, "width": 480, "height": 832},
    ]
    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / "megatron_video.json").write_text(json.dumps({"videos": videos}))
    out = tmp_path / "plans.json"
    demo = Path(__file__).resolve().parents[1] / "examples" / "configs" / "demo.yaml"
    args = ["buckets", "--config", str(demo), "--out", str(out)]
    rc = main(args + [f"data.path={tmp_path}", "model.patch_size=[1,2,2]"])
    text = capsys.readouterr().out
    assert rc == 0 and "bucket 0 464x832 px (latent 58x104): 1 clips (0 images)" in text
    assert "left out 000000002: clip '000000002': frames (0) must be an integer >= 1" in text
    blob = json.loads(out.read_text())
    assert [c["key"] for c in blob["clips"]] == ["000000000", "000000001"]
    assert blob["clips"][0]["latent"] == [21, 58, 104] and blob["buckets"][2]["images"] == 1


def test_precompute_encodes_each_clip_at_its_bucket(tmp_path):
    """`precompute` with data.buckets: each clip's latents equal the VAE's full encoding of its
    planned frames (SP-folded windows, ragged where F is not a multiple); meta names the bucket."""
    import torch

    from megatron_video.data.energon_video import (
        KeyedClips,
        dataset_records,
        prepare_dataset,
        write_procedural_videos,
    )
    from megatron_video.data.shards import ShardReader
    from megatron_video.models.vae import CausalVideoVAE
    from megatron_video.training.config import bucket_grid, load_config
    from megatron_video.training.precompute import precompute_latents

    src = tmp_path / "src"
    write_procedural_videos(src / "land", 2, num_frames=17, height=32, width=48)
    write_procedural_videos(src / "port", 1, num_frames=13, height=48, width=32, seed=1)
    write_procedural_videos(src / "img", 1, num_frames=1, height=40, width=40, seed=2)
    prepare_dataset(src, tmp_path / "ds")
    torch.manual_seed(0)
    vae = CausalVideoVAE(3, 4, 8).eval()
    key = {"latent_channels": 4, "base_channels": 8}
    torch.save({"state_dict": vae.state_dict(), "latent_scale": 0.5, "key": key}, tmp_path / "v.pt")
    cfg = load_config(
        None,
        [f"data.path={tmp_path / 'ds'}", f"vae.weights={tmp_path / 'v.pt'}"]
        + ["vae.base_channels=8", "vae.latent_channels=4", "data.buckets.area=24"]
        + ["data.buckets.aspect_ratios=['3:2','2:3']", "data.buckets.max_frames=17"],
    )
    r = precompute_latents(cfg, tmp_path / "lat", sp_size=3)
    assert r["samples"] == 4 and r["skipped"] == 0
    plans = {p.key: p for p in bucket_grid(cfg).plan_many(dataset_records(tmp_path / "ds"))}
    clips = KeyedClips(tmp_path / "ds")
    got = {s["key"]: s for s in ShardReader(str(tmp_path / "lat"))}
    assert sorted(got) == sorted(plans)
    for k, s in got.items():
        with torch.no_grad():
            ref = vae.encode(clips.read(plans[k])[None])[0]
        assert s["latent"].shape == (4, *plans[k].latent) == ref.shape
        assert torch.allclose(s["latent"], ref, atol=1e-5, rtol=0)
        assert s["meta"]["bucket"] == plans[k].bucket and s["meta"]["tokens"] == plans[k].tokens
    assert sorted(tuple(p.latent) for p in plans.values()) == [
        (1, 4, 6), (4, 6, 4), (5, 4, 6), (5, 4, 6)
    ]  # fmt: skip
