"""The ``video_llava`` family: a tiny vision-language model trained by ``megatron-video train``.

* ``data.video_qa``: the question's answer is the video's attribute and the only loss position;
* ``examples/configs/video_llava.yaml`` validates for its 4-rank launch;
* 40 steps of the trainer on 4 gloo ranks (CP = 4 as U2 x R2, MM-SP: every rank encodes its share
  of the frames) give finite losses that fall; no VAE is trained or loaded.
"""
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "examples" / "configs" / "video_llava.yaml"


def test_video_qa_samples():
    from megatron_video.data.synthetic import sample_attributes
    from megatron_video.data.video_qa import IMAGE_TOKEN_INDEX, QA_VOCAB, QUESTIONS, VideoQADataset

    d = VideoQADataset(6, num_frames=5, height=16, width=16, seed=3)
    for i in range(6):
        x = d[i]
        attrs = sample_attributes(3, i, num_frames=5, height=16, width=16)
        question, field = QUESTIONS[i % 3]
        assert x["question"] == question and x["answer"] == getattr(attrs, field)
        assert x["frames"].shape == (5, 3, 16, 16) and x["input_ids"][0] == IMAGE_TOKEN_INDEX
        (pos,) = torch.nonzero(x["loss_mask"]).flatten().tolist()
        assert QA_VOCAB[int(x["labels"][pos])] == x["answer"]
        assert QA_VOCAB[int(x["input_ids"][pos])] == "?"


def test_example_config_validates():
    from megatron_video.training.config import load_config, validate

    cfg = load_config(str(YAML))
    validate(cfg, 4)
    assert cfg.model.family == "video_llava" and cfg.objective == "lm"


def _train(tmp):
    import warnings

    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = load_config(str(YAML), ["train.steps=40", "train.progress=false", "train.tensorboard=false",
                                  "train.save=false", f"output={tmp}/run"])
    t = Trainer(cfg, progress=False)
    try:
        assert t.vae is None
        metrics = t.run()
        b = t.model.last_mmsp_batch
        frames = int(b.shards.local_units(t.cp_rank).numel())
        return (metrics if t.is_logger else None), frames, b.shards.total_units
    finally:
        t.close()


def test_video_llava_trains_with_falling_loss(pool4, tmp_path):
    res = pool4.run(_train, str(tmp_path))
    metrics = res[-1][0]
    losses = [h["loss"] for h in metrics["history"]]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.3, losses
    assert metrics["parallel"]["cp"] == 4 and metrics["vae"] is None
    # MM-SP stage 1: the frames of the micro-batch are split over the 4 CP ranks
    assert sum(r[1] for r in res) == res[0][2] and max(r[1] for r in res) < res[0][2]
