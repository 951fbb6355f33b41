"""The ``qwen_vl`` family trained by ``megatron-video train`` (``examples/configs/qwen_vl.yaml``).

* a ``video_qa`` sample written as the Qwen2.5-VL processor writes it: the placeholders expanded
  between ``<vision_start>`` / ``<vision_end>``, the answer label one slot after the ``?``, the frames
  patchified in the processor's order (an odd frame count repeats the last frame);
* the example validates for its 4-rank launch;
* steps of the trainer on 4 gloo ranks (CP = 4 as U2 x R2 with MM-SP: each rank encodes its share
  of the temporal patches) give finite losses that fall;
* ``data.source: energon`` (``training/qwen_vl_energon.py``): one step at U2 x R2 from a tiny
  energon dataset, each rank decoding only its temporal patches' frames; a folder whose processor
  or tokenizer does not match the model is refused naming ``model.hf_config``;
* GRPO from the same energon data (``train.objective: grpo``): one step at U2 x R2, the prompts
  the chat-templated questions with their videos, the reward reading each clip's answer text and
  the folder's tokenizer, each rank decoding only its share of each video's frames.
"""

from pathlib import Path

import pytest
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


# -- data.source energon: video QA from a prepared energon dataset (training/qwen_vl_energon.py) --
def _energon_setup(root):
    """Two 30-frame 10 fps 16x16 clips (sampled at 4 fps: 12 frames, 6 temporal patches) and a
    tiny Qwen2.5-VL folder whose tokenizer and processor match the model section."""
    from megatron_video.data.energon_video import prepare_dataset, write_procedural_videos
    from megatron_video.testing.qwen_processor import write_tiny_folder

    paths = write_procedural_videos(root / "src", 2, num_frames=30, height=16, width=16, fps=10)
    prepare_dataset(root / "src", root / "ds")
    texts = [p.with_suffix(".txt").read_text() for p in paths] + ["Describe this video."]
    write_tiny_folder(root / "hf", texts)
    return [
        "data.source=energon",
        f"data.path={root / 'ds'}",
        f"model.hf_config={root / 'hf'}",
        "model.ffn_hidden_size=128",
        "train.micro_batch_size=2",
    ]


@pytest.fixture(scope="module")
def energon_qa(tmp_path_factory):
    """``_energon_setup`` once for the SFT and GRPO steps (neither changes the folders)."""
    return _energon_setup(tmp_path_factory.mktemp("qwen_energon"))


def _train_energon(tmp, overrides):
    import warnings

    from megatron_video.data.qwen_video_qa import QwenVideoQA
    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    overrides = overrides + ["train.steps=1", "train.warmup_steps=0", "train.progress=false"]
    overrides += ["train.tensorboard=false", "train.save=false", f"output={tmp}/run"]
    t = Trainer(load_config(str(YAML), overrides), progress=False)
    try:
        metrics = t.run()
        decoded = t.batches.decoded_frames
        b = t.model.last_mmsp_batch
        mine = b.shards.local_units(b.plan.rank)
        # the rows this rank decoded are the full (CP = 1) samples' rows of the model's units
        qa = QwenVideoQA(t.config.data.path, t.batches.qa.tokenizer, t.batches.proc)
        full = [qa.sample(k)["pixel_values_videos"] for k in t.batches.keys[:2]]
        full = torch.cat(full).reshape(b.shards.total_units, -1, full[0].shape[-1])
        t.batches.qa.decoded_frames = 0
        got = t.batches.micro_batch(0, 0).pixel_values_videos
        same = torch.equal(got, full[mine].reshape(-1, got.shape[-1]))
        return (metrics if t.is_logger else None), decoded, int(mine.numel()), same
    finally:
        t.close()


def test_qwen_vl_trains_from_energon_each_rank_decoding_its_frames(pool4, energon_qa, tmp_path):
    """One step at U2 x R2 from a 2-clip energon dataset: finite loss; every rank's pixel rows are
    the full samples' rows of the temporal patches the model encodes there (the second clip's
    shards rotate), and it decodes at most its share of the source frames."""
    res = pool4.run(_train_energon, str(tmp_path / "w"), energon_qa)
    loss = res[0][0]["history"][0]["loss"]
    assert torch.isfinite(torch.tensor(loss)) and res[0][0]["parallel"]["cp"] == 4
    assert all(r[3] for r in res), [r[3] for r in res]
    assert sorted(r[2] for r in res) == [3, 3, 3, 3]  # 12 temporal patches over 4 ranks
    for _, decoded, units, _ in res:
        # a temporal patch is 2 sampled frames 2.5 source frames apart: at most 6 source frames
        assert 0 < decoded <= units * 6, (decoded, units)
    assert sum(r[1] for r in res) <= 2 * 30  # no frame decoded twice within a clip


