"""The Wan 2.1 and Wan 2.2 VAEs (diffusers' ``AutoencoderKLWan``, tiny random) wherever a VAE is
used: channels and strides read from the VAE config (``models.vae_geometry``), per-rank halo
windows equal to the full-clip encoding (float64), precompute with Wan 2.2 end to end, the halo
choice (``training.vae_halo``) and the refusals."""

import json

import pytest
import torch

from megatron_video.layouts.vae_halo import num_raw_frames, windows_for_bounds
from megatron_video.models import vae_halo_probe
from megatron_video.models.vae_geometry import VAEGeometry, module_geometry, wan_vae_geometry
from megatron_video.models.vae_halo_probe import probe_halo
from megatron_video.testing.wan import tiny_wan_vae

pytest.importorskip("diffusers")  # a requirement: present in both test envs


@pytest.fixture(scope="module")
def vaes():
    return {"2.1": tiny_wan_vae(z_dim=4), "2.2": tiny_wan_vae(z_dim=48, wan22=True)}


def test_geometry_is_read_from_the_config(vaes):
    assert module_geometry(vaes["2.1"]) == VAEGeometry(3, 4, 8, 4, 1, "AutoencoderKLWan config")
    g = module_geometry(vaes["2.2"])
    assert (g.video_channels, g.temporal_stride, g.spatial_stride, g.latent_channels) == (
        3,
        4,
        16,
        48,
    )
    cfg = dict(vaes["2.2"].config)
    with pytest.raises(ValueError, match=r"scale_factor_spatial \(8\) must equal .* = 16"):
        wan_vae_geometry(dict(cfg, scale_factor_spatial=8))
    with pytest.raises(ValueError, match=r"in_channels \(10\) must be video channels x patch"):
        wan_vae_geometry(dict(cfg, in_channels=10))
    with pytest.raises(ValueError, match=r"scale_factor_temporal \(8\) must equal"):
        wan_vae_geometry(dict(cfg, scale_factor_temporal=8))


