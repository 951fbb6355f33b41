"""Real video through megatron-energon (data.energon_video): prepare -> per-rank frame-range
decoding on 4 gloo ranks (DP2 x CP2), sample agreement and sharding, resume order, corrupt files."""

import io
import json
import logging
import tarfile

import pytest
import torch

from megatron_video.data.energon_video import (
    prepare_dataset,
    state_from_json,
    state_to_json,
    video_window_loader,
    write_procedural_videos,
)
from megatron_video.layouts.vae_halo import halo_windows

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


def _rank_case(ds_path, src_dir):
    import torch.distributed as dist

    me = dist.get_rank()
    dp, cp = me // 2, me % 2  # DP2 x CP2: the loader sees only the DP rank
    w = halo_windows(F, 2, 2)[cp]
    loader, te = video_window_loader(
        ds_path, [w], num_frames=T, height=HW, width=HW, batch_size=2, dp_rank=dp, dp_size=2, seed=5
    )
    it = iter(loader)
    batches, state = [], None
    for i in range(4):
        batches.append(next(it))
        if i == 1:
            state = state_to_json(loader.save_state_rank())
    keys = [[s.meta["source"] for s in b] for b in batches]
    decoded = [s.decoded_frames for b in batches for s in b]
    exact = True  # the window is the slice of a full decode
    for b in batches[:2]:
        for s in b:
            full = _full_decode(f"{src_dir}/{s.meta['source']}")
            ref = (full[w.raw_start : w.raw_end].float() / 127.5 - 1).permute(3, 0, 1, 2)
            exact &= torch.equal(s.windows[0], ref)
    # resume: a fresh loader restored from the JSON state continues as the uninterrupted one
    loader2, _ = video_window_loader(
        ds_path, [w], num_frames=T, height=HW, width=HW, batch_size=2, dp_rank=dp, dp_size=2, seed=5
    )
    loader2.restore_state_rank(state_from_json(state))
    it2 = iter(loader2)
    resumed = [[s.meta["source"] for s in next(it2)] for _ in range(2)]
    return dict(
        dp=dp,
        window=(w.raw_start, w.raw_end),
        keys=keys,
        decoded=decoded,
        exact=exact,
        resumed=resumed,
        total=te.decoded_frames,
    )


def test_energon_windows_dp2_cp2(pool4, dataset):
    root, _ = dataset
    out = pool4.run(_rank_case, str(root / "ds"), str(root / "src"))
    for r in out:
        a, b = r["window"]
        assert r["decoded"] == [b - a] * 8  # each rank decoded exactly its window per sample
        assert r["total"] == 8 * (b - a) < 8 * T
        assert r["exact"]
        assert r["resumed"] == r["keys"][2:]  # resume = the uninterrupted order
    assert out[0]["window"] == (0, 13) and out[1]["window"] == (4, 29)  # CP0 / CP1 windows (h = 2)
    for d in (0, 1):  # CP ranks of a replica see the same samples
        assert out[2 * d]["keys"] == out[2 * d + 1]["keys"]
    first_epoch = [set(k for b in out[2 * d]["keys"][:2] for k in b) for d in (0, 1)]
    assert not first_epoch[0] & first_epoch[1]  # the DP replicas' shares are disjoint
    assert len(first_epoch[0] | first_epoch[1]) == 8


def test_corrupt_sample_skipped_named_and_counted(dataset, tmp_path, caplog):
    root, _ = dataset
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
    w = halo_windows(F, 2, 2)[1]
    loader, te = video_window_loader(
        tmp_path / "ds", [w], num_frames=T, height=HW, width=HW, batch_size=1, dp_rank=0, dp_size=1
    )
    it = iter(loader)
    with caplog.at_level(logging.WARNING, logger="megatron_video.data"):
        got = [next(it)[0].meta["source"] for _ in range(3)]
    assert got == ["clip000000.mp4", "clip000002.mp4", "clip000003.mp4"]
    assert te.skipped == 1
    assert any(
        "clip000001.mp4" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records
    )


def test_state_json_refuses_foreign_classes():
    bad = json.dumps(
        {
            "format": "megatron_video.energon_state/1",
            "state": {"__dataclass__": "os:system", "fields": {}},
        }
    )
    with pytest.raises(ValueError, match="only megatron.energon classes are allowed"):
        state_from_json(bad)
    with pytest.raises(ValueError, match="must be a megatron_video.energon_state/1"):
        state_from_json("{}")


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
        nb = t.batches.energon.next_batch
        t.batches.energon.next_batch = lambda n: (
            lambda b: (keys.append([s.__key__ for s in b]), b)[1]
        )(nb(n))
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
    assert files == [f"rank{r}.json" for r in range(4)]


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
    with pytest.raises(
        ValueError, match=r"must be an energon dataset \(run `megatron-video prepare"
    ):
        video_window_loader(
            tmp_path,
            halo_windows(F, 2, 2)[:1],
            num_frames=T,
            height=HW,
            width=HW,
            batch_size=1,
            dp_rank=0,
            dp_size=1,
        )
    with pytest.raises(
        ValueError, match=r"windows reach raw frame 29; must lie in num_frames \(13\)"
    ):
        from megatron_video.data.energon_video import VideoWindowTaskEncoder

        VideoWindowTaskEncoder(halo_windows(F, 2, 2)[1:], 13, HW, HW)
