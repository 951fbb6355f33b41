"""Procedural videos, captions and WebDataset shards (packed mixed-shape micro-batches:
tests/test_packed_video.py, tests/test_train_mixed.py)."""

import json
import math

import numpy as np
import pytest
import torch

from megatron_video.data import (
    CaptionTokenizer,
    ProceduralVideoDataset,
    ShardReader,
    list_shards,
    render_video,
    sample_attributes,
    shard_indices,
    write_shards,
)
from megatron_video.data.synthetic import COLORS, DIRECTIONS, SHAPES, SIZES
from megatron_video.models.captions import VOCAB, CaptionEmbedder

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

# ------------------------------------------------------------------------------------- synthetic


def test_procedural_determinism_shape_and_range():
    a = ProceduralVideoDataset(8, num_frames=17, height=32, width=32, seed=3)
    b = ProceduralVideoDataset(8, num_frames=17, height=32, width=32, seed=3)
    c = ProceduralVideoDataset(8, num_frames=17, height=32, width=32, seed=4)
    for i in range(8):
        s = a[i]
        assert s["video"].shape == (3, 17, 32, 32) and s["video"].dtype == torch.float32
        assert s["video"].min() >= -1 and s["video"].max() <= 1
        assert torch.equal(s["video"], b[i]["video"]) and s["caption"] == b[i]["caption"]
    assert any(not torch.equal(a[i]["video"], c[i]["video"]) for i in range(8))
    assert len({a[i]["caption"] for i in range(8)}) > 1
    big = ProceduralVideoDataset(2, num_frames=33, height=64, width=48)
    assert big[1]["video"].shape == (3, 33, 64, 48)
    with pytest.raises(ValueError, match=r"num_frames \(0\) must be >= 1"):
        ProceduralVideoDataset(2, num_frames=0)
    with pytest.raises(ValueError, match=r"height \(4\) must be >= 8"):
        ProceduralVideoDataset(2, height=4)


def _foreground(frame):
    """Pixels differing from the black background, and their mean colour in [0, 1] RGB."""
    fg = (frame > -1).any(0)
    return fg, ((frame[:, fg].mean(1) + 1) / 2).numpy()


def test_video_matches_its_caption():
    """The caption is the truth: start/end colour, direction of motion, shape, frame count."""
    ds = ProceduralVideoDataset(40, num_frames=17, height=32, width=32, seed=0)
    tok = ds.tokenizer
    seen_dirs, seen_shapes = set(), set()
    for i in range(len(ds)):
        s, attrs = ds[i], ds.attributes(i)
        words = s["caption"].replace(",", "").split()
        assert attrs.color_start in words and attrs.shape in words and attrs.size in words
        assert (attrs.color_end != attrs.color_start) == ("turning" in words)
        assert all(w in words for w in attrs.direction.split())
        assert tok.decode(s["caption_ids"], s["caption_mask"]) == s["caption"]
        v = s["video"]
        fg0, c0 = _foreground(v[:, 0])
        fg1, _ = _foreground(v[:, 1])
        _, c_last = _foreground(v[:, -1])
        np.testing.assert_allclose(c0, COLORS[attrs.color_start], atol=1e-6)
        np.testing.assert_allclose(c_last, COLORS[attrs.color_end], atol=1e-6)
        ys, xs = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
        move = [
            ((xs * fg1).sum() / fg1.sum() - (xs * fg0).sum() / fg0.sum()).item(),
            ((ys * fg1).sum() / fg1.sum() - (ys * fg0).sum() / fg0.sum()).item(),
        ]
        dx, dy = DIRECTIONS[attrs.direction]
        assert move[0] * dx + move[1] * dy > 0.5  # at least half a pixel along the stated direction
        assert abs(move[0] * dy) + abs(move[1] * dx) < 0.5  # and none across it
        seen_dirs.add(attrs.direction)
        seen_shapes.add(attrs.shape)
    assert seen_dirs == set(DIRECTIONS) and seen_shapes == set(SHAPES)


def test_shape_areas_and_images():
    # Large shapes cover more pixels than small ones; a circle covers about pi r^2.
    attrs = sample_attributes(0, 0, num_frames=1, height=64, width=64)
    for shape, area in (("circle", lambda r: math.pi * r * r), ("diamond", lambda r: 2 * r * r)):
        a = type(attrs)(shape, "large", "red", "red", None, 12.0, 32.0, 32.0, 0.0)
        fg, _ = _foreground(render_video(a, num_frames=1, height=64, width=64)[:, 0])
        assert abs(fg.sum().item() / area(12.0) - 1) < 0.1
    ds = ProceduralVideoDataset(200, num_frames=17, image_fraction=0.25, seed=1)
    frames = [ds.frames_of(i) for i in range(200)]
    n_img = frames.count(1)
    assert set(frames) == {1, 17} and abs(n_img / 200 - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 200)
    img = ds[frames.index(1)]
    assert img["video"].shape == (3, 1, 32, 32) and "bouncing" not in img["caption"]


