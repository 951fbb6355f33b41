"""Real video through megatron-energon (data.energon_video): prepare -> per-rank frame-range
decoding of each CP rank's halo windows (the fixed-shape batches' raw clip source), the resume
order on 4 gloo ranks (DP2 x CP2, the sample ledger), corrupt files."""

import io
import json
import tarfile

import pytest
import torch

from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos

T, HW, F = 29, 32, 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("energon")
    write_procedural_videos(root / "src", 8, num_frames=T, height=HW, width=HW, seed=3)
    (root / "src" / "broken.mp4").write_bytes(b"not a video at all")
    (root / "src" / "broken.txt").write_text("a broken file")
    summary = prepare_dataset(root / "src", root / "ds", samples_per_shard=3)
    return root, summary


def _full_decode(path):
    import av

    with av.open(str(path)) as c:
        return torch.stack(
            [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in c.decode(video=0)]
        )


def test_prepare_records_metadata_and_skips_unreadable(dataset):
    root, s = dataset
    assert s["samples"] == 8 and len(s["shards"]) == 3
    assert [f for f, _ in s["skipped"]] == [str(root / "src" / "broken.mp4")]
    assert "unreadable" in s["skipped"][0][1]
    for m in s["videos"]:
        assert (m["num_frames"], m["width"], m["height"], m["fps"]) == (T, HW, HW, 8.0)
        assert m["caption"] == (root / "src" / m["source"]).with_suffix(".txt").read_text()
    meta = root / "ds" / ".nv-meta"
    assert (meta / "dataset.yaml").read_text().startswith("__module__: megatron.energon")
    assert (meta / "split.yaml").is_file() and (meta / "index.sqlite").is_file()


def _fixed_maker(ds_path, cp_rank, cp_size, tmp):
    from megatron_video.models.vae import CausalVideoVAE
    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.batches.fixed import FixedBatchMaker

    cfg = tiny_config("video_dit", str(tmp))
    cfg.data.source, cfg.data.path = "energon", str(ds_path)
    cfg.data.num_frames, cfg.data.height, cfg.data.width = T, HW, HW
    torch.manual_seed(0)
    vae = CausalVideoVAE(3, cfg.vae.latent_channels, 4).eval()
    coords = RankCoords(cp_rank=cp_rank, ulysses_size=cp_size)
    return FixedBatchMaker(cfg, coords, vae=type("V", (), {"encoder": vae.encoder})())


def test_energon_windows_per_cp_rank(dataset, tmp_path):
    """Each CP rank decodes exactly its halo window of each clip (a slice of the full decode);
    the CP ranks read the same clips; the file that does not decode was left out by prepare."""
    root, _ = dataset
    seen = []
    for cp in (0, 1):
        m = _fixed_maker(root / "ds", cp, 2, tmp_path)
        assert len(m.ids) == 8
        mbs = list(m.step_batches(0))
        seen.append([c for mb in mbs for c in mb.captions])
        wins = {(w.raw_start, w.raw_end) for _, w in m.source.reads}
        assert wins == ({(0, 13)} if cp == 0 else {(4, 29)})  # F=8 latents, halo 2
        assert len(m.source.reads) == sum(len(mb.captions) for mb in mbs)
        key, w = m.source.reads[0]
        rec = m.source.clips.records[key]
        full = _full_decode(root / "src" / rec["source"])
        ref = (full[w.raw_start : w.raw_end].float() / 127.5 - 1).permute(3, 0, 1, 2)
        assert torch.equal(m.source.raw(key, w), ref)
    assert seen[0] == seen[1]


