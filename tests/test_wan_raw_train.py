"""Wan (``wan`` / ``wan_ar``) trained from raw video (``data.source: energon``,
training/families/wan_raw.py): each CP rank decodes and encodes only its own halo windows with the
diffusers ``AutoencoderKLWan`` of ``vae.diffusers``; captions go through ``data.text_encoder``.

* Oracle (float64): the latents every rank trains on at U2xR2 (contiguous frames for ``wan``,
  Balanced SP's two copies for ``wan_ar``) equal diffusers' own full-clip encoding, sliced to the
  rank's frames, for tiny Wan 2.1 and Wan 2.2 VAEs; a halo-0 control differs.
* One step of the trainer at U2xR2 from raw clips equals the same step from shards that
  ``precompute`` wrote from the same clips (the independent check of encoding in the partition),
  with and without ``data.buckets``; train, save and resume from raw clips. At 81 frames (21
  latent frames, placed by token at U2xR2): each rank decodes only its window plus the halo, and
  the float64 step (loss, every gradient) equals the step from shards of the same clip.
* Wrong inputs: ``ValueError`` naming the field, its value and the rule.
"""

import functools
import json
import math

import pytest
import torch

pytest.importorskip("diffusers")

from megatron_video.testing.wan import (  # noqa: E402
    TEXT_DIM,
    TEXT_LEN,
    save_tiny_umt5,
    save_tiny_wan_transformer,
    save_tiny_wan_vae,
    tiny_wan_config,
)

CP4 = dict(context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2)
# (name, count, raw frames, height, width): 125 x 16 x 16 -> 32 x 2 x 2 latents (Wan 2.1's 8x;
# 32 x 1 x 1 at Wan 2.2's 16x): long enough that later ranks' windows start after frame 0 (the
# tiny Wan 2.1 VAE's exact halo is 19 latents)
CLIPS = (("a", 2, 125, 16, 16),)
MIXED = (("long", 2, 13, 32, 48), ("tall", 2, 9, 48, 32), ("square", 2, 5, 32, 32))


