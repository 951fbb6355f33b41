"""Training on mixed shapes straight from raw videos (``data.buckets`` with ``data.source:
energon``; training/clip_source.py ``RawClipSource``): no precompute step.

* Oracle (float64 VAE): for a prepared dataset of videos of different lengths and sizes and a PNG
  image, the latents each CP rank of U2xR2 encodes for its local tokens (only its halo windows'
  raw frames decoded) equal the VAE's full encoding of the clip at its bucket, for a micro-batch
  whose clip is split over the ring and one whose clips lie whole on ring ranks; frames a rank
  does not read stay zero, and its packed inputs equal those built from the full encodings (no
  local token reads a zero frame). Both kinds: ``full`` (T2V) and ``teacher_forcing`` (clean and
  noisy copy of a frame from the same latents). Negative control: halo 0 differs (and the
  encoder guard refuses it).
* The CLI as a user runs it: ``megatron-video train --cpu --nproc 4`` on the raw dataset, 3 steps
  with a checkpoint after each, then resumed from the first: the next two losses bitwise.
* The raw path equals the shards path: the same clip set, grids, token counts, costs and step
  draws as ``precompute`` with ``data.buckets``; one trainer step at CP 4 gives the same loss.
* Bad input: ``data.source: synthetic`` with ``data.buckets``; a truncated or undecodable clip
  raises ``ValueError`` naming the clip, on every rank of the trainer (before the model's
  collectives).
"""

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from megatron_video.testing.raw_mixed import (
    tiny_raw_mixed_config,
    write_raw_mixed_dataset,
    write_tiny_vae,
)

