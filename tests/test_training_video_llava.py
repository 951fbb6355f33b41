"""The ``video_llava`` family: a tiny vision-language model trained by ``megatron-video train``.

* ``data.video_qa``: the question's answer is the video's attribute and the only loss position;
* ``examples/configs/video_llava.yaml`` validates for its 4-rank launch;
* 40 steps of the trainer on 4 gloo ranks (CP = 4 as U2 x R2, MM-SP: every rank encodes its share
  of the frames) give finite losses that fall; no VAE is trained or loaded.
* the Megatron-LM entry ``examples/pretrain_video_llava.py`` (without Megatron-LM installed): its
  flag checks, and on 4 ranks its ``model_provider`` on a ``TransformerConfig`` built as
  Megatron-LM's CLI would + ``forward_step`` + loss give the trainer's loss for the same batch and
  weights (the ``pretrain()`` call of each signature: ``test_training_run.py``).
"""

import math
from pathlib import Path

import pytest
import torch

from megatron_video.testing.configs import load_example

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
    cfg = load_config(
        str(YAML),
        [
            "train.steps=40",
            "train.progress=false",
            "train.tensorboard=false",
            "train.save=false",
            f"output={tmp}/run",
        ],
    )
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
    metrics = res[0][0]  # rank 0, the logging rank
    losses = [h["loss"] for h in metrics["history"]]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.3, losses
    assert metrics["parallel"]["cp"] == 4 and metrics["vae"] is None
    # MM-SP stage 1: the frames of the micro-batch are split over the 4 CP ranks
    assert sum(r[1] for r in res) == res[0][2] and max(r[1] for r in res) < res[0][2]


# ---------------------------------------------------------------------------------------------
# the Megatron-LM entry (examples/pretrain_video_llava.py)
# ---------------------------------------------------------------------------------------------
def _llava_args(mod, *overrides, **megatron):
    """Megatron-LM's parsed args for the docstring's launch line (the megatron-video flags parsed
    by the entry's own parser; Megatron-LM's set as its parser would)."""
    import argparse

    args = mod.add_video_args(argparse.ArgumentParser()).parse_args(
        ["--video-config", str(YAML), "--video-override", *overrides]
    )
    base = dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
        micro_batch_size=4,
        global_batch_size=4,
        seed=1234,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        ffn_hidden_size=256,
        seq_length=48,
    )
    for k, v in {**base, **megatron}.items():
        setattr(args, k, v)
    return args


