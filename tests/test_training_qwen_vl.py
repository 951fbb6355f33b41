"""The ``qwen_vl`` family trained by ``megatron-video train`` (``examples/configs/qwen_vl.yaml``).

* a ``video_qa`` sample written as the Qwen2.5-VL processor writes it: the placeholders expanded
  between ``<vision_start>`` / ``<vision_end>``, the answer label one slot after the ``?``, the frames
  patchified in the processor's order (an odd frame count repeats the last frame);
* the example validates for its 4-rank launch;
* steps of the trainer on 4 gloo ranks (CP = 4 as U2 x R2 with MM-SP: each rank encodes its share
  of the temporal patches) give finite losses that fall.
"""

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "examples" / "configs" / "qwen_vl.yaml"


def test_validate_the_7b_config_in_process(capsys, monkeypatch):
    """``megatron-video validate`` of examples/configs/full/qwen2.5_vl_7b.yaml at 16 ranks (TP 4 x
    ring 4) on this CPU machine; its sizes must agree with its config.json, naming the field, and
    ``model.hf_config`` must name a Qwen2.5-VL config."""
    from megatron_video.training.cli import main

    monkeypatch.chdir(ROOT)
    argv = ["validate", "--config", "examples/configs/full/qwen2.5_vl_7b.yaml", "--nproc", "16"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "hidden_size: 3584" in out and "num_frames: 256" in out and "bf16: true" in out
    assert main(argv + ["model.ffn_hidden_size=4096"]) == 2
    err = capsys.readouterr().err
    assert "model.ffn_hidden_size (4096) must equal model.hf_config's (18944" in err, err
    wan = str(ROOT / "examples" / "configs" / "full" / "wan2.2_vae")
    assert main(argv + [f"model.hf_config={wan}"]) == 2
    err = capsys.readouterr().err
    assert f"model.hf_config ('{wan}') must be a Qwen2.5-VL config (model_type" in err, err
    assert main(argv + ["model.family=video_llava", "model.num_layers=2"]) == 2
    assert "model.hf_config (" in capsys.readouterr().err


def test_qwen_sample_layout():
    from megatron_video.data.video_qa import VideoQADataset
    from megatron_video.training.families import qwen_vl as F

    x = VideoQADataset(3, num_frames=9, height=16, width=8, seed=0)[1]
    ids, pv, grid, labels = F.to_qwen_sample(x)
    assert grid.tolist() == [5, 4, 2]
    n = 5 * 4 * 2 // 4
    assert ids[0] == F.START_ID and (ids[1 : 1 + n] == F.VIDEO_ID).all() and ids[1 + n] == F.END_ID
    (at,) = torch.nonzero(labels != -100).flatten().tolist()
    assert labels[at] == x["answer_id"] and ids[at - 1] == x["input_ids"][x["loss_mask"] > 0]
    # processor order: row (t, merged row, merged col, r, c) holds frames [2t, 2t+1] of the patch
    frames = torch.cat([x["frames"], x["frames"][-1:]])
    t, i, j, r, c = 4, 1, 0, 1, 1
    row = ((t * 2 + i) * 1 + j) * 4 + r * 2 + c
    want = frames[2 * t : 2 * t + 2, :, (2 * i + r) * 4 : (2 * i + r + 1) * 4, c * 4 : c * 4 + 4]
    assert torch.equal(pv[row], want.permute(1, 0, 2, 3).flatten())


def test_example_config_validates():
    from megatron_video.training.config import load_config, validate

    cfg = load_config(str(YAML))
    validate(cfg, 4)
    assert cfg.model.family == "qwen_vl" and cfg.objective == "lm"


def _train(tmp):
    import warnings

    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    overrides = ["train.steps=16", "train.warmup_steps=2", "train.progress=false"]
    overrides += ["train.tensorboard=false", "train.save=false", f"output={tmp}/run"]
    t = Trainer(load_config(str(YAML), overrides), progress=False)
    try:
        metrics = t.run()
        b = t.model.last_mmsp_batch
        units = int(b.shards.local_units(t.cp_rank).numel())
        return (metrics if t.is_logger else None), units, b.shards.total_units
    finally:
        t.close()


def test_qwen_vl_trains_with_falling_loss(pool4, tmp_path):
    res = pool4.run(_train, str(tmp_path))
    metrics = res[0][0]
    losses = [h["loss"] for h in metrics["history"]]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    assert metrics["parallel"]["cp"] == 4 and metrics["vae"] is None
    # stage 1: the micro-batch's temporal patches (4 videos x 5) split over the 4 CP ranks
    assert sum(r[1] for r in res) == res[0][2] == 20 and max(r[1] for r in res) < 20


def test_patch_order_is_the_hf_processors():
    """transformers' own ``Qwen2VLImageProcessor`` (no resize / rescale / normalisation) on one
    frame: it repeats the frame to the temporal patch, as ``patchify`` does for an odd count."""
    from transformers import Qwen2VLImageProcessor

    from megatron_video.training.families.qwen_vl import patchify

    frame = torch.rand(1, 3, 16, 8, generator=torch.Generator().manual_seed(0))
    proc = Qwen2VLImageProcessor(
        patch_size=4,
        temporal_patch_size=2,
        merge_size=2,
        do_resize=False,
        do_rescale=False,
        do_normalize=False,
        do_convert_rgb=False,
    )
    out = proc(images=[frame[0].numpy()], return_tensors="pt", input_data_format="channels_first")
    assert out["image_grid_thw"].tolist() == [[1, 4, 2]]
    assert torch.allclose(out["pixel_values"].float(), patchify(frame), atol=1e-6)
