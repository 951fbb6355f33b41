"""The ``video_llava`` family: a tiny vision-language model trained with MM-SP on video questions.

``MMSPLLaVAModel`` (``mmsp.factory``: ``FrameViT`` encoder, MLP projector, GPT with 2D attention)
on ``data.video_qa`` (procedural videos, one-word answers). Sizes come from the ``model`` section
(LLM: ``num_layers`` / ``hidden_size`` / ``num_attention_heads`` / ``num_query_groups``; vision
encoder: one layer of width ``hidden_size / 2``, one token per latent-pixel patch of a frame,
``8 * patch_size[1]`` pixels wide); no VAE. The objective is next-token cross-entropy on the answer
token, each CP rank's share normalised over the global number of target tokens
(``mmsp.global_token_loss``) -- the trainer's contract (``training.objectives``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List

import torch

from .config import Config
from .families import FamilySpec, SampleLayout

__all__ = ["VideoQABatch", "VideoQABatches", "LanguageModelObjective", "VideoLLaVAFamily"]


@dataclass
class VideoQABatch:
    images: torch.Tensor        # [b * T, 3, H, W] every frame of the micro-batch (LLaVA's tiles)
    input_ids: torch.Tensor     # [b, TEXT_LEN]
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    num_image_tiles: torch.Tensor  # [b] frames per video


class VideoQABatches:
    """This data-parallel rank's micro-batches (every CP rank of a group gets the same samples;
    ``MMSPLLaVAModel`` encodes only its frames)."""

    def __init__(self, config: Config, dp_rank: int, dp_size: int):
        from megatron_video.data.video_qa import VideoQADataset

        d, t = config.data, config.train
        self.dataset = VideoQADataset(d.num_samples, num_frames=d.num_frames, height=d.height,
                                      width=d.width, seed=d.seed)
        self.dp_rank, self.dp_size, self.micro = dp_rank, dp_size, t.micro_batch_size
        gbs = t.global_batch_size or self.micro * dp_size
        self.num_microbatches = gbs // (self.micro * dp_size)

    def micro_batch(self, step: int, m: int) -> VideoQABatch:
        base = ((step * self.num_microbatches + m) * self.dp_size + self.dp_rank) * self.micro
        return self.from_positions([base + j for j in range(self.micro)])

    def from_positions(self, positions: List[int], step: int = 0) -> VideoQABatch:
        """The micro-batch of the samples at ``positions`` (the Megatron-LM entry's data path;
        ``step`` is unused: a sample does not depend on it)."""
        items = [self.dataset[int(i) % len(self.dataset)] for i in positions]
        ids = torch.stack([x["input_ids"] for x in items])
        return VideoQABatch(
            images=torch.cat([x["frames"] for x in items]), input_ids=ids,
            position_ids=torch.arange(ids.shape[1])[None].expand_as(ids).contiguous(),
            labels=torch.stack([x["labels"] for x in items]),
            loss_mask=torch.stack([x["loss_mask"] for x in items]),
            num_image_tiles=torch.tensor([x["frames"].shape[0] for x in items], dtype=torch.int))

    def step_batches(self, step: int) -> Iterator[VideoQABatch]:
        return iter([self.micro_batch(step, m) for m in range(self.num_microbatches)])

    def data_state(self) -> None:
        """Stateless resume (as ``data.BatchMaker`` for the procedural source): a micro-batch is a
        pure function of ``(data.seed, step, micro-batch, dp rank)``, so a run resumed at step
        ``k`` sees exactly the batches an uninterrupted one would; nothing to checkpoint."""
        return None

    def restore_data_state(self, text) -> None:
        if text is not None:
            raise ValueError("checkpoint holds a data-loader state; video_llava's video_qa source "
                             "is stateless (VideoQABatches.data_state) and cannot take one")


class LanguageModelObjective:
    """Cross-entropy on the answer tokens; the model returns ``(per-token loss, local loss mask)``."""

    def __init__(self, cp_group):
        self.cp_group = cp_group

    def model_call(self, mb: VideoQABatch, first_stage: bool):
        args = (mb.images, mb.input_ids, mb.position_ids, None)
        return args, dict(labels=mb.labels, loss_mask=mb.loss_mask, num_image_tiles=mb.num_image_tiles)

    def loss(self, output: torch.Tensor, mb: VideoQABatch, loss_mask: torch.Tensor) -> torch.Tensor:
        from megatron_video.mmsp import global_token_loss

        return global_token_loss(output.float(), loss_mask, self.cp_group)


def _sizes(config: Config):
    from megatron_video.data.video_qa import QA_VOCAB, TEXT_LEN
    from megatron_video.mmsp.factory import VideoLLaVASizes

    m, d, p = config.model, config.data, config.parallel
    patch = _patch(config)
    tokens_per_frame = (d.height // patch) * (d.width // patch)
    need = TEXT_LEN - 1 + d.num_frames * tokens_per_frame
    step = 2 * p.context_parallel_size
    return VideoLLaVASizes(
        vocab_size=len(QA_VOCAB), max_sequence_length=-(-need // step) * step,
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        vision_layers=1, vision_hidden_size=m.hidden_size // 2, vision_heads=2, img_size=d.height,
        patch_dim=patch)


def _patch(config: Config) -> int:
    """Vision patch side in pixels: one visual token per latent pixel patch, as the video families
    tokenise (``SPATIAL_STRIDE * model.patch_size[1]``)."""
    from .config import SPATIAL_STRIDE

    return SPATIAL_STRIDE * config.model.patch_size[1]


def _cp_comm_type(config: Config) -> str:
    p = config.parallel
    return "a2a+p2p" if p.ulysses_size > 1 and p.ring_size > 1 else "a2a" if p.ulysses_size > 1 else "p2p"


def _check(config: Config, world_size: int) -> None:
    m, d, p, t = config.model, config.data, config.parallel, config.train
    if d.height != d.width:
        raise ValueError(f"data.height ({d.height}) must equal data.width ({d.width}) for model.family "
                         f"'video_llava' (square frames)")
    if m.patch_size[1] != m.patch_size[2]:
        raise ValueError(f"model.patch_size ({m.patch_size}) must have equal spatial sides for "
                         f"model.family 'video_llava' (square vision patches)")
    if d.num_frames < p.context_parallel_size:
        raise ValueError(f"data.num_frames ({d.num_frames}) must be >= parallel.context_parallel_size "
                         f"({p.context_parallel_size}): every CP rank encodes frames of every video")
    if (m.hidden_size // 2) % 2:
        raise ValueError(f"model.hidden_size ({m.hidden_size}) must be divisible by 4 for model.family "
                         f"'video_llava' (a vision encoder of width hidden_size / 2 with 2 heads)")
    if t.sample:
        raise ValueError("train.sample (True) must be false for model.family 'video_llava' (it has no "
                         "sampler)")
    if d.source != "synthetic":
        raise ValueError(f"data.source ({d.source!r}) must be 'synthetic' for model.family 'video_llava'")


@dataclass(frozen=True)
class VideoLLaVAFamily(FamilySpec):
    """``video_llava``: no VAE, its own batches, configs and model builder."""

    needs_vae: bool = False

    def transformer_config(self, config: Config, has_gpu: bool = False):
        from megatron_video.mmsp.factory import video_llava_configs

        p = config.parallel
        return video_llava_configs(_sizes(config), tp=p.tensor_model_parallel_size,
                                   cp=p.context_parallel_size, pp=p.pipeline_model_parallel_size,
                                   cp_comm_type=_cp_comm_type(config), init_std=config.model.init_std,
                                   has_gpu=has_gpu)[0]

    def build_model(self, tcfg, pre_process: bool = True, post_process: bool = True, vp_stage=None,
                    config: Config = None):
        """``tcfg`` is the LLM's config; the vision encoder and projector take their sizes from
        ``config`` and their precision from ``tcfg``."""
        from megatron_video.mmsp.factory import video_llava_model

        p = config.parallel
        return video_llava_model(_sizes(config), tp=p.tensor_model_parallel_size,
                                 cp=p.context_parallel_size, pp=p.pipeline_model_parallel_size,
                                 cp_comm_type=_cp_comm_type(config), init_std=config.model.init_std,
                                 pre_process=pre_process, post_process=post_process,
                                 language_config=tcfg, **{k: getattr(tcfg, k) for k in _PRECISION})

    def megatron_lm_config(self, base, config: Config):
        """The LLM's config is Megatron-LM's own (``base``) unchanged, once its sizes and parallel
        degrees are those of ``config``; the vision fields come from ``config`` (``build_model``)."""
        from megatron.core.transformer import TransformerConfig

        if not isinstance(base, TransformerConfig):
            raise ValueError(f"base ({type(base).__name__}) must be a megatron.core TransformerConfig")
        ours = self.transformer_config(config)
        for field, flag in _LLM_FIELDS:
            if getattr(base, field) != getattr(ours, field):
                raise ValueError(f"TransformerConfig.{field} ({getattr(base, field)}; {flag}) must "
                                 f"equal the video config's value ({getattr(ours, field)})")
        return base

    def check_megatron_lm_args(self, config: Config, args) -> None:
        m = config.model
        groups = (getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False)
                  else m.num_attention_heads)
        if groups is not None and groups != (m.num_query_groups or m.num_attention_heads):
            raise ValueError(f"--num-query-groups ({groups}; with --group-query-attention) must equal "
                             f"the video config's model.num_query_groups ({m.num_query_groups})")
        ffn, ours = getattr(args, "ffn_hidden_size", None), m.ffn_hidden_size or 4 * m.hidden_size
        if ffn is not None and ffn != ours:
            raise ValueError(f"--ffn-hidden-size ({ffn}) must equal the video config's value ({ours})")

    def sample_layout(self, config: Config, cp_size: int) -> SampleLayout:
        return SampleLayout(None, None, _sizes(config).max_sequence_length)

    def seq_length(self, config: Config) -> int:
        return _sizes(config).max_sequence_length

    def make_objective(self, config: Config, groups, sample: SampleLayout):
        return LanguageModelObjective(groups.cp_group if groups is not None and groups.cp_size > 1
                                      else None)

    def make_batches(self, config: Config, **kw) -> VideoQABatches:
        return VideoQABatches(config, kw["dp_rank"], kw["dp_size"])


# precision of the vision encoder and projector: Megatron-LM's (--bf16 / --fp16) via the LLM config
_PRECISION = ("bf16", "fp16", "params_dtype")
_LLM_FIELDS = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
               ("num_attention_heads", "--num-attention-heads"),
               ("num_query_groups", "--num-query-groups"), ("ffn_hidden_size", "--ffn-hidden-size"),
               ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
               ("context_parallel_size", "--context-parallel-size"))


def _llava():
    from megatron_video.mmsp.llava import MMSPLLaVAModel
    return MMSPLLaVAModel


VIDEO_LLAVA = VideoLLaVAFamily("video_llava", "full", ("lm",), False, _llava, _check,
                               "video-language model (LLaVA) with MM-SP: frames sharded for the encoder, "
                               "one all-to-all-v into the LLM's 2D attention")
FAMILY_LIST: List[FamilySpec] = [VIDEO_LLAVA]
