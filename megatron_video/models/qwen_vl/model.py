"""``QwenVLModel``: Qwen2.5-VL on Megatron-Core (CP = 1; MM-SP under CP: ``mmsp.qwen_vl``).

The language model is Megatron-Core's ``GPTModel`` (Qwen2 blocks from ``language_config``,
``position_embedding_type="mrope"``, our 2D attention as core attention); the vision tower is
transformers' own ``Qwen2_5_VisionTransformerPretrainedModel`` (patch embed with temporal patch 2,
2-D RoPE, windowed and full-attention blocks, 2x2 patch merger), wrapped as is. Inputs are what the
HF processor produces: ``input_ids`` with the video placeholders already expanded,
``pixel_values_videos`` ``[sum(t*h*w), C*2*p*p]`` and ``video_grid_thw``.

``QwenVLModel`` runs CP = 1; ``mmsp.qwen_vl.MMSPQwenVLModel`` adds MM-SP under CP. Stage 1:
transformers' vision attention is masked per temporal patch (``cu_seqlens``
repeats ``h*w`` ``t`` times, both for the full-attention and the windowed blocks, and the windows
are cut per temporal patch), so a temporal patch (2 frames) is an independent unit: each CP rank
encodes only its share of every video's temporal patches (``layouts.mmsp.frame_shards``) and
the result is exact. Stage 2: one autograd all-to-all-v into the LLM's zigzag layout
(``mmsp.sharding.reshard_to_llm``); the global 3-D M-RoPE ids are cut to the rank's positions.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule

from .config import check_hf_config, rope_theta, tie_word_embeddings
from .positions import mrope_position_ids, vision_token_counts

__all__ = ["QwenVLModel", "qwen_vl_layer_spec", "shift_labels", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def qwen_vl_layer_spec():
    """Megatron's local GPT layer spec with RMSNorm and our 2D attention as core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ..specs import with_2d_attention

    return with_2d_attention(get_gpt_layer_local_spec(normalization="RMSNorm"))


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF causal-LM labels (token ``i`` is the target of position ``i - 1``) -> Megatron's
    (``labels[:, i]`` is the target of position ``i``); ``IGNORE_INDEX`` at the end."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def _vision_tower(hf_config, dtype):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    return Qwen2_5_VisionTransformerPretrainedModel._from_config(hf_config.vision_config).to(dtype)