def _llava_cli_config():
    """The TransformerConfig core_transformer_config_from_args would build for the launch line of
    examples/pretrain_video_llava.py with ``--init-method-std 0.011 --use-cpu-initialization
    --no-gradient-accumulation-fusion`` (Megatron-LM is not installed here; see README)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=256,
        init_method_std=0.011,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        context_parallel_size=4,
        cp_comm_type="a2a+p2p",
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )


def _entry_vs_trainer(tmp):
    import warnings

    from torch.utils.data import default_collate

    from megatron_video.compat import destroy_model_parallel, initialize_model_parallel
    from megatron_video.parallel.topology import destroy_video_parallel
    from megatron_video.training.config import load_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    # the trainer's loss of step 0 (megatron-video train's objective, schedule and config)
    cfg = load_config(
        str(YAML),
        [
            "train.steps=1",
            "train.progress=false",
            "train.tensorboard=false",
            "train.save=false",
            f"output={tmp}/run",
        ],
    )
    t = Trainer(cfg, progress=False)
    try:
        trainer_loss = t.forward_backward(0)
        weights = {
            k: v.detach().clone()
            for k, v in t.model.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
    finally:
        t.close()
    # the entry: Megatron-LM's CLI config, its providers, the same batch (positions 0..3) and weights
    mod = load_example("pretrain_video_llava")
    vcfg = mod.video_config_from_args(_llava_args(mod), world_size=4)
    initialize_model_parallel(
        tensor_model_parallel_size=1,
        context_parallel_size=4,
        hierarchical_context_parallel_sizes=[2, 2],
    )
    try:
        base = _llava_cli_config()
        model = mod.model_provider(True, True, config=base, video_config=vcfg)
        lm, vision = model.language_model.config, model.vision_model.config
        # Megatron-LM's config is the LLM's unchanged; the encoder's sizes are the YAML's
        assert lm is base and lm.init_method_std == 0.011
        assert (vision.hidden_size, vision.num_layers, vision.params_dtype) == (
            32,
            1,
            torch.float32,
        )
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not [k for k in missing if "_extra_state" not in k] and not unexpected
        train, valid, test = mod.train_valid_test_datasets_provider([8, 0, 0])
        batch = default_collate([train[i] for i in range(4)])
        out, loss_func = mod.forward_step(iter([batch]), model, step=0)
        loss, logs = loss_func(out)
        loss.backward()
        grads = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
        # Megatron-LM's --bf16 reaches the vision encoder and projector too: their Megatron linears
        # take params_dtype as the LLM's do (norms and the patch conv stay fp32 until get_model's
        # Float16Module, in all three alike)
        import dataclasses

        def linear_dtypes(m):
            return {
                n.split(".")[0]: {
                    p.dtype
                    for k, p in m.named_parameters()
                    if k.startswith(n.split(".")[0]) and ".linear_" in k
                }
                for n in ("language_model", "vision_model", "vision_projection")
            }

        half = mod.model_provider(
            True,
            True,
            config=dataclasses.replace(
                base, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16
            ),
        )
        assert half.vision_model.config.bf16 and half.vision_projection.config.bf16
        assert set(map(frozenset, linear_dtypes(half).values())) == {frozenset({torch.bfloat16})}
        assert set(map(frozenset, linear_dtypes(model).values())) == {frozenset({torch.float32})}
        total, count = logs["loss"].tolist()  # Megatron's (sum, count) of the logged loss
        assert count == 1.0
        return trainer_loss, total, grads, len(train), valid
    finally:
        destroy_video_parallel()
        destroy_model_parallel()


def test_megatron_lm_entry_flag_checks():
    mod = load_example("pretrain_video_llava")
    cfg = mod.video_config_from_args(_llava_args(mod), world_size=4)
    p = cfg.parallel
    assert (p.context_parallel_size, p.ulysses_size, p.ring_size) == (4, 2, 2)
    assert mod.sequence_length(cfg) == 48 and cfg.train.micro_batch_size == 4
    bad = [
        (dict(seq_length=45), r"--seq-length \(45\) must be the model's tokens per sample \(48\)"),
        (
            dict(hidden_size=128),
            r"--hidden-size \(128\) must equal the video config's value \(64\)",
        ),
        (
            dict(num_query_groups=4),
            r"--num-query-groups \(4; with --group-query-attention\) must equal",
        ),
        (
            dict(group_query_attention=False),
            r"--num-query-groups \(4; with --group-query-attention\)",
        ),
        (
            dict(ffn_hidden_size=170),
            r"--ffn-hidden-size \(170\) must equal the video config's value "
            r"\(256\)",
        ),
    ]
    for megatron, message in bad:
        with pytest.raises(ValueError, match=message):
            mod.video_config_from_args(_llava_args(mod, **megatron))
    # a TransformerConfig passed by get_model directly is checked too, naming its field and flag
    import dataclasses

    from megatron_video.training.families import get_family

    family = get_family("video_llava")
    base = _llava_cli_config()
    assert family.megatron_lm_config(base, cfg) is base
    with pytest.raises(
        ValueError,
        match=r"TransformerConfig.num_query_groups \(4; --num-query-groups\) "
        r"must equal the video config's value \(2\)",
    ):
        family.megatron_lm_config(dataclasses.replace(base, num_query_groups=4), cfg)
    with pytest.raises(
        ValueError, match=r"base \(dict\) must be a megatron.core TransformerConfig"
    ):
        family.megatron_lm_config({}, cfg)
    args = _llava_args(mod)
    args.video_config = str(ROOT / "examples" / "configs" / "video_dit_cp.yaml")
    with pytest.raises(
        ValueError,
        match=r"model.family \('video_dit'\) must be one of \('video_llava',\) "
        r"for examples/pretrain_video_llava.py",
    ):
        mod.video_config_from_args(args)


def test_megatron_lm_entry_matches_trainer_loss(pool4, tmp_path):
    res = pool4.run(_entry_vs_trainer, str(tmp_path))
    trainer_loss = res[-1][0]  # the last rank (a last pipeline stage)
    assert math.isfinite(trainer_loss)
    for _, entry_loss, grads, n, valid in res:
        assert abs(entry_loss - trainer_loss) < 1e-6 * max(1.0, abs(trainer_loss)), (
            entry_loss,
            trainer_loss,
        )
        assert grads > 0 and n == 8 and valid is None