ROOT = Path(__file__).resolve().parents[1]
CP4 = dict(context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from megatron_video.training.precompute import precompute_latents

    root = tmp_path_factory.mktemp("raw_mixed")
    ds = write_raw_mixed_dataset(root)
    vae = write_tiny_vae(root / "vae.pt")
    out = dict(root=root, ds=ds, vae=vae, shards=root / "shards")
    r = precompute_latents(_config("video_dit", out), out["shards"], sp_size=1)
    assert r["skipped"] == 0 and r["samples"] == 6
    return out


def _config(family, data, budget=None, source="energon", **parallel):
    budget = budget or (80 if family == "ar_dit" else 48)
    cfg = tiny_raw_mixed_config(family, data["root"], data["ds"], data["vae"], budget, **parallel)
    if source == "shards":
        cfg.data.source, cfg.data.shards, cfg.data.path = "shards", str(data["shards"]), None
    return cfg


def _maker(cfg, source, cp_rank=0, U=2, R=2, dp_size=1):
    from megatron_video.testing.mixed import packed_maker

    return packed_maker(
        cfg, latent_scale=0.5, cp_rank=cp_rank, U=U, R=R, dp_size=dp_size, source=source
    )


# ---------------------------------------------------------------------------------------------
# oracle: each CP rank's latents == the full encoding of the clip at its bucket (float64)
# ---------------------------------------------------------------------------------------------
def _full_encodings(raw, vae):
    with torch.no_grad():
        return {
            k: vae.encoder(raw.clips.read(raw.plans[k])[None].double())[0, : raw.z] for k in raw.ids
        }


def _check_rank(raw, ref, cfg, family, keys, full, r):
    """CP rank ``r``'s micro-batch of ``keys``: returns (max |diff| of its latents, decoded raw
    frames, whether a clip lies whole on a ring rank, whether one is split)."""
    m, mr = _maker(cfg, raw, r), _maker(cfg, ref, r)
    n0 = len(raw.reads)
    mb, mb_ref = m.micro_batch(0, keys, 1), mr.micro_batch(0, keys, 1)
    assert torch.allclose(mb.x, mb_ref.x, atol=1e-6, rtol=0)  # no local token reads a zero
    assert torch.equal(mb.noise, mb_ref.noise) and torch.equal(mb.t, mb_ref.t)
    decoded = sum(w.num_raw for _, w in raw.reads[n0:])
    ranges, worst = m.clip_ranges(mb.packed, mb.local), 0.0
    clip, frame = mb.packed.clip_of(mb.local), mb.packed.token_thw(mb.local)[:, 0]
    for c, k in enumerate(keys):
        pt = cfg.model.patch_size[0]  # a patched frame reads pt latent frames
        read = {pt * t + i for t in frame[clip == c].tolist() for i in range(pt)}
        kept = {f for a, b in ranges[c] for f in range(a, b)}
        assert read == kept, (k, read, kept)
        lat = raw.latents(k, ranges[c])
        assert lat.dtype == torch.float64
        # ranges closer than the halo share one window (its gap frames are encoded too)
        encoded = {f for w in raw.windows(k, ranges[c]) for f in range(*w.kept)}
        assert kept <= encoded
        for a, b in ranges[c]:
            worst = max(worst, float((lat[:, a:b] - full[k][:, a:b]).abs().max()))
        others = [f for f in range(lat.shape[1]) if f not in encoded]
        assert all(float(lat[:, f].abs().max()) == 0 for f in others)
    ring_of = mb.plan.ring_of
    whole = any(x is not None for x in ring_of[: len(keys)])
    split = any(x is None for x in ring_of[: len(keys)])
    return worst, decoded, whole, split


def test_temporal_patch_2_reads_both_latent_frames_of_a_token(data):
    """``model.patch_size [2, 1, 1]``: a token reads latent frames ``2t, 2t + 1``; the grid leaves
    the image out (1 latent frame), as ``precompute`` would; each rank's latents of its tokens
    equal the full encoding."""
    from megatron_video.training.batches.clips import RawClipSource, ShardClipSource
    from megatron_video.training.vae_stage import load_vae

    cfg = _config("video_dit", data, **CP4)
    cfg.model.patch_size = [2, 1, 1]
    vae = load_vae(data["vae"], cfg)[0].double()
    raw = RawClipSource(cfg, vae.encoder)
    assert [k for k, _ in raw.left_out] == ["000000000"]  # the PNG image
    full = _full_encodings(raw, vae)
    ref = ShardClipSource({k: dict(latent=full[k], caption=raw.caption(k)) for k in raw.ids})
    keys = [k for k in raw.ids if raw.latent_grid(k)[0] == 4][:2]
    worst = max(_check_rank(raw, ref, cfg, "video_dit", keys, full, r)[0] for r in range(4))
    assert worst < 1e-12, worst


@pytest.mark.parametrize("family", ["video_dit", "ar_dit"])
def test_each_cp_rank_encodes_exactly_its_latents(data, family):
    from megatron_video.layouts.vae_halo import halo_window
    from megatron_video.training.batches.clips import RawClipSource, ShardClipSource
    from megatron_video.training.vae_stage import load_vae

    cfg = _config(family, data, **CP4)
    vae, _ = load_vae(data["vae"], cfg)
    vae = vae.double()
    raw = RawClipSource(cfg, vae.encoder)
    assert raw.halo == 2  # the tiny causal VAE's temporal receptive field
    full = _full_encodings(raw, vae)
    ref = ShardClipSource({k: dict(latent=full[k], caption=raw.caption(k)) for k in raw.ids})
    grids = {k: raw.latent_grid(k) for k in raw.ids}
    assert sorted(grids.values()) == [
        (1, 2, 3),
        (2, 3, 3),
        (3, 2, 3),
        (4, 3, 2),
        (4, 3, 3),
        (4, 3, 3),
    ]
    long = next(k for k in raw.ids if grids[k] == (4, 3, 3))
    small = [k for k in raw.ids if grids[k][0] < 4]  # the image (1 frame) and two short videos
    worst, seen, decoded = 0.0, set(), {}
    for name, keys in (("split", [long]), ("small", small)):
        for r in range(4):
            w, n, whole, split = _check_rank(raw, ref, cfg, family, keys, full, r)
            worst = max(worst, w)
            seen |= {"whole"} if whole else set()
            seen |= {"split"} if split else set()
            decoded[(name, r)] = n
    assert seen == {"whole", "split"}
    assert worst < 1e-12, worst
    # the ranks holding the long clip's first latents decode only their windows' raw frames (of
    # 13); with a 2-latent halo the ranks holding latents 2..3 need frames from 0 on
    assert min(decoded[("split", r)] for r in range(4)) < 13, decoded
    # negative control: latents [2, 4) of the long clip without a halo differ ...
    plan, win = raw.plans[long], halo_window(2, 4, 0)
    with torch.no_grad():
        bare = vae.encoder(raw.clips.read(plan, win)[None].double())[0, : raw.z]
    bare = bare[:, win.drop : win.drop + 2]
    control = float((bare - full[long][:, 2:4]).abs().max())
    assert control > 1e-3, control
    # ... and a user's halo 0 (vae.halo_latents: the user's choice, as LongLive's) is honoured,
    # its measured error printed once (training.vae_halo.choose_halo)
    low = RawClipSource(cfg, vae.encoder, halo_latents=0)
    assert low.halo == 0
    assert torch.equal(low.latents(long, [(2, 4)])[:, 2:4], bare)
    print(
        f"{family}: max |raw - full| {worst:.1e} (halo 0: {control:.1e}); decoded raw frames "
        f"per rank {decoded}"
    )


# ---------------------------------------------------------------------------------------------
# the raw path is the shards path: clip set, grids, costs, draws; one trainer step's loss
# ---------------------------------------------------------------------------------------------
def test_raw_and_shards_draw_the_same_steps(data):
    from megatron_video.training.batches.clips import (
        RawClipSource,
        ShardClipSource,
        load_clip_store,
    )
    from megatron_video.training.vae_stage import load_vae

    cfg = _config("video_dit", data)
    cfg.train.global_batch_size = 2
    raw = RawClipSource(cfg, load_vae(data["vae"], cfg)[0].encoder)
    shards = ShardClipSource(load_clip_store(_config("video_dit", data, source="shards")))
    a, b = _maker(cfg, raw, U=1, R=1), _maker(cfg, shards, U=1, R=1)
    assert a.ids == b.ids and a.costs == b.costs
    assert [a.clips[k] for k in a.ids] == [b.clips[k] for k in b.ids]
    for step in range(3):
        ma, mb = list(a.step_batches(step)), list(b.step_batches(step))
        assert [m.clip_ids for m in ma] == [m.clip_ids for m in mb]
        for x, y in zip(ma, mb):  # CP 1: every frame read; the same latents to float32 rounding
            assert torch.allclose(x.x, y.x, atol=1e-5, rtol=0)
    assert a.data_state() == b.data_state()


def _trainer_step(cfg):
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    trainer = Trainer(cfg, progress=False, cpu=True)
    try:
        return trainer.forward_backward(0)
    finally:
        trainer.close()


def test_one_step_loss_equals_the_shards_path(pool4, data):
    """One step at DP 1 x CP 4 (U2xR2, 2 micro-batches), float32: from the raw dataset (each CP
    rank encodes its halo windows) and from ``precompute``'s shards (whole clips encoded)."""
    losses = {}
    for source in ("energon", "shards"):
        cfg = _config("video_dit", data, source=source, **CP4)
        cfg.train.global_batch_size = 2
        losses[source] = pool4.run(_trainer_step, cfg, ranks_per_node=2)
    assert len(set(losses["energon"])) == 1 and len(set(losses["shards"])) == 1
    d = abs(losses["energon"][0] - losses["shards"][0])
    # float32: each rank's halo-window latents differ from the whole clip's encoding by at most
    # ~1 ulp (3e-8 at |latent| <= 0.2, measured); the loss came out bit-equal (|d| = 0)
    assert d < 1e-6 * abs(losses["shards"][0]), losses
    print(
        f"one-step loss raw {losses['energon'][0]:.8f} shards {losses['shards'][0]:.8f} |d| {d:.1e}"
    )


# ---------------------------------------------------------------------------------------------
# the CLI: train, save, resume
# ---------------------------------------------------------------------------------------------
def _cli(config_file, out, steps):
    cmd = [sys.executable, "-m", "megatron_video.training.cli", "train", "--cpu", "--config"]
    cmd += [str(config_file), "--nproc", "4", "--ranks-per-node", "2", "--output", str(out)]
    cmd += [f"train.steps={steps}", "train.progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _resume_in_process(config_file, out, steps):
    """What a second ``megatron-video train`` of the same config does, in the pool's ranks; the
    step indices it trained (a restart from scratch would train them all)."""
    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    over = [f"output={out}", f"train.steps={steps}", "train.save_interval=0"]  # save at the end
    t = Trainer(load_config(config_file, over), progress=False)
    ran, step_fn = [], t.train_step
    t.train_step = lambda step: (ran.append(step), step_fn(step))[1]
    try:
        t.run()
    finally:
        t.close()
    return ran


@pytest.mark.process_launch
def test_cli_trains_from_raw_clips_and_resumes(pool4, data, tmp_path):
    """The command line trains 3 steps from raw clips (a checkpoint after each); pointed back at
    the checkpoint of step 1, a run of the same config resumes there, replays the ledger and
    trains steps 2 and 3 to the uninterrupted run's losses, bitwise (the second one depends on
    the restored Adam moments); in the pool's ranks: one launch is what the CLI adds."""
    import yaml

    from megatron_video.training import checkpoint as ckpt
    from megatron_video.training.config import config_to_dict

    cfg = _config("video_dit", data, **CP4)
    cfg.train.global_batch_size = 2
    cfg.train.save = cfg.train.resume = True
    cfg.train.save_interval = 1
    cfg.train.progress = False
    config_file, out = tmp_path / "raw.yaml", tmp_path / "run"
    config_file.write_text(yaml.safe_dump(config_to_dict(cfg)))
    t0 = time.time()
    console = _cli(config_file, out, 3)
    assert "raw energon clips (each CP rank decodes and encodes its own halo windows)" in console
    assert "6 clips (1 images)" in console and "[megatron-video] step 0:" in console
    first = json.loads((out / "metrics.json").read_text())["history"]
    assert ckpt.latest_step(out / "checkpoints") == 3 and len(first) == 3
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")  # resume at 1
    ran = pool4.run(_resume_in_process, str(config_file), str(out), 3, ranks_per_node=2)
    assert ran == [[1, 2]] * 4, ran  # resumed: step 0 was not trained again
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert ckpt.latest_step(out / "checkpoints") == 3 and [h["step"] for h in history] == [0, 1, 2]
    assert [h["loss"] for h in history] == [h["loss"] for h in first]  # steps 1, 2: resumed
    assert all(torch.isfinite(torch.tensor([h["loss"] for h in history])))

    def steps_in_ledger(step):
        ledger = json.loads(ckpt.read_data_state(out / "checkpoints", step, "ledger"))
        return ledger["steps_before"] + len(ledger["steps"])

    assert (steps_in_ledger(1), steps_in_ledger(3)) == (1, 3)  # the resumed run extended it
    ledger = ckpt.read_data_state(out / "checkpoints", 3, "ledger")
    print(f"CLI 3 steps + 2 resumed in {time.time() - t0:.0f} s; ledger {ledger}")


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def test_raw_source_without_a_vae_is_refused():
    from megatron_video.training.batches.clips import clip_source
    from megatron_video.training.config import load_config

    cfg = load_config(str(ROOT / "examples/configs/mixed_tiny.yaml"))
    cfg.data.source, cfg.data.path = "energon", "/nonexistent"  # refused before it is read
    with pytest.raises(ValueError, match=r"vae \(None\) must be the trainer's causal VAE"):
        clip_source(cfg, None)


def test_synthetic_source_with_buckets_is_refused(data):
    from megatron_video.training.config import validate

    cfg = _config("video_dit", data)
    cfg.data.source = "synthetic"
    with pytest.raises(
        ValueError,
        match=r"data.source \('synthetic'\) must be 'shards' or 'energon' with data.buckets: .*"
        r"the procedural source has one fixed shape",
    ):
        validate(cfg, 1)


def _corrupt(data, tmp_path, how):
    """A copy of the dataset with clip 000000001 truncated (its record claims 17 frames, the file
    holds 13) or undecodable (its mp4 bytes zeroed inside the tar)."""
    import shutil

    ds = tmp_path / "ds"
    shutil.copytree(data["ds"], ds)
    meta = ds / ".nv-meta" / "megatron_video.json"
    summary = json.loads(meta.read_text())
    if how == "truncated":
        summary["videos"][1]["num_frames"] = 17
        meta.write_text(json.dumps(summary))
        return ds
    tar = ds / summary["shards"][0]
    with tarfile.open(tar) as t:
        m = t.getmember("000000001.mp4")
        start, size = m.offset_data, m.size
    with open(tar, "r+b") as f:
        f.seek(start)
        f.write(bytes(size))
    return ds


@pytest.mark.parametrize("how", ["truncated", "zeroed"])
def test_corrupt_clip_names_the_key(data, tmp_path, how):
    from megatron_video.training.batches.clips import RawClipSource
    from megatron_video.training.vae_stage import load_vae

    cfg = _config("video_dit", data)
    cfg.data.path = str(_corrupt(data, tmp_path, how))
    raw = RawClipSource(cfg, load_vae(data["vae"], cfg)[0].encoder)
    with pytest.raises(ValueError, match=r"clip '000000001' of data.path .* cannot be decoded.*"
                       r"rule: every clip of a data.buckets energon dataset must decode"):  # fmt: skip
        raw.latents("000000001", [(0, 4)])


def _trainer_failure(cfg):
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    trainer = Trainer(cfg, progress=False, cpu=True)
    try:
        trainer.forward_backward(0)
    except ValueError as e:
        return str(e)
    finally:
        trainer.close()
    return None


def test_corrupt_clip_fails_every_rank_before_the_step(pool4, data, tmp_path):
    """DP 4: only the DP rank drawing the clip decodes it; every rank raises (no hang)."""
    cfg = _config("video_dit", data)
    cfg.data.path = str(_corrupt(data, tmp_path, "truncated"))
    cfg.train.global_batch_size = 8  # 2 micro-batches x DP 4: all 6 clips in step 0
    errors = pool4.run(_trainer_failure, cfg)
    assert all(e is not None for e in errors), errors
    assert sum("clip '000000001'" in e for e in errors) == 1
    assert sum("failed to load on 1 other rank" in e for e in errors) == 3, errors