def test_tokenizer_and_caption_embedder():
    tok = CaptionTokenizer(max_len=12)
    ids, mask = tok.encode("a small red circle bouncing left to right, turning blue")
    assert ids.shape == (12,) and int(mask.sum()) == 11 and bool((ids[~mask] == 0).all())
    assert tok.decode(ids, mask) == "a small red circle bouncing left to right, turning blue"
    assert tok.encode("a purple circle")[0][1].item() == VOCAB.index("<unk>")
    # the models' vocabulary spells out the data's words: sizes, colours and shapes, in that order
    assert VOCAB[-len(SIZES) - len(COLORS) - len(SHAPES) :] == (*SIZES, *COLORS, *SHAPES)
    assert {w for d in DIRECTIONS for w in d.split()} <= set(VOCAB)
    with pytest.raises(ValueError, match=r"caption length \(13 tokens\) must be <= max_len \(12\)"):
        tok.encode(" ".join(["a"] * 13))
    ids2, mask2 = tok.encode_batch(["a red circle", "a large blue square bouncing top to bottom"])
    emb_mod = CaptionEmbedder(tok.vocab_size, 8, 12, generator=torch.Generator().manual_seed(0))
    same = CaptionEmbedder(tok.vocab_size, 8, 12, generator=torch.Generator().manual_seed(0))
    emb, m = emb_mod(ids2, mask2)
    assert emb.shape == (2, 12, 8) and torch.equal(m, mask2)
    assert bool((emb[~mask2] == 0).all()) and bool((emb[mask2] != 0).any())
    torch.testing.assert_close(emb, same(ids2, mask2)[0])  # explicit generator: identical replicas
    # Same word in the same slot embeds the same ("a"), different words differ ("red" vs "large").
    torch.testing.assert_close(emb[0, 0], emb[1, 0])
    assert not torch.allclose(emb[0, 1], emb[1, 1])
    null, null_mask = emb_mod.null(3)
    assert null.shape == (3, 12, 8) and bool(null_mask.all())
    (emb.sum() + null.sum()).backward()
    assert (
        emb_mod.tokens.weight.grad.abs().sum() > 0 and emb_mod.null_embedding.grad.abs().sum() > 0
    )


def test_dp_shard_indices_partition():
    for n, world in ((10, 3), (7, 7), (5, 8), (100, 4)):
        for seed in (None, 0):
            parts = [shard_indices(n, r, world, seed=seed, epoch=2) for r in range(world)]
            flat = [i for p in parts for i in p]
            assert sorted(flat) == list(range(n)) and len(flat) == len(set(flat))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
            assert parts == [shard_indices(n, r, world, seed=seed, epoch=2) for r in range(world)]
    assert shard_indices(100, 0, 4, seed=0, epoch=0) != shard_indices(100, 0, 4, seed=0, epoch=1)
    with pytest.raises(ValueError, match=r"dp_rank \(3\) must be in \[0, dp_size=3\)"):
        shard_indices(10, 3, 3)


# ---------------------------------------------------------------------------------------- shards


def _read_all(reader):
    return {s["key"]: s for s in reader}


def test_webdataset_round_trip_and_dp_partition(tmp_path):
    ds = ProceduralVideoDataset(10, num_frames=5, height=8, width=8, seed=2)
    samples = [
        {"video": ds[i]["video"], "caption": ds[i]["caption"], "meta": {"index": i, "fps": 8}}
        for i in range(10)
    ]
    paths = write_shards(samples, tmp_path / "vid", samples_per_shard=3)
    assert [p.rsplit("/", 1)[1] for p in paths] == [f"shard-{k:06d}.tar" for k in range(4)]
    assert list_shards(tmp_path / "vid") == paths == list_shards(str(tmp_path / "vid" / "*.tar"))
    everything = _read_all(ShardReader(tmp_path / "vid"))
    assert len(everything) == 10
    for key, s in everything.items():
        i = s["meta"]["index"]
        assert key == f"{i:09d}" and s["caption"] == samples[i]["caption"] and s["meta"]["fps"] == 8
        assert torch.equal(s["video"], samples[i]["video"]) and s["video"].dtype == torch.float32
    for split, world in (("shards", 2), ("shards", 4), ("samples", 3), ("samples", 7)):

        def read(r):
            return list(_read_all(ShardReader(paths, dp_rank=r, dp_size=world, split=split)))

        parts = [read(r) for r in range(world)]
        flat = [k for p in parts for k in p]
        assert sorted(flat) == sorted(everything) and len(flat) == len(set(flat)), (split, world)
        assert parts == [read(r) for r in range(world)]  # deterministic
    with pytest.raises(ValueError, match=r"number of shards \(4\) must be >= dp_size \(5\)"):
        ShardReader(paths, dp_rank=0, dp_size=5)


def test_webdataset_latents_workers_and_errors(tmp_path):
    lat = [
        {
            "latent": np.full((4, 2, 3, 3), i, dtype=np.float16),
            "caption": f"clip {i}",
            "key": f"c{i}",
        }
        for i in range(6)
    ]
    paths = write_shards(lat, tmp_path, samples_per_shard=4, prefix="lat")
    got = _read_all(ShardReader(paths))
    assert sorted(got) == [f"c{i}" for i in range(6)]
    assert got["c5"]["latent"].dtype == torch.float16 and bool((got["c5"]["latent"] == 5).all())
    assert got["c5"]["meta"] == {} and "video" not in got["c5"]
    # DataLoader workers split a rank's share further, still disjoint and complete.
    loader = torch.utils.data.DataLoader(
        ShardReader(paths, split="samples"), batch_size=None, num_workers=2
    )
    assert sorted(s["key"] for s in loader) == sorted(got)
    with pytest.raises(ValueError, match="exactly one of"):
        write_shards([{"caption": "x"}], tmp_path / "bad")
    with pytest.raises(ValueError, match=r"key \('a\.b'\)"):
        write_shards([{"video": np.zeros(2), "caption": "x", "key": "a.b"}], tmp_path / "bad")
    with pytest.raises(ValueError, match="must name at least one .tar"):
        ShardReader(tmp_path / "nothing-here")
    json.dumps(got["c0"]["meta"])