def _videos(src, clips):
    from megatron_video.data.energon_video import write_procedural_videos

    for seed, (name, n, frames, h, w) in enumerate(clips):
        write_procedural_videos(src / name, n, num_frames=frames, height=h, width=w, seed=seed)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Raw clips (one shape, and mixed shapes), tiny Wan 2.1 / 2.2 VAEs, a tiny UMT5 trained on
    the captions, a tiny Wan transformer to start from."""
    from megatron_video.data.energon_video import prepare_dataset

    root = tmp_path_factory.mktemp("wan_raw")
    _videos(root / "src", CLIPS)
    _videos(root / "msrc", MIXED)
    prepare_dataset(root / "src", root / "ds")
    prepare_dataset(root / "msrc", root / "mds")
    captions = [p.read_text() for p in sorted(root.glob("*src/*/*.txt"))]
    save_tiny_umt5(root / "umt5", captions)
    save_tiny_wan_vae(root / "vae21")
    save_tiny_wan_vae(root / "vae22", z_dim=48, wan22=True)
    save_tiny_wan_transformer(root / "transformer", _config(root, "wan"))
    return root


def _config(root, family, vae="vae21", source="energon", buckets=False, **parallel):
    """``testing.wan.tiny_wan_config`` on the 125-frame clips (or, with ``buckets``, the mixed
    clips on ``testing.mixed``'s Wan grid) read raw, or from ``root / shards``."""
    from megatron_video.testing.mixed import WAN_MIXED_GRID

    cfg = tiny_wan_config(family, root, root / ("mshards" if buckets else "shards"), **parallel)
    d = cfg.data
    d.num_frames, d.height, d.width = (13, 32, 48) if buckets else (125, 16, 16)
    if buckets:
        d.buckets = dict(WAN_MIXED_GRID, tokens_per_microbatch=64)
        cfg.train.micro_batch_size = 1
    if source == "energon":
        d.source, d.shards = "energon", None
        d.path, d.text_encoder = str(root / ("mds" if buckets else "ds")), str(root / "umt5")
    cfg.vae.diffusers = str(root / vae)
    cfg.vae.latent_channels = 48 if vae == "vae22" else 4
    cfg.model.init_from = str(root / "transformer") if vae == "vae21" else None
    return cfg


def _decode(path) -> torch.Tensor:
    """The video's frames (PyAV) in [-1, 1] as the reader rounds them (float32), then float64."""
    import av

    with av.open(str(path)) as c:
        x = torch.stack([torch.from_numpy(f.to_ndarray(format="rgb24")) for f in c.decode(video=0)])
    return (x.float() / 127.5 - 1).double().permute(3, 0, 1, 2)


@functools.lru_cache(maxsize=2)  # one per VAE, shared by both families' tests
def _oracle(root, vae_name) -> dict:
    """key -> diffusers' own float64 full-clip encoding, normalised as Wan's pipelines do."""
    from diffusers import AutoencoderKLWan

    from megatron_video.data.energon_video import dataset_records

    vae = AutoencoderKLWan.from_pretrained(str(root / vae_name)).double().eval()
    c = vae.config
    mean = torch.tensor(c.latents_mean, dtype=torch.float64).view(1, -1, 1, 1, 1)
    std = torch.tensor(c.latents_std, dtype=torch.float64).view(1, -1, 1, 1, 1)
    out = {}
    for r in dataset_records(root / "ds"):
        with torch.no_grad():
            mu = vae.encode(_decode(root / "src" / r["source"])[None]).latent_dist.mean
        out[r["key"]] = ((mu - mean) / std)[0]
    return out


@pytest.mark.parametrize("vae", ["vae21", "vae22"])
@pytest.mark.parametrize("family", ["wan", "wan_ar"])
def test_rank_latents_equal_full_clip_encoding(root, family, vae):
    """Float64, U2xR2: each rank's latents from raw frames (its halo windows only, the exact
    halo) equal the full-clip encoding at its frames (<= 1e-10 relative) and are zero elsewhere;
    the micro-batch it trains on is their patchified float32 copy; halo 0 differs."""
    from megatron_video.models.embedders import patchify
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.batches.fixed import FixedBatchMaker
    from megatron_video.training.families import get_family

    cfg = _config(root, family, vae)
    cfg.model.patch_size = [1, 1, 1]  # (Wan 2.2's 1 x 1 latent)
    fam = get_family(family)
    enc = fam.raw_video_encoders(cfg)
    enc.encoder.vae.double()
    oracle = _oracle(root, vae)
    layout = fam.sample_layout(cfg, 4).layout
    worst, control = 0.0, 0.0
    for halo in ("auto", 0):
        cfg.vae.halo_latents = halo
        for r in range(4):
            coords = RankCoords(cp_rank=r, ulysses_size=2, ring_size=2)
            bm = FixedBatchMaker(cfg, coords, vae=enc, layout=layout)
            keys = bm.ids[:2]
            full = torch.stack([oracle[k] for k in keys])
            scale = float(full.abs().max())
            lat = bm._latents(keys)
            assert lat.dtype == torch.float64
            mine = bm.frames
            err = float((lat.index_select(2, mine) - full.index_select(2, mine)).abs().max())
            if halo == 0:
                control = max(control, err / scale)
                continue
            assert bm.source.halo > 0
            worst = max(worst, err / scale)
            others = sorted(set(range(full.shape[2])) - set(mine.tolist()))
            assert float(lat[:, :, others].abs().max()) == 0.0  # not encoded on this rank
            mb = bm.micro_batch(0, keys)
            ref = patchify(full.index_select(2, mine).float(), (1, 1, 1))
            assert torch.allclose(mb.clean, ref, atol=1e-5 * scale, rtol=0)
            assert mb.caption_ids.shape == (2, TEXT_LEN, TEXT_DIM)
            wins = [w for k in keys for w in bm.source.windows(k, [tuple(s) for s in bm.segments])]
            if r == 3:
                assert any(w.raw_start > 0 for w in wins)  # a later rank reads its own window
    assert worst <= 1e-10, worst
    assert control > 1e-6, control  # no halo: the encoding is not exact
    print(f"{family} {vae}: rel err exact halo {worst:.1e}, halo 0 {control:.1e}")


def test_captions_are_the_text_encoders(root):
    """The raw source's caption embeddings are the UMT5's, as ``precompute`` stores them."""
    from megatron_video.data.text import HFTextEncoder
    from megatron_video.training.batches.clips import clip_source
    from megatron_video.training.families import get_family

    cfg = _config(root, "wan")
    src = clip_source(cfg, get_family("wan").raw_video_encoders(cfg))
    text = HFTextEncoder.from_pretrained(str(root / "umt5"), TEXT_LEN)
    for k in src.ids:
        emb, mask = src.text(k)
        ref_emb, ref_mask = text([src.caption(k)])
        assert src.caption(k) and torch.equal(mask, ref_mask[0]) and torch.equal(emb, ref_emb[0])


# ---------------------------------------------------------------------------------------------
# the trainer: raw clips against precomputed shards of the same clips; resume
# ---------------------------------------------------------------------------------------------
def _precompute(root, buckets: bool) -> None:
    from megatron_video.data.text import HFTextEncoder
    from megatron_video.training.precompute import precompute_latents

    out = root / ("mshards" if buckets else "shards")
    if not out.exists():
        text = HFTextEncoder.from_pretrained(str(root / "umt5"), TEXT_LEN)
        cfg = _config(root, "wan", buckets=buckets)
        precompute_latents(cfg, out, text_encoder=text)


def _trainer_step(cfg) -> float:
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    trainer = Trainer(cfg, progress=False, cpu=True)
    try:
        return trainer.forward_backward(0)
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "family, buckets", [("wan", False), ("wan_ar", False), ("wan", True), ("wan_ar", True)]
)
def test_one_step_from_raw_equals_precomputed_shards(pool4, root, family, buckets):
    """One step at U2xR2: raw clips encoded per CP rank (halo windows) vs ``precompute``'s shards
    of the same clips (whole clips, SP 1); the same seed, float32."""
    from megatron_video.training.config import validate

    _precompute(root, buckets)
    losses = {}
    for source in ("energon", "shards"):
        cfg = _config(root, family, source=source, buckets=buckets, **CP4)
        validate(cfg, 4)
        losses[source] = pool4.run(_trainer_step, cfg, ranks_per_node=2)
    assert len(set(losses["energon"])) == 1 and len(set(losses["shards"])) == 1, losses
    raw, ref = losses["energon"][0], losses["shards"][0]
    assert math.isfinite(raw) and abs(raw - ref) <= 1e-5 * abs(ref), losses
    msg = (
        f"{family} buckets={buckets}: loss raw {raw:.8f} shards {ref:.8f} |d| {abs(raw - ref):.1e}"
    )
    if family == "wan" and not buckets:  # control: without the halo, the later ranks' latents
        # (and the loss) differ (per family and VAE: test_rank_latents_equal_full_clip_encoding)
        cfg = _config(root, family, **CP4)
        cfg.vae.halo_latents = 0
        bare = pool4.run(_trainer_step, cfg, ranks_per_node=2)[0]
        assert abs(bare - ref) > 1e-4 * abs(ref), (bare, ref)
        msg += f"; halo 0: {bare:.8f}"
    print(msg)


