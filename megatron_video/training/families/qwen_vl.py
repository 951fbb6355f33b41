"""The ``qwen_vl`` family: a tiny random Qwen2.5-VL trained with MM-SP on video questions.

``mmsp.qwen_vl.MMSPQwenVLModel`` (Megatron ``GPTModel`` with M-RoPE + transformers' vision tower)
on ``data.video_qa`` or, with ``data.source: energon``, video QA from an energon dataset
(``training/qwen_vl_energon.py``: the ``model.hf_config`` folder's tokenizer and processor, each CP
rank decoding only its frames); no VAE. Sizes: the LLM from the ``model`` section; the vision tower depth 2,
width ``hidden_size / 2``, 4-pixel patches, temporal patch 2, 2x2 merger. With
``model.hf_config`` (a Qwen2.5-VL ``config.json``, e.g. the published 7B's) every shape comes
from that file instead (the model section's sizes must agree; the patch sizes and special tokens
are the file's). Each sample is written
as the HF processor writes it (``to_qwen_sample``): ``<vision_start>``, the expanded video
placeholders, ``<vision_end>``, the question; the frames patchified in the processor's order.
Supervised or GRPO (``train.objective: grpo``, ``training.grpo``); ``model.init_from`` (a run
folder) starts the model from a run's newest checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from megatron_video.data.video_qa import QA_VOCAB, TEXT_LEN

from ..config import Config
from ..family_spec import FamilySpec, SampleLayout, register_family
from ..vlm import LanguageModelObjective, VideoQABatches

__all__ = ["QwenVLFamily", "QWEN_VL", "hf_config_of", "to_qwen_sample"]

VOCAB_PAD = 64
PATCH, TEMPORAL, MERGE = 4, 2, 2
# special tokens after the QA words: image, video, vision start, vision end
IMAGE_ID, VIDEO_ID, START_ID, END_ID = (len(QA_VOCAB) + i for i in range(4))


@dataclass(frozen=True)
class Geometry:
    """The processor's numbers: patch, temporal patch, merge; the video and vision start / end
    token ids."""

    patch: int = PATCH
    temporal: int = TEMPORAL
    merge: int = MERGE
    video_id: int = VIDEO_ID
    start_id: int = START_ID
    end_id: int = END_ID


def geometry_of(config: Config) -> Geometry:
    if config.model.hf_config is None:
        return Geometry()
    hf = hf_config_of(config)
    v = hf.vision_config
    return Geometry(
        v.patch_size,
        v.temporal_patch_size,
        v.spatial_merge_size,
        hf.video_token_id,
        hf.vision_start_token_id,
        hf.vision_end_token_id,
    )


def _load_hf_config(path: str):
    """``model.hf_config``: a Qwen2.5-VL ``config.json`` or its folder (``ValueError`` naming the
    field for anything else)."""
    from pathlib import Path

    from transformers import Qwen2_5_VLConfig

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        import json

        kind = json.loads(file.read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(
            f"model.hf_config ({path!r}) must be a Qwen2.5-VL config.json or its folder ({e})"
        ) from e
    if kind != "qwen2_5_vl":
        raise ValueError(
            f"model.hf_config ({path!r}) must be a Qwen2.5-VL config (model_type 'qwen2_5_vl', "
            f"not {kind!r})"
        )
    return Qwen2_5_VLConfig.from_json_file(str(file))


def hf_config_of(config: Config):
    """The ``Qwen2_5_VLConfig`` of a ``qwen_vl`` training config: ``model.hf_config``'s, or the
    tiny random one from the model section."""
    from transformers import Qwen2_5_VLConfig

    m = config.model
    if m.hf_config is not None:
        return _load_hf_config(m.hf_config)
    half = m.hidden_size // m.num_attention_heads // 2
    t = half // 4
    section = [t, (half - t) // 2, half - t - (half - t) // 2]
    text = dict(
        vocab_size=-(-(len(QA_VOCAB) + 4) // VOCAB_PAD) * VOCAB_PAD,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=section),
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=m.init_std,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    vision = dict(
        depth=2,
        hidden_size=m.hidden_size // 2,
        intermediate_size=m.hidden_size,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        window_size=4 * PATCH * MERGE,
        out_hidden_size=m.hidden_size,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
        initializer_range=m.init_std,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=START_ID,
        vision_end_token_id=END_ID,
        tie_word_embeddings=False,
    )


def patchify(frames: torch.Tensor, geo: Geometry = Geometry()) -> torch.Tensor:
    """``[T, C, H, W]`` -> ``[ceil(T/t) * H/p * W/p, C*t*p*p]`` (``geo``: patch ``p`` = 4,
    temporal ``t`` = 2, merge ``m`` = 2 by default) in the Qwen2-VL processor's order (temporal
    patch, merged row, merged column, row and column inside the m x m block)."""
    P, TP, M = geo.patch, geo.temporal, geo.merge
    if frames.shape[0] % TP:  # as the processor: the last frame repeated
        frames = torch.cat([frames, frames[-1:].expand(TP - 1, *frames.shape[1:])])
    T, C, H, W = frames.shape
    gt, gh, gw = T // TP, H // P, W // P
    x = frames.reshape(gt, TP, C, gh // M, M, P, gw // M, M, P)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, C * TP * P * P)


def to_qwen_sample(item: dict, geo: Geometry = Geometry()):
    """A ``video_qa`` item -> ``(input_ids, pixel_values, grid_thw, hf_labels)``: the image token
    becomes ``<start> video*n <end>``; labels in HF's unshifted convention (one trailing slot)."""
    T, _, H, W = item["frames"].shape
    grid = [-(-T // geo.temporal), H // geo.patch, W // geo.patch]
    n = grid[0] * grid[1] * grid[2] // geo.merge**2
    text = item["input_ids"][1:]
    ids = torch.cat(
        [
            torch.tensor([geo.start_id] + [geo.video_id] * n + [geo.end_id]),
            text,
            torch.zeros(1).long(),
        ]
    )
    labels = torch.full_like(ids, -100)
    off = n + 2  # position of input token i (>= 1) is i - 1 + off; its target sits one later
    mask = item["loss_mask"] > 0
    for i in torch.nonzero(mask).flatten().tolist():
        labels[i - 1 + off + 1] = int(item["labels"][i])
    return ids, patchify(item["frames"], geo), torch.tensor(grid), labels


@dataclass
class QwenVLBatch:
    input_ids: torch.Tensor  # [b, L] placeholders expanded
    pixel_values_videos: torch.Tensor  # [b * t*h*w, C*2*p*p]
    video_grid_thw: torch.Tensor  # [b, 3]
    labels: torch.Tensor  # [b, L] HF convention
    sample_ids: Optional[torch.Tensor] = None


class QwenVLBatches(VideoQABatches):
    """``VideoQABatches`` written as the Qwen2.5-VL processor writes samples."""

    geometry: Geometry = Geometry()

    def from_positions(self, positions: List[int], step: int = 0) -> QwenVLBatch:
        items = [self.dataset[int(i) % len(self.dataset)] for i in positions]
        parts = [to_qwen_sample(x, self.geometry) for x in items]
        return QwenVLBatch(
            input_ids=torch.stack([p[0] for p in parts]),
            pixel_values_videos=torch.cat([p[1] for p in parts]),
            video_grid_thw=torch.stack([p[2] for p in parts]),
            labels=torch.stack([p[3] for p in parts]),
            sample_ids=torch.tensor([int(i) for i in positions]),
        )


class QwenVLObjective(LanguageModelObjective):
    """Cross-entropy on the answer token; the model returns ``(per-token loss, loss mask)``."""

    def model_call(self, mb: QwenVLBatch, first_stage: bool):
        kw = dict(labels=mb.labels)
        if getattr(mb, "second_per_grid_ts", None) is not None:  # energon clips: real timing
            kw["second_per_grid_ts"] = mb.second_per_grid_ts
        return (mb.input_ids, mb.pixel_values_videos, mb.video_grid_thw), kw


def _seq_length(config: Config) -> int:
    d, cp, g = config.data, config.parallel.context_parallel_size, geometry_of(config)
    if d.source == "energon":  # the dataset's longest sample (training/qwen_vl_energon.py)
        from ..qwen_vl_energon import energon_source, max_length

        need = max_length(*energon_source(config, hf_config_of(config)))
        if config.train.objective == "grpo":  # prompt + rl.max_new_tokens (an upper bound)
            need += config.rl.max_new_tokens
        return -(-need // (2 * cp)) * (2 * cp)
    n = -(-d.num_frames // g.temporal) * (d.height // g.patch) * (d.width // g.patch) // g.merge**2
    need = TEXT_LEN - 1 + n + 2 + 1
    return -(-need // (2 * cp)) * (2 * cp)


def _cp_comm_type(config: Config) -> str:
    p = config.parallel
    if p.ulysses_size > 1:
        return "a2a+p2p" if p.ring_size > 1 else "a2a"
    return "p2p"


def _check_hf_config(config: Config) -> None:
    """``model.hf_config``: the model section's sizes must be the file's."""
    m = config.model
    t = hf_config_of(config).text_config
    want = dict(
        num_layers=t.num_hidden_layers,
        hidden_size=t.hidden_size,
        num_attention_heads=t.num_attention_heads,
        num_query_groups=t.num_key_value_heads,
        ffn_hidden_size=t.intermediate_size,
    )
    for name, value in want.items():
        if getattr(m, name) != value:
            raise ValueError(
                f"model.{name} ({getattr(m, name)!r}) must equal model.hf_config's ({value}, "
                f"{m.hf_config})"
            )


def _check(config: Config, world_size: int) -> None:
    from .video_llava import _init_from_dir, _mini_batches_fit  # here: the registration order

    m, d, p, t = config.model, config.data, config.parallel, config.train
    _mini_batches_fit(config, world_size)
    if m.hf_config is not None:
        _check_hf_config(config)
    g = geometry_of(config)
    if -(-d.num_frames // g.temporal) < p.context_parallel_size:
        raise ValueError(
            f"data.num_frames ({d.num_frames}) must give >= parallel.context_parallel_size "
            f"({p.context_parallel_size}) temporal patches of {g.temporal} frames (an odd count "
            f"repeats the last frame) for model.family 'qwen_vl'"
        )
    for name, side in (("height", d.height), ("width", d.width)):
        if side % (g.patch * g.merge):
            raise ValueError(
                f"data.{name} ({side}) must be divisible by {g.patch * g.merge} for model.family "
                f"'qwen_vl' ({g.patch}-pixel patches merged {g.merge}x{g.merge})"
            )
    head = m.hidden_size // m.num_attention_heads
    if head % 2 or head // 2 < 3 or (m.hidden_size // 2) % 2:
        raise ValueError(
            f"model.hidden_size ({m.hidden_size}) / num_attention_heads ({m.num_attention_heads}) "
            f"must be an even head size >= 6 (M-RoPE sections) and hidden_size divisible by 4 "
            f"for model.family 'qwen_vl'"
        )
    if p.pipeline_model_parallel_size > 1 or p.fsdp:
        raise ValueError(
            f"parallel.pipeline_model_parallel_size ({p.pipeline_model_parallel_size}) must be 1 "
            f"and parallel.fsdp ({p.fsdp}) false for model.family 'qwen_vl'"
        )
    if t.sample or d.source not in ("synthetic", "energon"):
        raise ValueError(
            f"train.sample ({t.sample}) must be false and data.source ({d.source!r}) 'synthetic' "
            f"or 'energon' for model.family 'qwen_vl'"
        )
    if d.source == "energon" and m.hf_config is None:
        raise ValueError(
            f"model.hf_config ({m.hf_config!r}) must name a Qwen2.5-VL folder (its tokenizer and "
            f"video processor read the clips) for data.source 'energon' with model.family 'qwen_vl'"
        )
    if d.source == "energon":  # the folder's tokenizer / processor against the model, every rank
        from ..qwen_vl_energon import energon_source

        energon_source(config, hf_config_of(config))
    if m.init_from is not None:
        _init_from_dir(m.init_from)


@dataclass(frozen=True, kw_only=True)
class QwenVLFamily(FamilySpec):
    """``qwen_vl``: no VAE; the trainer's supervised step or GRPO (``train.objective: grpo``,
    ``training.grpo``); no Megatron-LM entry yet."""

    needs_vae: bool = False

    def check_rl(self, config: Config) -> None:
        from .video_llava import _check_rl

        _check_rl(config)

    def transformer_config(self, config: Config, has_gpu: bool = False):
        from megatron_video.models.qwen_vl import language_config

        p = config.parallel
        return language_config(
            hf_config_of(config),
            tp=p.tensor_model_parallel_size,
            cp=p.context_parallel_size,
            cp_comm_type=_cp_comm_type(config),
            init_method_std=config.model.init_std,
        )

    def build_model(
        self, tcfg, pre_process=True, post_process=True, vp_stage=None, config: Config = None
    ):
        from megatron_video.mmsp.qwen_vl import MMSPQwenVLModel

        model = MMSPQwenVLModel(hf_config_of(config), tcfg, max_sequence_length=_seq_length(config))
        if config is not None and config.model.init_from is not None:  # collective
            from ..checkpoint import load_model_weights
            from .video_llava import _init_from_dir

            load_model_weights(_init_from_dir(config.model.init_from), model)
        return model

    def megatron_lm_config(self, base, config: Config):
        raise ValueError(
            "model.family 'qwen_vl' has no Megatron-LM entry yet (megatron-video train)"
        )

    def check_megatron_lm_args(self, config: Config, args) -> None:
        raise ValueError(
            "model.family 'qwen_vl' has no Megatron-LM entry yet (megatron-video train)"
        )

    def sample_layout(self, config: Config, cp_size: int) -> SampleLayout:
        return SampleLayout(None, None, _seq_length(config))

    def seq_length(self, config: Config) -> int:
        return _seq_length(config)

    def make_objective(self, config: Config, groups, sample: SampleLayout):
        return QwenVLObjective(
            groups.cp_group if groups is not None and groups.cp_size > 1 else None
        )

    def tokenizer(self, config: Config):
        """The questions' word tokenizer (``data.video_qa.qa_tokenizer``: the data's ids) with
        Qwen2.5-VL's image, video, vision start and end tokens at this config's ids; with
        ``data.source: energon`` the ``model.hf_config`` folder's (its chat template wrote the
        prompts)."""
        if config.data.source == "energon":
            from transformers import AutoTokenizer

            from ..qwen_vl_energon import hf_folder

            return AutoTokenizer.from_pretrained(str(hf_folder(config)))
        from megatron_video.data.video_qa import qa_tokenizer

        g, hf = geometry_of(config), hf_config_of(config)
        names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        ids = (hf.image_token_id, g.video_id, g.start_id, g.end_id)
        return qa_tokenizer(dict(zip(names, ids)))

    def make_batches(self, config: Config, **kw) -> QwenVLBatches:
        if config.data.source == "energon":  # each CP rank decodes only its frames
            from ..qwen_vl_energon import QwenEnergonBatches

            return QwenEnergonBatches(config, kw["coords"], hf_config_of(config))
        batches = QwenVLBatches(config, kw["coords"].dp_rank, kw["coords"].dp_size)
        batches.geometry = geometry_of(config)
        return batches


QWEN_VL = register_family(
    QwenVLFamily(
        name="qwen_vl",
        objectives=("lm",),
        check=_check,
        model_fields=("hf_config", "init_from"),
        trainers=(("grpo", "megatron_video.training.grpo:GRPOTrainer"),),
        summary="Qwen2.5-VL (GPTModel with M-RoPE + transformers' vision tower) with MM-SP: "
        "temporal patches sharded for the vision tower, one all-to-all-v into the 2D attention",
    )
)