@pytest.mark.one_env  # diffusers' VAE and our windows only: no Megatron (checked)
@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_rank_windows_equal_full_clip_encoding(vaes, version):
    """Float64: each rank's latents, encoded from its raw halo window only (the index maps of
    ``layouts.vae_halo``), equal the full clip's to 1e-10 relative with the probed exact halo, for
    ragged splits among 2 and 4 ranks whose later windows start after frame 0; halo 0 differs."""
    vae = vaes[version]
    s = module_geometry(vae).spatial_stride

    def encode(x):
        return vae.encode(x).latent_dist.mean

    vae_halo_probe._HALO_CACHE.clear()
    h = probe_halo(encode).halo  # 3 RGB channels, not config.in_channels (12 for Wan 2.2)
    F = h + 6
    splits = {2: [(0, h + 2), (h + 2, F)], 4: [(0, 2), (2, h + 1), (h + 1, h + 3), (h + 3, F)]}
    g = torch.Generator().manual_seed(1)
    x = torch.rand(1, 3, num_raw_frames(F), s, 2 * s, generator=g, dtype=torch.float64) * 2 - 1
    vae.double()
    try:
        with torch.no_grad():
            full = encode(x)
            scale = float(full.abs().max())
            for P, bounds in splits.items():
                ws = windows_for_bounds(bounds, h)
                assert ws[-1].raw_start > 0  # a later rank reads only its own window
                for w in ws:
                    got = encode(w.slice_raw(x))[:, :, w.drop :]
                    err = float((got - full[:, :, w.latent_start : w.latent_end]).abs().max())
                    assert err <= 1e-10 * scale, (version, P, w, err)
                w0 = windows_for_bounds(bounds, 0)[-1]  # control: no halo
                bare = encode(w0.slice_raw(x))[:, :, w0.drop :]
                assert float((bare - full[:, :, w0.latent_start :]).abs().max()) > 1e-6 * scale
    finally:
        vae.float()
    print(f"Wan {version}: exact halo {h} latents; F={F}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos
    from megatron_video.testing.wan import save_tiny_wan_vae

    root = tmp_path_factory.mktemp("wan22")
    write_procedural_videos(root / "src", 2, num_frames=29, height=32, width=48, seed=2)
    prepare_dataset(root / "src", root / "ds")
    save_tiny_wan_vae(root / "vae", z_dim=48, wan22=True)
    return root


def _config(root, *extra):
    from megatron_video.training.config import load_config

    return load_config(
        None,
        [
            "data.source=energon",
            f"data.path={root / 'ds'}",
            f"vae.diffusers={root / 'vae'}",
            "vae.latent_channels=48",
            "data.num_frames=29",
            "data.height=32",
            "data.width=48",
            *extra,
        ],
    )


def _decode(path):
    import av

    with av.open(str(path)) as c:
        x = torch.stack([torch.from_numpy(f.to_ndarray(format="rgb24")) for f in c.decode(video=0)])
    return (x.float() / 127.5 - 1).permute(3, 0, 1, 2)


def test_precompute_wan22_end_to_end(data, monkeypatch):
    """``data.height`` / ``width`` are pixels at Wan 2.2's 16x stride: latents [48, 8, 2, 3],
    equal to the full-clip encoding; SP 1 probes nothing; ``auto`` probes once and caches the halo
    next to the VAE; an integer below it prints the measured error once."""
    from megatron_video.data.shards import ShardReader
    from megatron_video.training import vae_halo
    from megatron_video.training.precompute import precompute_latents, wan_vae_encoder

    def no_probe(*a, **k):
        raise AssertionError("probed at SP 1")

    logs = []
    with monkeypatch.context() as m:
        m.setattr(vae_halo_probe, "probe_halo", no_probe)
        r = precompute_latents(_config(data), data / "sp1", progress=True, log=logs.append)
    assert r["samples"] == 2 and r["halo"] == 0
    assert any("precompute: 2/2 clips (" in ln and "clips/s)" in ln for ln in logs), logs
    encode = wan_vae_encoder(data / "vae", 48)  # the oracle: diffusers' own full-clip encoding
    for s in ShardReader(str(data / "sp1")):
        with torch.no_grad():
            ref = encode(_decode(data / "src" / s["meta"]["source"])[None])[0]
        assert s["latent"].shape == ref.shape == (48, 8, 2, 3)
        assert torch.allclose(s["latent"], ref, atol=1e-5, rtol=0)
    vae_halo_probe._HALO_CACHE.clear()
    r = precompute_latents(_config(data), data / "sp2", sp_size=2, log=logs.append)
    cache = json.loads((data / "vae" / vae_halo.HALO_CACHE_FILE).read_text())
    (entry,) = cache.values()
    assert r["halo"] == entry["halo"] > 2
    vae_halo_probe._HALO_CACHE.clear()
    with monkeypatch.context() as m:  # cached: no second probe
        m.setattr(vae_halo_probe, "probe_halo", no_probe)
        logs.clear()
        r2 = precompute_latents(
            _config(data, "vae.halo_latents=2"), data / "h2", sp_size=2, log=logs.append
        )
        precompute_latents(
            _config(data, "vae.halo_latents=2"), data / "h2b", sp_size=2, log=logs.append
        )
    assert r2["halo"] == 2
    warned = [ln for ln in logs if "is below the exact halo" in ln]
    assert len(warned) == 1 and f"exact halo ({entry['halo']})" in warned[0], logs
    err = float(warned[0].split("by up to ")[1].split(" ")[0])
    assert err > 1e-6
    for s in ShardReader(str(data / "sp2")):
        assert s["latent"].shape == (48, 8, 2, 3) and s["meta"]["halo_latents"] == entry["halo"]
    # a halo longer than the clip is legal: the window starts at frame 0
    r3 = precompute_latents(_config(data, "vae.halo_latents=100"), data / "h100", sp_size=2)
    assert r3["samples"] == 2 and r3["halo"] == 100
    ref = {s["key"]: s["latent"] for s in ShardReader(str(data / "sp1"))}
    for out in ("sp2", "h100"):  # the exact halo or more (8 latents): the full encoding
        for s in ShardReader(str(data / out)):
            assert torch.allclose(s["latent"], ref[s["key"]], atol=1e-5, rtol=0)
    print(f"Wan 2.2 tiny: exact halo {entry['halo']}; halo 2 costs {err:.3g} max abs")


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            ["data.height=40"],
            r"data.height \(40\) must be divisible by the VAE's spatial stride 16",
        ),
        (["data.num_frames=30"], r"data.num_frames \(30\) must be 1 \+ 4k"),
        (["vae.halo_latents=soon"], r"vae.halo_latents \('soon'\) must be 'auto' or an integer"),
        (["vae.halo_latents=-1"], r"vae.halo_latents \(-1\) must be an integer >= 0"),
        (["vae.latent_channels=16"], r"vae.latent_channels \(16\) must equal the VAE's latent"),
    ],
)
def test_precompute_refuses_a_mismatch(data, extra, match):
    from megatron_video.training.precompute import precompute_latents

    with pytest.raises(ValueError, match=match):
        precompute_latents(_config(data, *extra), data / "bad", sp_size=2)
    assert not (data / "bad").exists()


def test_training_reads_wan22_shards_at_the_vae_stride(data, tmp_path):
    """Shards of the Wan 2.2 VAE: training with ``vae.diffusers`` set expects their 16x grid; a
    config without it (8x, the project's VAE) is refused at start-up, naming ``vae.diffusers``."""
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.batches.fixed import FixedBatchMaker
    from megatron_video.training.precompute import precompute_latents

    precompute_latents(_config(data), tmp_path / "shards")
    shards = ["data.source=shards", f"data.shards={tmp_path / 'shards'}"]
    bm = FixedBatchMaker(_config(data, *shards), RankCoords())
    assert (bm.F, bm.h, bm.w) == (8, 2, 3)
    cfg = _config(data, *shards, "vae.diffusers=null")
    with pytest.raises(ValueError, match=r"must be \[8, 4, 6\] .*set vae.diffusers"):
        FixedBatchMaker(cfg, RankCoords())