def _run(cfg, steps: int) -> list:
    """Train to ``steps`` (resuming); the steps this call trained."""
    import warnings

    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg.train.steps = steps
    t = Trainer(cfg, progress=False, cpu=True)
    trained, step_fn = [], t.train_step
    t.train_step = lambda step: trained.append(step) or step_fn(step)
    try:
        t.run()
        return trained
    finally:
        t.close()


def test_train_from_raw_clips_and_resume(pool4, root, tmp_path):
    """``wan``: 1 step from raw clips with a checkpoint, then resumed to step 3: it trains steps 1
    and 2 only, and every loss equals the uninterrupted 3-step run's (fp32, 1e-5; the third needs
    the restored Adam moments). One family: the raw-video reader's state and the trainer's resume
    are shared (``wan_ar``'s resume: tests/test_train_mixed.py, TI2V with buckets)."""
    from megatron_video.training import checkpoint as ckpt

    def history(name):
        return json.loads((tmp_path / name / "metrics.json").read_text())["history"]

    cfg = _config(root, "wan", **CP4)
    cfg.train.save = cfg.train.resume = True
    cfg.output = str(tmp_path / "run")
    assert pool4.run(_run, cfg, 1, ranks_per_node=2)[0] == [0]
    assert pool4.run(_run, cfg, 3, ranks_per_node=2)[0] == [1, 2]  # resumed, not retrained
    assert ckpt.latest_step(tmp_path / "run" / "checkpoints") == 3
    resumed = [h["loss"] for h in history("run")]
    assert len(resumed) == 3 and all(math.isfinite(x) and x > 0 for x in resumed)
    cfg.output = str(tmp_path / "whole")  # the uninterrupted run
    assert pool4.run(_run, cfg, 3, ranks_per_node=2)[0] == [0, 1, 2]
    whole = [h["loss"] for h in history("whole")]
    # 1e-5: the bound for a resume (the same layout repeats the same reductions)
    assert resumed == pytest.approx(whole, rel=1e-5), (resumed, whole)


