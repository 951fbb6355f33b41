"""Wan weights in and out: diffusers folder -> Megatron dist-checkpoint -> diffusers folder is
bit-identical and loads in ``WanTransformer3DModel.from_pretrained``; bad keys, shapes and config
fields are refused by name; keys diffusers ignores are ignored; the mapping covers exactly
diffusers' keys for every config variant."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from safetensors.torch import load_file, save_file  # noqa: E402

from megatron_video.models.wan.convert import checkpoint_to_diffusers, diffusers_to_checkpoint  # noqa: E402


def _model(**extra):
    from diffusers import WanTransformer3DModel

    from megatron_video.testing.wan import TINY_WAN

    torch.manual_seed(0)
    return WanTransformer3DModel(**{**TINY_WAN, **extra})


I2V = dict(image_dim=24, added_kv_proj_dim=64)


def _folder(tmp_path, model, name="src", **save):
    path = tmp_path / name
    model.save_pretrained(path, safe_serialization=True, **save)
    return path


def _load_pretrained(path, monkeypatch):
    """``from_pretrained``; diffusers 0.42 needs ``accelerate`` (not in our pins) to keep its fp32
    modules, so that is switched off here (it only changes dtypes, never names or values)."""
    from diffusers import WanTransformer3DModel

    monkeypatch.setattr(WanTransformer3DModel, "_keep_in_fp32_modules", None)
    return WanTransformer3DModel.from_pretrained(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_identical_and_loads_in_diffusers(tmp_path, monkeypatch, dtype):
    model = _model(**I2V).to(dtype)
    src = _folder(tmp_path, model, max_shard_size="60KB")  # a sharded index folder
    assert list(src.glob("*.index.json"))
    step_dir = diffusers_to_checkpoint(src, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert step_dir.name == "iter_0000000" and (step_dir / "manifest.json").is_file()
    back = checkpoint_to_diffusers(tmp_path / "ckpt", tmp_path / "back")
    a, b = model.state_dict(), load_file(str(back / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    loaded = _load_pretrained(back, monkeypatch).to(dtype)
    for (n, p), (m, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n == m and torch.equal(p, q), n


def test_keys_diffusers_ignores_are_ignored(tmp_path):
    src = _folder(tmp_path, _model(**I2V))
    f = next(src.glob("*.safetensors"))
    sd = load_file(str(f))
    sd["blocks.0.attn2.norm_added_q.weight"] = torch.ones(64)  # some I2V checkpoints have it
    save_file(sd, str(f))
    diffusers_to_checkpoint(src, tmp_path / "ckpt")
    back = checkpoint_to_diffusers(tmp_path / "ckpt", tmp_path / "back")
    assert "blocks.0.attn2.norm_added_q.weight" not in load_file(
        str(back / "diffusion_pytorch_model.safetensors")
    )


def _edit(src, fn):
    f = next(src.glob("*.safetensors"))
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f))


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda sd: sd.__setitem__("blocks.0.attn1.extra.weight", torch.ones(2)),
            "unknown key 'blocks.0.attn1.extra.weight'",
        ),
        (lambda sd: sd.pop("blocks.1.ffn.net.2.bias"), "missing key 'blocks.1.ffn.net.2.bias'"),
        (
            lambda sd: sd.__setitem__("proj_out.bias", torch.ones(3)),
            "key 'proj_out.bias' has shape",
        ),
    ],
)
def test_bad_weights_are_refused_by_key(tmp_path, edit, match):
    src = _folder(tmp_path, _model())
    _edit(src, edit)
    with pytest.raises(ValueError, match=match):
        diffusers_to_checkpoint(src, tmp_path / "ckpt")


def test_bad_config_and_pickles_are_refused(tmp_path):
    src = _folder(tmp_path, _model())
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "window_size": [4, 4]}))
    with pytest.raises(ValueError, match="config key 'window_size'"):
        diffusers_to_checkpoint(src, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="tensor_model_parallel_size \\(3\\)"):
        diffusers_to_checkpoint(_folder(tmp_path, _model(), "ok"), tmp_path / "c2", 3)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((src / "config.json").read_text())
    (pickled / "diffusion_pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="pickled weights are refused"):
        diffusers_to_checkpoint(pickled, tmp_path / "c3")


def test_checkpoint_config_must_match_its_weights(tmp_path):
    diffusers_to_checkpoint(_folder(tmp_path, _model()), tmp_path / "ckpt")
    meta_file = tmp_path / "ckpt" / "iter_0000000" / "diffusers_config.json"
    meta = json.loads(meta_file.read_text())
    meta["diffusers_config"]["ffn_dim"] = 128
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="differ from manifest.json"):
        checkpoint_to_diffusers(tmp_path / "ckpt", tmp_path / "back")
    from megatron_video.models.wan.convert import _manifest

    path = meta_file.parent
    (path / "manifest.json").write_text(json.dumps({"files": _manifest(path)}))
    with pytest.raises(
        ValueError,
        match=r"key 'decoder\.layers\.mlp\.linear_fc1.*\(config does "
        r"not match",
    ):
        checkpoint_to_diffusers(tmp_path / "ckpt", tmp_path / "back")


@pytest.mark.parametrize(
    "extra",
    [{}, I2V, dict(I2V, pos_embed_seq_len=10), dict(cross_attn_norm=False)],
    ids=["t2v", "i2v", "flf2v", "no_cross_attn_norm"],
)
def test_mapping_covers_diffusers_keys_both_ways(extra):
    from megatron_video.models.wan.config import WanConfig
    from megatron_video.models.wan.interop import full_diffusers_config
    from megatron_video.models.wan.mapping import mapping_table, to_diffusers, to_megatron

    model = _model(**extra)
    full = full_diffusers_config(dict(model.config))
    cfg = WanConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        kv_channels=16,
        ffn_hidden_size=96,
        patch_size=(1, 2, 2),
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        cross_attn_norm=full["cross_attn_norm"],
        image_dim=full["image_dim"],
        added_kv_proj_dim=full["added_kv_proj_dim"],
        pos_embed_seq_len=full["pos_embed_seq_len"],
    )
    sd = model.state_dict()
    assert sorted(k for e in mapping_table(cfg) for k in e.diffusers) == sorted(sd)
    ours = to_megatron(sd, cfg, full)
    back = to_diffusers(ours, cfg, full, {k: tuple(v.shape) for k, v in ours.items()})
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
