"""The ``video_llava`` family: a tiny vision-language model trained with MM-SP on video questions.

``MMSPLLaVAModel`` (``mmsp.factory``) on ``data.video_qa``, no VAE; sizes from the ``model`` section
(vision encoder: one layer of width ``hidden_size / 2``); batches and objective in ``training.vlm``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer import TransformerConfig

from megatron_video.data.video_qa import QA_VOCAB, TEXT_LEN
from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_configs, video_llava_model

from ..config import SPATIAL_STRIDE, Config
from ..family_spec import FamilySpec, SampleLayout, register_family
from ..vlm import LanguageModelObjective, VideoQABatches

__all__ = ["VideoLLaVAFamily", "VIDEO_LLAVA"]


# the vocabulary padded as Megatron-LM pads it (--make-vocab-size-divisible-by): the vocab-parallel
# embedding and output layer split it over any TP up to 64, and its size does not depend on the
# layout (a checkpoint moves between layouts); padded ids are never targets
VOCAB_PAD = 64


def _sizes(config: Config) -> VideoLLaVASizes:
    m, d, p = config.model, config.data, config.parallel
    patch = _patch(config)
    tokens_per_frame = (d.height // patch) * (d.width // patch)
    need = TEXT_LEN - 1 + d.num_frames * tokens_per_frame
    step = 2 * p.context_parallel_size
    return VideoLLaVASizes(
        vocab_size=-(-len(QA_VOCAB) // VOCAB_PAD) * VOCAB_PAD,
        max_sequence_length=-(-need // step) * step,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        vision_layers=1,
        vision_hidden_size=m.hidden_size // 2,
        vision_heads=2,
        img_size=d.height,
        patch_dim=patch,
    )


def _patch(config: Config) -> int:
    """Vision patch side in pixels: one visual token per latent pixel patch, as the video families
    tokenise (``SPATIAL_STRIDE * model.patch_size[1]``)."""
    return SPATIAL_STRIDE * config.model.patch_size[1]


def _cp_comm_type(config: Config) -> str:
    p = config.parallel
    if p.ulysses_size > 1:
        return "a2a+p2p" if p.ring_size > 1 else "a2a"
    return "p2p"


def _mini_batches_fit(config: Config, world_size: int) -> None:
    """GRPO's ``rl.mini_batches`` divide the micro-batches of a DP rank."""
    from ..config import data_parallel_size

    t, k = config.train, config.rl.mini_batches
    dp = data_parallel_size(config, world_size)
    gbs = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * dp
    n_micro, rest = divmod(gbs, t.micro_batch_size * dp)
    if t.objective == "grpo" and not rest and n_micro % k:
        raise ValueError(
            f"rl.mini_batches ({k}) must divide the micro-batches per DP rank ({n_micro} = "
            f"train.global_batch_size {gbs} / (train.micro_batch_size {t.micro_batch_size} x "
            f"DP {dp})): each update takes a whole number of micro-batches"
        )


def _check(config: Config, world_size: int) -> None:
    m, d, p, t = config.model, config.data, config.parallel, config.train
    _mini_batches_fit(config, world_size)
    if d.height != d.width:
        raise ValueError(
            f"data.height ({d.height}) must equal data.width ({d.width}) for "
            f"model.family 'video_llava' (square frames)"
        )
    if m.patch_size[1] != m.patch_size[2]:
        raise ValueError(
            f"model.patch_size ({m.patch_size}) must have equal spatial sides for "
            f"model.family 'video_llava' (square vision patches)"
        )
    if d.num_frames < p.context_parallel_size:
        raise ValueError(
            f"data.num_frames ({d.num_frames}) must be >= "
            f"parallel.context_parallel_size ({p.context_parallel_size}): every CP "
            f"rank encodes frames of every video"
        )
    if (m.hidden_size // 2) % 2:
        raise ValueError(
            f"model.hidden_size ({m.hidden_size}) must be divisible by 4 for "
            f"model.family 'video_llava' (a vision encoder of width hidden_size / 2 "
            f"with 2 heads)"
        )
    if t.sample:
        raise ValueError(
            "train.sample (True) must be false for model.family 'video_llava' (it has no sampler)"
        )
    if d.source != "synthetic":
        raise ValueError(
            f"data.source ({d.source!r}) must be 'synthetic' for model.family 'video_llava'"
        )
    if m.init_from is not None:
        _init_from_dir(m.init_from)


def _init_from_dir(path, example: str = "examples/configs/video_llava.yaml"):
    """``model.init_from``: a ``megatron-video train`` run folder or its ``checkpoints`` folder
    (the newest checkpoint's weights start the model; ``ValueError`` when it holds none, naming
    ``example``, a config whose run makes one)."""
    from pathlib import Path

    from ..checkpoint import latest_step

    folder = Path(path) / "checkpoints" if (Path(path) / "checkpoints").is_dir() else Path(path)
    if latest_step(folder) is None:
        raise ValueError(
            f"model.init_from ({str(path)!r}) must be a megatron-video train run folder or its "
            f"checkpoints folder holding a complete checkpoint (e.g. of {example})"
        )
    return folder


def _check_rl(config: Config) -> None:
    t, p = config.train, config.parallel
    if t.objective != "grpo":
        raise ValueError(
            f"the rl section is read with train.objective 'grpo' (it is {t.objective!r}): set "
            f"train.objective=grpo or leave rl at its defaults"
        )
    if p.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"parallel.pipeline_model_parallel_size ({p.pipeline_model_parallel_size}) must be 1 "
            f"with train.objective 'grpo' (rollouts decode on one stage)"
        )
    if p.fsdp:
        raise ValueError(
            "parallel.fsdp (True) must be false with train.objective 'grpo' (rollouts and the "
            "frame encoding call the model's parts outside FSDP's wrapped forward)"
        )