# ---------------------------------------------------------------------------------------------
# wrong inputs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(diffusers=None), r"vae.diffusers \(None\) must name a local diffusers"),
        (dict(text_encoder=None), r"data.text_encoder \(None\) must name a .*UMT5 / T5 folder"),
        (dict(text_embed_dim=16), r"data.text_embed_dim \(16\) must equal the d_model \(32\)"),
        (dict(text_encoder="nowhere"), r"data.text_encoder \('nowhere'\) must be a local UMT5"),
        (dict(latent_channels=8), r"vae.latent_channels \(8\) must equal the VAE's latent"),
        (dict(source="synthetic"), r"data.source \('synthetic'\) must be 'shards' .* or 'energon'"),
    ],
)
def test_wrong_inputs_name_the_field(root, change, match):
    from megatron_video.training.config import validate

    cfg = _config(root, "wan", **CP4)
    for key, value in change.items():
        setattr(cfg.vae if key in ("diffusers", "latent_channels") else cfg.data, key, value)
    if change.get("source") == "synthetic":
        cfg.data.text_embed_dim = cfg.data.text_encoder = None
    if "latent_channels" in change:
        cfg.model.init_from = None
    with pytest.raises(ValueError, match=match):
        validate(cfg, 4)


def test_text_encoder_is_refused_where_unread(root):
    from megatron_video.training.config import validate

    cfg = _config(root, "wan", source="shards", **CP4)
    cfg.data.text_encoder = str(root / "umt5")
    with pytest.raises(ValueError, match=r"data.text_encoder \('.*umt5'\) is read with data"):
        validate(cfg, 4)
    cfg = _config(root, "video_dit", **CP4)
    cfg.model.init_from = None
    with pytest.raises(ValueError, match=r"data.text_encoder \('.*'\) is not a field of model"):
        validate(cfg, 4)


def test_yaml_paths_are_relative_to_the_file(tmp_path):
    """``data.text_encoder`` in a YAML file is relative to that file, as ``vae.diffusers``."""
    from megatron_video.training.config import load_config

    (tmp_path / "cfg").mkdir()
    path = tmp_path / "cfg" / "raw.yaml"
    path.write_text("data:\n  text_encoder: umt5\nvae:\n  diffusers: ../vae\n")
    cfg = load_config(str(path))
    assert cfg.data.text_encoder == str(tmp_path / "cfg" / "umt5")
    assert cfg.vae.diffusers == str(tmp_path / "vae")


@pytest.fixture(scope="module")
def ds81(root):
    """Two raw clips of Wan's own 81 frames (21 latent frames) at 16 x 16."""
    from megatron_video.data.energon_video import prepare_dataset

    _videos(root / "src81", (("w", 2, 81, 16, 16),))
    prepare_dataset(root / "src81", root / "ds81")
    return root / "ds81"