def test_corrupt_sample_named(dataset, tmp_path):
    src = tmp_path / "src"
    write_procedural_videos(src, 4, num_frames=T, height=HW, width=HW, seed=4)
    prepare_dataset(src, tmp_path / "ds", samples_per_shard=4)
    shard = tmp_path / "ds" / "videos-000000.tar"  # truncate clip 1's bytes inside the shard
    members = []
    with tarfile.open(shard) as tf:
        for m in tf.getmembers():
            members.append((m, tf.extractfile(m).read()))
    with tarfile.open(shard, "w") as tf:
        for m, data in members:
            if m.name == "000000001.mp4":
                data = data[: len(data) // 3]
                m.size = len(data)
            tf.addfile(m, io.BytesIO(data))
    from megatron.energon import BaseWebdatasetFactory

    BaseWebdatasetFactory.prepare_dataset(
        tmp_path / "ds",
        ["videos-000000.tar"],
        split_parts_ratio=[("train", 1.0)],
        shuffle_seed=None,
        workers=1,
    )
    m = _fixed_maker(tmp_path / "ds", 1, 2, tmp_path)
    with pytest.raises(ValueError, match=r"clip '000000001' of data.path .* cannot be decoded"):
        m.micro_batch(0, ["000000001"])


# ---------------------------------------------------------------------------------------------
# the trainer's path: loader state in the checkpoint, resume = uninterrupted (DP2 x CP2)
# ---------------------------------------------------------------------------------------------
DP2_CP2 = dict(context_parallel_size=2, ulysses_size=2, ring_size=1, ranks_per_node=2)


def _trainer_resume(tmp, ds):
    import warnings

    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")

    def make(name):
        cfg = tiny_config("ar_dit", tmp, **DP2_CP2)
        cfg.data.source, cfg.data.path, cfg.output = "energon", ds, f"{tmp}/{name}"
        t = Trainer(cfg, progress=False)
        keys = []
        mb = t.batches.micro_batch
        t.batches.micro_batch = lambda step, k: (keys.append(list(k)), mb(step, k))[1]
        return t, keys

    t, keys = make("a")
    try:
        losses = [t.train_step(s)["loss"] for s in (0, 1)]
        t.save(2)
        losses += [t.train_step(s)["loss"] for s in (2, 3)]
        full_keys = list(keys)
    finally:
        t.close()
    t, keys = make("b")
    try:
        assert t.load(f"{tmp}/a/checkpoints") == 2
        resumed = [t.train_step(s)["loss"] for s in (2, 3)]
    finally:
        t.close()
    return dict(
        losses=losses, resumed=resumed, full_keys=full_keys, resumed_keys=keys, dp=t.dp_rank
    )


def test_trainer_checkpoint_resumes_energon_order(pool4, tmp_path_factory):
    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.vae_stage import ensure_vae

    tmp = tmp_path_factory.mktemp("energon_trainer")
    ensure_vae(tiny_config("ar_dit", str(tmp)), progress=False)
    write_procedural_videos(tmp / "src", 6, num_frames=13, height=16, width=16, seed=9)
    prepare_dataset(tmp / "src", tmp / "ds")
    out = pool4.run(_trainer_resume, str(tmp), str(tmp / "ds"))
    for r in out:
        assert len(r["full_keys"]) == 8  # 4 steps x 2 micro-batches
        assert r["resumed_keys"] == r["full_keys"][4:]  # the loader continued where it stood
        if r["losses"][0] is not None:
            assert r["resumed"] == r["losses"][2:]  # bit-identical steps after resume
    assert out[0]["full_keys"] == out[1]["full_keys"] != out[2]["full_keys"] == out[3]["full_keys"]
    ck = tmp / "a" / "checkpoints"
    files = sorted(p.name for p in ck.rglob("dataloader/*.json"))
    assert files == ["ledger.json"]  # the sample ledger, the same on every rank


def test_prepare_cli_manifest_json_sidecars_and_errors(tmp_path, capsys):
    from megatron_video.training.cli import main

    src = tmp_path / "src"
    paths = write_procedural_videos(src / "sub", 3, num_frames=9, height=16, width=16)
    for p in paths:  # captions from a JSONL manifest
        p.with_suffix(".txt").unlink()
    (tmp_path / "m.jsonl").write_text(
        "".join(
            json.dumps({"video": f"sub/{p.name}", "caption": f"clip {i}"}) + "\n"
            for i, p in enumerate(paths)
        )
    )
    assert (
        main(
            [
                "prepare",
                str(src),
                str(tmp_path / "ds"),
                "--manifest",
                str(tmp_path / "m.jsonl"),
                "--samples-per-shard",
                "2",
            ]
        )
        == 0
    )
    info = json.loads((tmp_path / "ds" / ".nv-meta" / "megatron_video.json").read_text())
    assert [v["caption"] for v in info["videos"]] == ["clip 0", "clip 1", "clip 2"]
    assert [v["num_frames"] for v in info["videos"]] == [9, 9, 9] and len(info["shards"]) == 2
    for p in paths:  # sidecar .json captions
        p.with_suffix(".json").write_text(json.dumps({"caption": f"json {p.stem}"}))
    assert main(["prepare", str(src), str(tmp_path / "ds2")]) == 0
    info = json.loads((tmp_path / "ds2" / ".nv-meta" / "megatron_video.json").read_text())
    assert info["videos"][0]["caption"] == f"json {paths[0].stem}"
    assert (
        main(
            [
                "prepare",
                "--procedural",
                "2",
                str(tmp_path / "ds3"),
                "--overrides",
                "data.num_frames=9",
                "data.height=16",
                "data.width=16",
            ]
        )
        == 0
    )
    assert (tmp_path / "ds3" / "videos" / "clip000001.mp4").is_file()
    capsys.readouterr()
    (src / "sub" / "clip000000.json").unlink()  # a video without a caption: exit 2, named
    assert main(["prepare", str(src), str(tmp_path / "ds4")]) == 2
    err = capsys.readouterr().err
    assert "clip000000.mp4 has no caption" in err
    assert main(["prepare", str(tmp_path / "nope"), str(tmp_path / "ds5")]) == 2
    assert "SRC (" in capsys.readouterr().err


def test_energon_config_and_loader_refusals(tmp_path):
    from megatron_video.training.config import load_config, validate

    with pytest.raises(ValueError, match=r"data.path \(None\) must name an energon dataset"):
        validate(load_config(None, ["data.source=energon"]), 1)
    with pytest.raises(
        ValueError, match=r"data.source \('tar'\) must be 'synthetic', 'shards' or 'energon'"
    ):
        validate(load_config(None, ["data.source=tar"]), 1)
