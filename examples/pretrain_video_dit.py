"""Megatron-LM entry: megatron_video's models and data plugged into Megatron-LM's ``pretrain()``.

For users who run Megatron-LM (e.g. in the NGC container). Megatron-LM owns the process groups,
the optimizer, the schedule, checkpointing and logging; this file provides the model, dataset and
forward-step providers and the extra flags. The model, sequence layout and objective are those of
``megatron-video train`` (``--video-config`` is the same YAML); the parallel sizes, batch sizes,
seed, precision and sequence length come from Megatron-LM's own flags and must agree with it.

``model_provider`` takes the ``TransformerConfig`` Megatron-LM builds from its command line
(``core_transformer_config_from_args``; or the ``config`` ``get_model`` passes) and adds only the
video fields (``model_factory.video_transformer_config``): ``--normalization``, ``--swiglu``,
recompute, sequence parallel, fp8, ``--init-method-std``, ``--bf16`` ... all reach the model.
``main()`` supports both ``pretrain()`` signatures, by feature detection: ``pretrain(provider,
model_provider, model_type, forward_step, extra_args_provider=...)`` (megatron-core <= 0.17) and
``pretrain(cfg_container, provider, ..., model_provider=...)`` with the container built from
``parse_and_validate_args`` (>= 0.18). On a machine without CUDA pass ``--cpu`` (megatron_video's
CPU mode, docs/architecture.md).

Launch: docs/launch.md holds the launch lines (the ``dit`` block: torchrun, CP 4 as Ulysses 2 x
ring 2, ``--eval-interval`` and what else megatron-core 0.19 requires) and the flags for a machine
without CUDA; tests/test_pretrain_real.py runs those lines as written under the real
``pretrain()``.

``--seq-length`` is the model's token sequence per sample (VideoDiT / ST-DiT / Wan: frames x
height x width tokens; AR DiT / ``wan_ar``: twice that, ``[clean ; noisy]``); ``--num-layers`` /
``--hidden-size`` / ``--num-attention-heads`` (and for Wan ``--ffn-hidden-size``) must match the
YAML (checked). For ``wan`` / ``wan_ar`` Megatron-LM's precision, recompute, parallel and fusion
flags reach the model, Wan's architecture (norms, GELU-tanh, biases) is the YAML's
(``families.wan.WanFamily.megatron_lm_config``). The providers are those of
``megatron_video.training.megatron_lm`` (shared with ``examples/pretrain_video_llava.py``);
``megatron.training`` is imported only when Megatron-LM runs, so they can be imported and tested
without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from megatron_video.training.megatron_lm import (  # noqa: E402
    MegatronLMEntry,
    PositionDataset,
    add_video_args,
    megatron_transformer_config,
    sequence_length,
    train_valid_test_datasets_provider,
)

__all__ = [
    "add_video_args",
    "video_config_from_args",
    "megatron_transformer_config",
    "model_provider",
    "PositionDataset",
    "train_valid_test_datasets_provider",
    "forward_step",
    "sequence_length",
    "run_pretrain",
    "main",
]

ENTRY = MegatronLMEntry(
    "examples/pretrain_video_dit.py", ("video_dit", "stdit", "ar_dit", "wan", "wan_ar")
)
video_config_from_args = ENTRY.video_config_from_args
model_provider = ENTRY.model_provider
forward_step = ENTRY.forward_step
run_pretrain = ENTRY.run_pretrain
main = ENTRY.main

if __name__ == "__main__":
    main()
