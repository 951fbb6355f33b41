"""Per-rank micro-batches (single process; the maker is rank-explicit).

* SP-folded VAE encoding: every CP rank's clean tokens (its halo windows encoded, leading latents
  dropped) are exactly its slice of the whole clip's encoding, for the contiguous layout and for
  the ring-balanced Balanced SP layout; the injected noise is the rank's slice of one draw.
* WebDataset shards of the same clips give the same micro-batches as the procedural source.
* The data-parallel partition of each step's clips (the sample ledger's draw).
"""

import numpy as np
import pytest
import torch

from megatron_video.layouts.balanced_sp import BalancedSPLayout
from megatron_video.training.batches import RankCoords
from megatron_video.training.batches.fixed import FixedBatchMaker
from megatron_video.training.config import config_from_dict, latent_shape, token_grid_of

pytestmark = pytest.mark.filterwarnings("ignore")


def _config(family, tmp, **data):
    return config_from_dict(
        dict(
            model=dict(family=family, frames_per_block=1, num_layers=2, hidden_size=48),
            data=dict(dict(num_frames=17, height=16, width=16, num_samples=16), **data),
            vae=dict(base_channels=4, cache_dir=str(tmp)),
            train=dict(micro_batch_size=2, seed=11),
        )
    )


@pytest.fixture(scope="module")
def vae():
    from megatron_video.models.vae import CausalVideoVAE

    torch.manual_seed(0)
    return CausalVideoVAE(3, 4, 4).eval().requires_grad_(False)


def _maker(cfg, vae, cp_rank, cp_size, layout=None):
    return FixedBatchMaker(
        cfg,
        RankCoords(cp_rank=cp_rank, ulysses_size=cp_size),
        vae=vae,
        latent_scale=1.7,
        layout=layout,
    )


