"""Megatron-LM entry for the vision-language family: ``MMSPLLaVAModel`` trained by ``pretrain()``.

For users who run Megatron-LM (e.g. in the NGC container). Megatron-LM owns the process groups,
the optimizer, the schedule, checkpointing and logging; this file provides the model, dataset and
forward-step providers and the extra flags. The model (``MMSPLLaVAModel``: ``FrameViT`` encoder,
MLP projector, GPT with 2D attention; MM-SP shards every video's frames over the CP group for the
encoder and moves the visual tokens into the LLM's zigzag layout with one all-to-all-v), the data
(``data.video_qa``) and the objective (answer-token cross-entropy over the global token count) are
those of ``megatron-video train`` with the ``video_llava`` family (``--video-config`` is the same
YAML); the parallel sizes, batch sizes, seed, precision and sequence length come from Megatron-LM's
own flags and must agree with it (``ValueError`` naming the flag).

``model_provider`` takes the ``TransformerConfig`` Megatron-LM builds from its command line
(``core_transformer_config_from_args``; or the ``config`` ``get_model`` passes) as the LLM's
config, unchanged once its sizes match the YAML (``--num-layers``, ``--hidden-size``,
``--num-attention-heads``, ``--num-query-groups`` with ``--group-query-attention``,
``--ffn-hidden-size``); the vision encoder and projector take their sizes from the YAML and their
precision from Megatron-LM's ``--bf16`` / ``--fp16``. ``forward_step`` splits LLaVA's
``(per-token loss, loss mask)`` return and hands the mask to the loss. ``main()`` supports both
``pretrain()`` signatures by feature detection (``megatron_video.training.megatron_lm.run_pretrain``,
shared with ``examples/pretrain_video_dit.py``). On a machine without CUDA pass ``--cpu``.

Launch: docs/launch.md holds the launch lines (the ``llava`` block: torchrun, CP 4 as Ulysses 2 x
ring 2, ``--eval-interval`` and what else megatron-core 0.19 requires) and the flags for a machine
without CUDA; tests/test_pretrain_real.py runs those lines as written under the real
``pretrain()``.

``--seq-length`` is the LLM's sequence per sample: text plus visual tokens, padded to a multiple
of 2 x CP (``VideoLLaVAFamily.seq_length``; 48 for examples/configs/video_llava.yaml).
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

ENTRY = MegatronLMEntry("examples/pretrain_video_llava.py", ("video_llava",))
video_config_from_args = ENTRY.video_config_from_args
model_provider = ENTRY.model_provider
forward_step = ENTRY.forward_step
run_pretrain = ENTRY.run_pretrain
main = ENTRY.main

if __name__ == "__main__":
    main()