def test_81_frames_u2xr2_each_rank_decodes_its_window_plus_halo(root, ds81):
    """81 raw frames at U2xR2 (21 latent frames: placed by token, training/batches/placed.py),
    halo 2 latents: each rank decodes, per clip, exactly the raw frames of the halo window of the
    latent frames its tokens lie on (counted from the source's reads, the window written out here
    from the VAE rule: ``[4 (ls - h - 1), 1 + 4 (le - 1))``, from 0 at the start), never the whole
    clip; together the ranks cover every latent frame of the clip."""
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.batches.placed import PlacedBatchMaker
    from megatron_video.training.families import get_family

    cfg = _config(root, "wan")
    cfg.data.num_frames, cfg.data.path, cfg.vae.halo_latents = 81, str(ds81), 2
    cfg.train.micro_batch_size = cfg.train.global_batch_size = 1  # one clip over the 4 ranks
    enc = get_family("wan").raw_video_encoders(cfg)
    covered, decoded = set(), []
    for rank in range(4):
        coords = RankCoords(cp_rank=rank, ulysses_size=2, ring_size=2)
        maker = PlacedBatchMaker(cfg, coords, latent_scale=1.0, vae=enc)
        assert maker.grid[0] == 21
        mb = next(maker.step_batches(0))
        frames = mb.packed.token_thw(mb.local)[:, 0]
        clip = mb.packed.clip_of(mb.local)
        per_clip = {}
        for key, win in maker.source.reads:
            per_clip.setdefault(key, set()).update(range(win.raw_start, win.raw_end))
        for c, key in enumerate(mb.clip_ids):
            mine = frames[clip == c]
            if not mine.numel():  # no token of this clip here: not decoded at all
                assert key not in per_clip, (rank, key)
                continue
            ls, le = int(mine.min()), int(mine.max()) + 1  # one contiguous run per clip here
            assert sorted(set(mine.tolist())) == list(range(ls, le))
            start = 0 if ls - 2 <= 0 else 4 * (ls - 2 - 1)
            want = set(range(start, 1 + 4 * (le - 1)))
            assert per_clip[key] == want, (rank, key, sorted(per_clip[key]))
            assert len(want) < 81 and len(want) <= 4 * (le - ls) + 4 * 2 + 1
            covered |= {(key, f) for f in range(ls, le)}
            decoded.append(len(want))
    assert covered == {(key, f) for key in {k for k, _ in covered} for f in range(21)}
    assert len(decoded) == 4  # one clip over the 4 ranks
    print(f"raw frames decoded per (rank, clip) at 81 frames, U2xR2, halo 2: {decoded}")


def _placed_steps(configs) -> list:
    """Rank side: ``_placed_step`` of each config in turn (one pool run)."""
    return [_placed_step(cfg) for cfg in configs]


def _placed_step(cfg) -> dict:
    """Rank side (U2xR2): one float64 step of ``wan``'s own pieces (placed by token at 21 latent
    frames) from ``cfg``'s source -- raw clips through a float64 VAE, or shards; the CP-summed
    loss and parameter gradients, this rank's clean tokens and the raw windows it decoded."""
    from megatron_video.parallel import comm
    from megatron_video.testing.parallel import video_parallel
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.families import get_family
    from megatron_video.training.families.wan import wan_transformer_config

    fam = get_family(cfg.model.family)
    with video_parallel(2, 2, ranks_per_node=2, seed=0) as groups:
        model = fam.build_model(wan_transformer_config(cfg, params_dtype=torch.float64), config=cfg)
        enc = fam.raw_video_encoders(cfg)
        if enc is not None:
            enc.encoder.vae.double()
        coords = RankCoords(cp_rank=groups.cp_rank, ulysses_size=2, ring_size=2)
        sample = fam.sample_layout(cfg, 4)
        maker = fam.make_batches(cfg, coords=coords, vae=enc, latent_scale=1.0, layout=None)
        mb = next(maker.step_batches(0))
        clean = mb.x.clone()
        for k, v in vars(mb).items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                setattr(mb, k, v.double())
        objective = fam.make_objective(cfg, groups, sample)
        args, kwargs = objective.model_call(mb, True)
        share = objective.loss(model(*args, **kwargs), mb)
        share.backward()
        loss = share.detach().clone()
        comm.all_reduce(loss, groups.cp_group, tag="test.loss")
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for g in grads.values():
            comm.all_reduce(g, groups.cp_group, tag="test.grad")
        reads = [(k, w.raw_start, w.raw_end) for k, w in getattr(maker.source, "reads", [])]
        frames = mb.packed.token_thw(mb.local)[:, 0]
        mine = sorted(set(frames[mb.packed.clip_of(mb.local) >= 0].tolist()))
        return dict(loss=float(loss), grads=grads, clean=clean, reads=reads, frames=mine,
                    placed=type(maker).__name__, keys=list(mb.clip_ids),
                    halo=getattr(maker.source, "halo", None))  # fmt: skip


