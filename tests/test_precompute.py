"""`megatron-video precompute`: an energon dataset -> latent shards (SP-folded halo windows), read
back weights-only and used by training's shard source."""

import io
import tarfile

import pytest
import torch

from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos
from megatron_video.data.shards import ShardReader
from megatron_video.models.vae import CausalVideoVAE
from megatron_video.training.batches import RankCoords
from megatron_video.training.batches.fixed import FixedBatchMaker
from megatron_video.training.config import load_config
from megatron_video.training.precompute import precompute_latents


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("precompute")
    write_procedural_videos(root / "src", 3, num_frames=29, height=32, width=32, seed=2)
    prepare_dataset(root / "src", root / "ds")
    torch.manual_seed(0)
    vae = CausalVideoVAE(3, 4, 8)
    torch.save(
        {
            "state_dict": vae.state_dict(),
            "latent_scale": 0.5,
            "key": {"latent_channels": 4, "base_channels": 8},
        },
        root / "vae.pt",
    )
    cfg = load_config(
        None,
        [
            f"data.path={root / 'ds'}",
            "data.source=energon",
            f"vae.weights={root / 'vae.pt'}",
            "vae.base_channels=8",
            "vae.latent_channels=4",
        ],
    )
    return root, cfg, vae.eval()


def _decode(path):
    import av

    with av.open(str(path)) as c:
        x = torch.stack([torch.from_numpy(f.to_ndarray(format="rgb24")) for f in c.decode(video=0)])
    return (x.float() / 127.5 - 1).permute(3, 0, 1, 2)


@pytest.mark.parametrize("sp", [1, 4])
def test_precomputed_latents_equal_full_encoding(setup, sp):
    root, cfg, vae = setup
    out = root / f"lat{sp}"
    r = precompute_latents(cfg, out, sp_size=sp)
    assert r["samples"] == 3 and r["skipped"] == 0
    got = {s["meta"]["source"]: s for s in ShardReader(str(out))}
    assert len(got) == 3
    for src, s in got.items():
        with torch.no_grad():
            ref = vae.encode(_decode(root / "src" / src)[None])[0]
        assert s["latent"].shape == (4, 8, 4, 4)
        assert torch.allclose(s["latent"], ref, atol=1e-5, rtol=0)  # float32, SP-folded windows
        assert (
            s["meta"]["sp_size"] == sp
            and s["caption"] == (root / "src" / src).with_suffix(".txt").read_text()
        )
    # training reads the form: the shard source keeps this rank's latent frames, scaled
    tcfg = load_config(
        None,
        [
            "data.source=shards",
            f"data.shards={out}",
            f"vae.weights={root / 'vae.pt'}",
            "vae.base_channels=8",
            "vae.latent_channels=4",
            "train.micro_batch_size=1",
        ],
    )
    bm = FixedBatchMaker(tcfg, RankCoords(), latent_scale=0.5)
    mb = next(bm.step_batches(0))
    assert mb.clean is not None and torch.isfinite(mb.clean).all()


def test_latent_pth_entries_are_weights_only(setup, tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"latent": torch.zeros(1), "x": Evil()}, buf)
    shard = tmp_path / "evil.tar"
    with tarfile.open(shard, "w") as tf:
        for name, data in (("k.latent.pth", buf.getvalue()), ("k.caption.txt", b"a")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match="weights-only torch file"):
        list(ShardReader(str(shard)))