class QwenVLModel(MegatronModule):
    """Qwen2.5-VL (``hf_config``: a ``Qwen2_5_VLConfig``) with ``config`` from
    ``qwen_vl.config.language_config``. ``forward`` returns the logits ``[b, s_local, vocab]``,
    or with ``labels`` (HF convention, unshifted) Megatron's per-token loss and the loss mask of
    this rank's positions; ``local_labels`` gives the matching shifted, CP-cut labels."""

    def __init__(
        self,
        hf_config,
        config,
        layer_spec=None,
        pre_process: bool = True,
        post_process: bool = True,
        max_sequence_length: Optional[int] = None,
    ):
        from megatron.core.models.gpt import GPTModel

        super().__init__(config=config)
        check_hf_config(hf_config)
        if getattr(config, "sequence_parallel", False):
            raise ValueError("sequence_parallel (True) must be False for QwenVLModel")
        if config.pipeline_model_parallel_size != 1:
            raise ValueError(
                f"pipeline_model_parallel_size ({config.pipeline_model_parallel_size}) must be 1 "
                f"for QwenVLModel (pipeline stages: not implemented yet)"
            )
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1 and not self.supports_context_parallel:
            raise ValueError(
                f"context_parallel_size ({self.cp_size}) > 1 needs MM-SP: use "
                f"megatron_video.mmsp.qwen_vl.MMSPQwenVLModel (QwenVLModel runs CP = 1)"
            )
        self.hf_config = hf_config
        text = hf_config.text_config
        self.pre_process, self.post_process = pre_process, post_process
        self.visual = _vision_tower(hf_config, config.params_dtype) if pre_process else None
        self.language_model = GPTModel(
            config,
            layer_spec if layer_spec is not None else qwen_vl_layer_spec(),
            vocab_size=text.vocab_size,
            max_sequence_length=max_sequence_length or text.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=tie_word_embeddings(hf_config),
            position_embedding_type="mrope",
            rotary_base=rope_theta(hf_config),
        )
        # M-RoPE ids are cut to each rank's zigzag positions here, not by the embedding.
        self.language_model.rotary_pos_emb.cp_group = None
        self.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules read

    supports_context_parallel = False

    def set_input_tensor(self, input_tensor):
        self.language_model.set_input_tensor(input_tensor)

    # ------------------------------------------------------------------------------------------
    @property
    def merge(self) -> int:
        return int(self.hf_config.vision_config.spatial_merge_size)

    def encode_videos(self, pixel_values_videos, video_grid_thw) -> torch.Tensor:
        """The vision tower + merger on whole videos: ``[sum(t*h*w/4), hidden]``."""
        pv = pixel_values_videos.to(self.visual.dtype)
        return self.visual(pv, grid_thw=video_grid_thw).pooler_output

    def _encode_units(self, units: torch.Tensor, grid_hw) -> torch.Tensor:
        """``units [n, h*w, C*2*p*p]`` (temporal patches) -> ``[n, h*w/4, hidden]``."""
        n = units.shape[0]
        grid = torch.tensor([[1, grid_hw[0], grid_hw[1]]], device=units.device).repeat(n, 1)
        out = self.encode_videos(units.reshape(-1, units.shape[-1]), grid)
        return out.reshape(n, -1, out.shape[-1])

    def _text_embeddings(self, input_ids):
        ids = input_ids.clone()
        ids[ids == self.hf_config.video_token_id] = 0
        return self.language_model.embedding(input_ids=ids, position_ids=None)  # [T, b, h]

    def _check_video(self, input_ids, pixel_values_videos, video_grid_thw):
        cfg = self.hf_config
        if (input_ids == cfg.image_token_id).any():
            raise ValueError(
                f"input_ids contain image tokens (image_token_id {cfg.image_token_id}): "
                f"QwenVLModel takes videos only (images: not implemented yet)"
            )
        n_tok = int((input_ids == cfg.video_token_id).sum())
        counts = vision_token_counts(video_grid_thw, self.merge)
        if n_tok != sum(counts):
            raise ValueError(
                f"input_ids video tokens ({n_tok}) must equal the merged tokens of "
                f"video_grid_thw ({sum(counts)} = sum(t*h*w) / {self.merge**2})"
            )
        rows = 0 if video_grid_thw is None else int(video_grid_thw.prod(-1).sum())
        have = 0 if pixel_values_videos is None else pixel_values_videos.shape[0]
        local = self._local_pixel_rows(video_grid_thw)
        if have != rows and have != local:
            also = "" if local is None else f" or this CP rank's share ({local})"
            raise ValueError(
                f"pixel_values_videos rows ({have}) must equal sum(t*h*w) of video_grid_thw "
                f"({rows}){also}"
            )

    def _local_pixel_rows(self, video_grid_thw):
        """The rows of this rank's share of the videos' temporal patches where a loader may hand
        only those (MM-SP's subclass); None here: every row."""
        return None

    def _full_input(self, input_ids, pixel_values_videos, video_grid_thw):
        emb = self._text_embeddings(input_ids)  # [T, b, h]
        if video_grid_thw is None or not len(video_grid_thw):
            return emb
        vis = self.encode_videos(pixel_values_videos, video_grid_thw).to(emb.dtype)
        mask = (input_ids == self.hf_config.video_token_id)[..., None].to(emb.device)
        # visual tokens fill the placeholders row-major (sample by sample), as transformers does
        return emb.transpose(0, 1).masked_scatter(mask, vis).transpose(0, 1).contiguous()

    def decoder_input(self, input_ids, pixel_values_videos, video_grid_thw, position_ids):
        """(LLM input ``[s, b, h]``, M-RoPE ids ``[3, b, s]``) of this rank (all tokens here;
        MM-SP's subclass returns the rank's zigzag shard)."""
        return self._full_input(input_ids, pixel_values_videos, video_grid_thw), position_ids

    def local_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """HF-convention ``labels [b, T]`` -> Megatron's shifted labels of this rank's tokens."""
        return shift_labels(labels)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values_videos: Optional[torch.Tensor] = None,
        video_grid_thw: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        second_per_grid_ts=None,
        position_ids: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ):
        """Logits ``[b, s_local, vocab]`` (``labels`` None) or, as ``LLaVAModel`` returns it,
        ``(Megatron's per-token loss, loss mask)``, both ``[b, s_local]``, on this rank's
        positions (all of them here; under MM-SP the zigzag shard of the padded sequence).
        Right padding only. ``position_ids [3, b, T]``: precomputed global M-RoPE ids (default:
        ``mrope_position_ids``)."""
        if video_grid_thw is not None:
            video_grid_thw = torch.as_tensor(video_grid_thw, dtype=torch.long).reshape(-1, 3)
        self._check_video(input_ids, pixel_values_videos, video_grid_thw)
        if position_ids is None:
            position_ids = mrope_position_ids(
                input_ids, self.hf_config, video_grid_thw, None, second_per_grid_ts
            )
        position_ids = position_ids.to(input_ids.device)
        decoder_input, position_ids = self.decoder_input(
            input_ids, pixel_values_videos, video_grid_thw, position_ids
        )
        local = None if labels is None else self.local_labels(labels)
        out = self.language_model(
            input_ids=None,
            position_ids=position_ids,
            attention_mask=None,
            decoder_input=decoder_input,
            labels=local,
            runtime_gather_output=runtime_gather_output,
        )
        return out if local is None else (out, (local != IGNORE_INDEX).to(out.dtype))