def test_qwen_vl_energon_refuses_a_mismatched_folder(tmp_path):
    import json

    from megatron_video.data.qwen_video_qa import plan_video
    from megatron_video.training.config import load_config, validate
    from megatron_video.training.families.qwen_vl import hf_config_of
    from megatron_video.training.qwen_vl_energon import energon_source, max_length

    overrides = _energon_setup(tmp_path)
    cfg = load_config(str(YAML), overrides)
    validate(cfg, 4)
    # the nominal sequence length counted from metadata is the longest sample's
    qa, proc = energon_source(cfg, hf_config_of(cfg))
    lens = [qa.text(plan_video(r, proc), r["caption"])[0].numel() for r in qa.records.values()]
    assert max_length(qa, proc) == max(lens)
    proc = tmp_path / "hf" / "video_preprocessor_config.json"
    good = proc.read_text()
    proc.write_text(json.dumps(dict(json.loads(good), patch_size=8)))
    with pytest.raises(ValueError, match=r"model.hf_config .*processor patch \(8\) must equal"):
        validate(load_config(str(YAML), overrides), 4)
    proc.write_text(good)
    cfg = tmp_path / "hf" / "config.json"
    cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), video_token_id=91)))
    with pytest.raises(ValueError, match=r"model.hf_config .*video_token_id \(91\)"):
        validate(load_config(str(YAML), overrides), 4)


SEEN = []  # (answer, decoded response) of each reward call in this process


def recording_reward(tokens, lengths, answer_id, format_ids, answer, decode, **sample):
    """Records what the trainer hands a text reward; a reward that differs between responses."""
    SEEN.extend((answer, decode(tokens[g, : int(lengths[g])].tolist())) for g in range(len(tokens)))
    return tokens[:, 0].double() / 100


def _grpo_energon(tmp, overrides):
    import warnings

    from megatron_video.layouts.mmsp import frame_shards
    from megatron_video.rl.rewards import resolve_reward
    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    overrides = overrides + ["train.steps=1", "train.progress=false", "train.tensorboard=false"]
    overrides += ["train.save=false", "model.init_from=null", "rl.group_size=2"]
    overrides += ["rl.max_new_tokens=2", "rl.reward=test_training_qwen_vl:recording_reward"]
    grpo = YAML.with_name("qwen_vl_grpo.yaml")
    t = Trainer(load_config(str(grpo), overrides + [f"output={tmp}/grpo"]), progress=False)
    try:
        seen = resolve_reward(t.config.rl.reward).__globals__["SEEN"]
        seen.clear()
        metrics = t.run()
        captions = [t.batches.qa.records[k]["caption"] for k in t.batches.keys]
        units = sum(int(frame_shards([6], 4).local_units(t.cp_rank).numel()) for _ in captions)
        return (
            (metrics if t.is_logger else None),
            t.batches.decoded_frames,
            units,
            list(seen),
            captions,
        )
    finally:
        t.close()


def test_qwen_vl_grpo_from_energon_each_rank_decoding_its_frames(pool4, energon_qa, tmp_path):
    """One GRPO step at U2 x R2 on the 2-clip energon dataset (2 responses each): finite loss; the
    reward gets each clip's caption as ``answer`` and ``decode`` the folder's tokenizer; each rank
    decodes at most its share of each clip's frames (each prompt's video sharded alone)."""
    res = pool4.run(_grpo_energon, str(tmp_path / "w"), energon_qa)
    hist = next(r[0] for r in res if r[0])["history"]
    assert len(hist) == 1 and torch.isfinite(torch.tensor(hist[0]["loss"])), hist
    assert sorted(r[2] for r in res) == [2, 2, 4, 4]  # 6 temporal patches a clip over 4 ranks
    for _, decoded, units, seen, captions in res:
        assert 0 < decoded <= units * 6, (decoded, units)  # 2 sampled frames 2.5 apart a patch
        assert sorted({a for a, _ in seen}) == sorted(captions) and len(seen) == 4, seen
        assert all(isinstance(d, str) for _, d in seen)
    assert sum(r[1] for r in res) <= 2 * 30  # no frame decoded twice within a clip