@pytest.mark.parametrize("family, ring", [("video_dit", 1), ("ar_dit", 1), ("ar_dit", 2)])
def test_rank_latents_are_slices_of_the_full_encoding(vae, tmp_path, family, ring):
    cfg = _config(family, tmp_path, num_frames=13)  # 4 latent frames of 2 x 2
    F, _, _ = latent_shape(cfg)
    P = 4
    S = token_grid_of(cfg)[1] * token_grid_of(cfg)[2]
    one = BalancedSPLayout(F, S, 1, 1) if family == "ar_dit" else None
    full = _maker(cfg, vae, 0, 1, one).micro_batch(3, [5, 2])
    seen = []
    for r in range(P):
        layout = BalancedSPLayout(F, S, 1, P, ring_size=ring) if family == "ar_dit" else None
        mb = _maker(cfg, vae, r, P, layout).micro_batch(3, [5, 2])
        ids = (
            layout.local_global_ids(r)[: layout.local_len // 2]
            if layout is not None
            else torch.arange(r * F * S // P, (r + 1) * F * S // P)
        )
        seen.append(ids)
        assert torch.allclose(mb.clean, full.clean[:, ids], rtol=0, atol=1e-5), r
        assert torch.equal(mb.noise, full.noise[:, ids])
        assert torch.equal(mb.t, full.t) and torch.equal(mb.sigma, full.sigma)
        assert mb.captions == full.captions
    assert sorted(torch.cat(seen).tolist()) == list(range(F * S))


def test_shards_give_the_procedural_batches(vae, tmp_path):
    from megatron_video.data.shards import write_shards
    from megatron_video.data.synthetic import ProceduralVideoDataset

    cfg = _config("video_dit", tmp_path, num_frames=13)
    d = cfg.data
    ds = ProceduralVideoDataset(
        d.num_samples, num_frames=d.num_frames, height=d.height, width=d.width, seed=d.seed
    )
    write_shards(
        ({"video": ds[i]["video"], "caption": ds[i]["caption"], "key": f"s{i}"} for i in range(8)),
        tmp_path / "shards",
        samples_per_shard=3,
    )
    shard_cfg = _config(
        "video_dit", tmp_path, num_frames=13, source="shards", shards=str(tmp_path / "shards")
    )
    for step in (0, 1, 3):
        a = _maker(cfg, vae, 0, 1).micro_batch(step, [step, step + 1])
        b = _maker(shard_cfg, vae, 0, 1).micro_batch(step, [f"s{step}", f"s{step + 1}"])
        assert a.captions == b.captions
        assert torch.allclose(a.clean, b.clean, rtol=0, atol=1e-6) and torch.equal(a.noise, b.noise)
    bad = _config(
        "video_dit", tmp_path, num_frames=17, source="shards", shards=str(tmp_path / "shards")
    )
    with pytest.raises(
        ValueError, match=r"video shape \(3, 13, 16, 16\) must be \[3, data.num_frames=17"
    ):
        _maker(bad, vae, 0, 1)


# ---------------------------------------------------------------------------------------------
# the data-parallel partition on 4 gloo ranks (DP 2 x CP 2), procedural and WebDataset sources
# ---------------------------------------------------------------------------------------------
def _dp_partition(tmp, source):
    import warnings

    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = tiny_config(
        "ar_dit", tmp, context_parallel_size=2, ulysses_size=2, ring_size=1, ranks_per_node=2
    )
    if source == "shards":
        cfg.data.source, cfg.data.shards = "shards", f"{tmp}/dp_shards"
    t = Trainer(cfg, progress=False)
    try:
        seen = {
            step: [c for mb in t.batches.step_batches(step) for c in mb.captions]
            for step in range(3)
        }
        return t.dp_rank, t.cp_rank, t.global_batch, seen
    finally:
        t.close()


@pytest.mark.parametrize("source", ["synthetic", "shards"])
def test_dp_partition_on_ranks(pool4, tmp_path_factory, source):
    """Each step's global batch is split between the data-parallel ranks without overlap or gap;
    the CP ranks of one data-parallel replica read the same samples."""
    from megatron_video.data.shards import write_shards
    from megatron_video.data.synthetic import ProceduralVideoDataset
    from megatron_video.testing.configs import tiny_config
    from megatron_video.training.vae_stage import ensure_vae

    tmp = str(tmp_path_factory.mktemp(f"dp_{source}"))
    cfg = tiny_config("ar_dit", tmp)
    ensure_vae(cfg, progress=False)
    d = cfg.data
    ds = ProceduralVideoDataset(
        16, num_frames=d.num_frames, height=d.height, width=d.width, seed=d.seed
    )
    if source == "shards":
        write_shards(
            ({"video": ds[i]["video"], "caption": f"clip {i}", "key": f"s{i}"} for i in range(16)),
            f"{tmp}/dp_shards",
            samples_per_shard=5,
        )
    res = pool4.run(_dp_partition, tmp, source)
    # the exact clips, from the documented rule (data/ledger.py, docs/data.md): epoch 0 visits
    # the sorted clip ids in the permutation seeded by (data.seed, 0); with equal clips a step
    # takes the next global batch of them
    from megatron_video.data.synthetic import caption_for

    n = 16 if source == "shards" else d.num_samples
    keys = sorted(f"s{i}" for i in range(n)) if source == "shards" else list(range(n))
    order = [keys[i] for i in np.random.default_rng([d.seed, 0]).permutation(n)]
    full = ProceduralVideoDataset(
        n, num_frames=d.num_frames, height=d.height, width=d.width, seed=d.seed
    )

    def caption(k):
        return f"clip {k[1:]}" if source == "shards" else caption_for(full.attributes(k))

    everything = []
    gbs = res[0][2]
    assert gbs == 4 and sorted((r[0], r[1]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for step in range(3):
        by_dp = {}
        for dp, _cp, _, seen in res:
            by_dp.setdefault(dp, []).append(seen[step])
        for views in by_dp.values():
            assert views[0] == views[1], "CP ranks of one replica read the same samples"
            assert len(views[0]) == gbs // 2
        union = by_dp[0][0] + by_dp[1][0]
        assert len(set(union)) == gbs, "no sample twice within a global batch"
        want = sorted(caption(k) for k in order[step * gbs : (step + 1) * gbs])
        assert sorted(union) == want, (step, union, want)
        if source == "shards":
            everything.extend(union)
    if source == "shards":  # distinct clips (captions): none twice within the epoch
        assert len(set(everything)) == len(everything) == 3 * gbs


def test_rank_coords_are_checked_once():
    c = RankCoords(dp_rank=1, dp_size=2, cp_rank=3, ulysses_size=2, ring_size=2, last_stage=False)
    assert c.cp_size == 4 and c.need_latents
    assert not RankCoords(first_stage=False, last_stage=False).need_latents  # a middle stage
    with pytest.raises(
        ValueError, match=r"RankCoords.cp_rank \(4\) must be an integer in \[0, cp_size \(4\)\)"
    ):
        RankCoords(cp_rank=4, ulysses_size=2, ring_size=2)
    with pytest.raises(ValueError, match=r"RankCoords.dp_size \(0\) must be a positive integer"):
        RankCoords(dp_size=0)