def test_81_frames_u2xr2_step_from_raw_equals_precomputed_shards(pool4, root, ds81, monkeypatch):
    """Float64, 81 raw frames (21 latent frames) at U2xR2, placed by token: one step of ``wan``
    whose VAE runs inside the SP partition (each rank decodes only its window plus the exact halo,
    never more) equals the step from ``precompute``'s shards of the same clip (whole-clip
    encoding, SP 1, the same float64 VAE): the clean tokens bitwise, the loss and every parameter
    gradient to 1e-10 relative. (The tiny VAE's exact halo, 19 latents, reaches frame 0 from
    every rank of a 21-frame clip; the control at halo 2, where the last rank's window starts
    later, differs.)"""
    from megatron_video.data.text import HFTextEncoder
    from megatron_video.training import precompute
    from megatron_video.training.config import validate

    wan_vae_encoder = precompute.wan_vae_encoder

    def float64_vae(*args):
        encode = wan_vae_encoder(*args)
        encode.vae.double()
        return encode

    def config(source):
        cfg = _config(root, "wan", source=source, **CP4)
        cfg.data.num_frames = 81
        cfg.train.micro_batch_size = cfg.train.global_batch_size = 1  # one clip over 4 ranks
        if source == "energon":
            cfg.data.path = str(ds81)
        else:
            cfg.data.shards = str(root / "shards81")
        return cfg

    monkeypatch.setattr(precompute, "wan_vae_encoder", float64_vae)
    text = HFTextEncoder.from_pretrained(str(root / "umt5"), TEXT_LEN)
    precompute.precompute_latents(config("energon"), root / "shards81", text_encoder=text)
    configs = [config("energon"), config("shards"), config("energon")]
    configs[2].vae.halo_latents = 2  # control: below the exact halo, later windows start later
    for cfg in configs:
        validate(cfg, 4)
    per_rank = pool4.run(_placed_steps, configs, ranks_per_node=2)
    got = dict(energon=[r[0] for r in per_rank], shards=[r[1] for r in per_rank])
    ref, short = got["shards"][0], per_rank[3][2]
    assert short["reads"][0][1] > 0 and not torch.equal(short["clean"], per_rank[3][1]["clean"])
    assert abs(short["loss"] - ref["loss"]) > 1e-6 * ref["loss"], short["loss"]
    floor = 1e-6 * max(float(g.abs().max()) for g in ref["grads"].values())
    worst = 0.0
    for rank, (raw, shard) in enumerate(zip(got["energon"], got["shards"])):
        assert raw["placed"] == shard["placed"] == "PlacedBatchMaker"
        assert raw["keys"] == shard["keys"] and not shard["reads"]
        assert torch.equal(raw["clean"], shard["clean"]), rank
        assert abs(raw["loss"] - ref["loss"]) <= 1e-10 * ref["loss"], (rank, raw["loss"])
        for name, g in ref["grads"].items():
            err = float((raw["grads"][name] - g).abs().max()) / max(float(g.abs().max()), floor)
            assert err <= 1e-10, (rank, name, err)
            worst = max(worst, err)
        halo, ls, le = raw["halo"], raw["frames"][0], raw["frames"][-1] + 1  # one run of frames
        assert halo > 0 and le - ls < 21
        start = 0 if ls - halo <= 0 else 4 * (ls - halo - 1)
        assert {(a, b) for _, a, b in raw["reads"]} == {(start, 1 + 4 * (le - 1))}, rank
    print(
        f"81 frames U2xR2 raw vs shards (halo {halo}): loss {ref['loss']:.10f}, max grad rel "
        f"diff {worst:.1e}; raw frames decoded per rank {[r['reads'] for r in got['energon']]}"
    )