# precision of the vision encoder and projector: Megatron-LM's (--bf16 / --fp16) via the LLM config
_PRECISION = ("bf16", "fp16", "params_dtype")
_LLM_FIELDS = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("num_query_groups", "--num-query-groups"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("context_parallel_size", "--context-parallel-size"),
)


def _layout_kwargs(config: Config) -> dict:
    """The parallel layout and init keywords of ``mmsp.factory``'s builders."""
    p = config.parallel
    return dict(
        tp=p.tensor_model_parallel_size,
        cp=p.context_parallel_size,
        pp=p.pipeline_model_parallel_size,
        cp_comm_type=_cp_comm_type(config),
        init_std=config.model.init_std,
    )


@dataclass(frozen=True, kw_only=True)
class VideoLLaVAFamily(FamilySpec):
    """``video_llava``: no VAE, its own batches, configs and model builder."""

    needs_vae: bool = False

    def transformer_config(self, config: Config, has_gpu: bool = False):
        return video_llava_configs(_sizes(config), **_layout_kwargs(config), has_gpu=has_gpu)[0]

    def build_model(
        self,
        tcfg,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage=None,
        config: Config = None,
    ):
        """``tcfg`` is the LLM's config; the vision encoder and projector take their sizes from
        ``config`` and their precision from ``tcfg``."""
        model = video_llava_model(
            _sizes(config),
            **_layout_kwargs(config),
            pre_process=pre_process,
            post_process=post_process,
            language_config=tcfg,
            **{k: getattr(tcfg, k) for k in _PRECISION},
        )
        if config is not None and config.model.init_from is not None:  # collective
            from ..checkpoint import load_model_weights

            load_model_weights(_init_from_dir(config.model.init_from), model)
        return model

    def check_rl(self, config: Config) -> None:
        _check_rl(config)

    def megatron_lm_config(self, base, config: Config):
        """The LLM's config is Megatron-LM's own (``base``) unchanged, once its sizes and
        parallel degrees are those of ``config``; the vision fields come from ``config``
        (``build_model``)."""
        if not isinstance(base, TransformerConfig):
            raise ValueError(
                f"base ({type(base).__name__}) must be a megatron.core TransformerConfig"
            )
        ours = self.transformer_config(config)
        for field, flag in _LLM_FIELDS:
            if getattr(base, field) != getattr(ours, field):
                raise ValueError(
                    f"TransformerConfig.{field} ({getattr(base, field)}; {flag}) must "
                    f"equal the video config's value ({getattr(ours, field)})"
                )
        return base

    def check_megatron_lm_args(self, config: Config, args) -> None:
        m = config.model
        groups = (
            getattr(args, "num_query_groups", None)
            if getattr(args, "group_query_attention", False)
            else m.num_attention_heads
        )
        if groups is not None and groups != (m.num_query_groups or m.num_attention_heads):
            raise ValueError(
                f"--num-query-groups ({groups}; with --group-query-attention) must "
                f"equal the video config's model.num_query_groups "
                f"({m.num_query_groups})"
            )
        ffn, ours = getattr(args, "ffn_hidden_size", None), m.ffn_hidden_size or 4 * m.hidden_size
        if ffn is not None and ffn != ours:
            raise ValueError(
                f"--ffn-hidden-size ({ffn}) must equal the video config's value ({ours})"
            )

    def sample_layout(self, config: Config, cp_size: int) -> SampleLayout:
        return SampleLayout(None, None, _sizes(config).max_sequence_length)

    def seq_length(self, config: Config) -> int:
        return _sizes(config).max_sequence_length

    def make_objective(self, config: Config, groups, sample: SampleLayout):
        return LanguageModelObjective(
            groups.cp_group if groups is not None and groups.cp_size > 1 else None
        )

    def make_batches(self, config: Config, **kw) -> VideoQABatches:
        return VideoQABatches(config, kw["coords"].dp_rank, kw["coords"].dp_size)


VIDEO_LLAVA = register_family(
    VideoLLaVAFamily(
        name="video_llava",
        objectives=("lm",),
        check=_check,
        model_fields=("init_from",),
        trainers=(("grpo", "megatron_video.training.grpo:GRPOTrainer"),),
        summary="video-language model (LLaVA) with MM-SP: frames sharded for the encoder, one "
        "all-to-all-v into the LLM's 2D attention",
    )
)
