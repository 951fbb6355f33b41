"""Drop-in for Megatron-Core's ``LLaVAModel`` with MM-SP (two-stage sharding, exact gradients):
``MMSPLLaVAModel`` takes ``LLaVAModel``'s constructor arguments (0.16 and 0.19) and, with CP > 1,
replaces its vision call and embedding re-shard. Design: docs/architecture.md, "Capabilities"
(MM-SP) and "Megatron integration".
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import torch
from megatron.core.models.multimodal import llava_model as _llava

from ..attention.megatron import DistAttention2D
from ..compat.cp_comm_type import layer_cp_comm_type
from ..parallel.topology import check_cp_comm_type
from .sharding import MMSPBatch, encode_local, plan_batch, reshard_to_llm

__all__ = ["MMSPLLaVAModel"]

LLaVAModel = _llava.LLaVAModel


def _core_attention(spec):
    sub = getattr(spec, "submodules", None)
    attn = getattr(sub, "self_attention", None)
    return getattr(getattr(attn, "submodules", None), "core_attention", None)


class MMSPLLaVAModel(LLaVAModel):
    """Megatron-Core's ``LLaVAModel`` with multi-modal sequence parallelism over the CP group.

    ``MMSPLLaVAModel`` takes the constructor arguments of
    ``megatron.core.models.multimodal.llava_model.LLaVAModel`` (0.16 and 0.19; extra keyword
    arguments pass through) and builds the same modules, so checkpoints and ``freeze`` /
    ``set_input_tensor`` are Megatron's. ``vision_model=`` (optional) replaces the vision model
    Megatron would build from ``vision_model_type`` -- e.g. Megatron's ``CLIPViTModel`` with local
    norms, which ``LLaVAModel`` cannot build without TransformerEngine (its default ``ln_pre_impl``
    is then ``torch.nn.LayerNorm``, which rejects ``config=``); the projector is Megatron's
    ``MultimodalProjector`` either way. The language layer spec must use megatron_video's 2D
    attention (``models.specs.with_2d_attention`` / ``gpt_layer_local_2d_spec``); no
    TransformerEngine needed.

    With ``context_parallel_size == 1`` the forward is Megatron's. With CP > 1 two steps of
    Megatron's forward are replaced (docs/architecture.md, "Capabilities", 5):

    * the vision call: each CP rank runs the vision model + projector only on its share of every
      video's frames (``layouts.mmsp.frame_shards``), instead of every rank encoding every frame;
    * the embedding re-shard (``_process_embedding_token_parallel``, TE's
      ``get_batch_on_this_cp_rank`` cut): each rank assembles its zigzag shard of the combined
      sequence directly -- text rows from its own embedding lookup, visual rows through one autograd
      all-to-all-v -- so the full combined sequence never exists on any rank and each encoder gets
      exactly the gradient of its tokens.

    Labels and the loss mask are Megatron's (``_preprocess_data`` on a one-wide probe, then the
    zigzag shard). The per-token loss comes back like Megatron's (``[b, s_local]``, with the local
    loss mask); normalise it by the global target count (``mmsp.global_token_loss``). Packed
    samples: batch of one, ``PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens_kv=...)``
    with document boundaries on the combined sequence; the 2D attention then uses ``masks.packed(cu,
    inner=causal)``; RoPE positions are global (``max_seqlen_q/kv`` are set to the padded combined
    length under CP; at CP = 1 pass the combined length, as Megatron takes the RoPE length from
    them).

    Megatron's constructor accepts CP only with TE's core attention; it is called with the config's
    ``context_parallel_size`` showing 1 (the same object, restored right after), and the
    2D-attention cores then get their layer's ``cp_comm_type`` (``compat.layer_cp_comm_type``, the
    rule every DiT layer uses).
    """

    def __init__(
        self,
        language_transformer_config,
        language_transformer_layer_spec,
        *args,
        tubelet_size: int = 1,
        vision_model: Optional[torch.nn.Module] = None,
        **kwargs,
    ):
        cfg = language_transformer_config
        cp = cfg.context_parallel_size
        if getattr(cfg, "sequence_parallel", False):
            raise ValueError(
                "sequence_parallel (True) must be False for MMSPLLaVAModel (the LLM "
                "input is already cut over the CP group; tensor parallelism without "
                "sequence parallelism is supported)"
            )
        if isinstance(tubelet_size, bool) or not isinstance(tubelet_size, int) or tubelet_size != 1:
            raise ValueError(
                f"tubelet_size ({tubelet_size!r}) must be 1 for MMSPLLaVAModel: "
                f"Megatron's vision models encode one frame (tile) at a time; "
                f"tubelet encoders use mmsp.encode_local directly"
            )
        bound = inspect.signature(LLaVAModel.__init__).bind(
            None, language_transformer_config, language_transformer_layer_spec, *args, **kwargs
        )
        bound.apply_defaults()
        named = dict(bound.arguments)
        own_encoder = vision_model is not None and named["add_encoder"]
        if own_encoder:
            # Megatron builds its vision model from vision_model_type; a given one (e.g. a CLIPViTModel
            # with local norms, which LLaVAModel cannot build without TransformerEngine) replaces it.
            kwargs["add_encoder"] = False
        core = _core_attention(language_transformer_layer_spec)
        core_module = getattr(core, "module", core)
        if cp > 1 and not (
            isinstance(core_module, type) and issubclass(core_module, DistAttention2D)
        ):
            raise ValueError(
                f"language_transformer_layer_spec core_attention "
                f"({getattr(core_module, '__name__', core_module)!r}) must be "
                f"megatron_video's DistAttention2D when context_parallel_size ({cp}) > 1 "
                f"(models.specs.with_2d_attention(...) or gpt_layer_local_2d_spec)"
            )
        # Megatron's check admits CP only with TE's core attention; ours replaces it.
        cfg.context_parallel_size = 1
        try:
            super().__init__(cfg, language_transformer_layer_spec, *args, **kwargs)
        finally:
            cfg.context_parallel_size = cp
        if own_encoder:
            from megatron.core.models.vision.multimodal_projector import MultimodalProjector

            self.add_encoder = True
            self._drop_vision_class_token = named["drop_vision_class_token"]
            self.vision_model = vision_model
            width = named["vision_transformer_config"].hidden_size * (
                4 if named["pixel_shuffle"] else 1
            )
            self.vision_projection = MultimodalProjector(
                named["vision_projection_config"],
                named["vision_projection_layer_spec"],
                named["vision_projection_type"],
                width,
                tp_group=self.pg_collection.tp,
            )
        if not hasattr(
            self, "model_type"
        ):  # what Megatron's schedules read (Megatron-LM sets it too)
            from megatron.core.enums import ModelType

            self.model_type = ModelType.encoder_or_decoder
        self.context_parallel_lm = cp
        self.cp_group = self.pg_collection.cp if cp > 1 else None
        self.tubelet_size = tubelet_size
        self.last_mmsp_batch: Optional[MMSPBatch] = None
        if cp > 1 and self.language_model is not None and cfg.cp_comm_type is not None:
            for m in self.language_model.modules():
                if isinstance(m, DistAttention2D):  # what TransformerLayer passes under CP
                    m.cp_comm_type = check_cp_comm_type(layer_cp_comm_type(cfg, m.layer_number))

    # ------------------------------------------------------------------------------------------
    def _groups(self):
        for m in self.language_model.modules():
            if isinstance(m, DistAttention2D):
                return m.video_groups()
        return None

    def _encode(self, images: torch.Tensor) -> torch.Tensor:
        """Megatron's vision call (model, class-token drop, pixel shuffle, projector) on some tiles:
        ``[n, img_seq_len, h_language]``."""
        emb = self.vision_model(images)  # [n_local, img_seq_len (+cls), h_vision]
        if self._drop_vision_class_token:
            emb = emb[:, self.vision_model.class_token_len :, :]
        if self._pixel_shuffle:
            emb = _llava.pixel_shuffle(emb)
        emb = self.vision_projection(emb.permute(1, 0, 2).contiguous())  # [img_seq_len, n, h]
        return emb.permute(1, 0, 2)  # [n, img_seq_len, h_language]

    def _check_cp_forward(self, args, kwargs, inference_context, input_ids, packed_seq_params):
        """Under CP, ``forward`` takes the training arguments only, no tile tags, and packed
        sequences in ``sbhd`` with a batch of one."""
        extra = [k for k, v in kwargs.items() if v is not None and k != "inference_params"]
        if (
            args
            or extra
            or inference_context is not None
            or kwargs.get("inference_params") is not None
        ):
            raise ValueError(
                f"MMSPLLaVAModel.forward with context_parallel_size "
                f"({self.context_parallel_lm}) > 1 takes images, input_ids, "
                f"position_ids, attention_mask, labels, loss_mask, num_image_tiles, "
                f"image_token_index, runtime_gather_output and packed_seq_params "
                f"(training); got also {extra or 'inference_context / positional extras'}"
            )
        if self._tile_tags is not None:
            raise ValueError("tile_tags must be None for MMSPLLaVAModel under context parallelism")
        if packed_seq_params is not None and (
            packed_seq_params.qkv_format != "sbhd" or input_ids.shape[0] != 1
        ):
            raise ValueError(
                f"packed_seq_params (qkv_format {packed_seq_params.qkv_format!r}, batch "
                f"{input_ids.shape[0]}) must have qkv_format 'sbhd' with a batch of one "
                f"and cu_seqlens on the combined text + visual sequence"
            )

    def _tiles(self, images, num_image_tiles):
        """``(tiles per sample, has_images)``; with an encoder, the tiles must sum to the frames."""
        has_images = images is not None and images.shape[0] > 0
        if not has_images:
            tiles = []
        elif num_image_tiles is None:
            tiles = [1] * images.shape[0]
        else:
            tiles = [int(t) for t in torch.as_tensor(num_image_tiles).flatten()]
        n_tiles = images.shape[0] if images is not None else 0
        if self.add_encoder and sum(tiles) != n_tiles:
            raise ValueError(
                f"num_image_tiles (sum {sum(tiles)}) must equal the number of frames in "
                f"images ({n_tiles})"
            )
        return tiles, has_images

    def _plan(self, input_ids, tiles, token) -> MMSPBatch:
        """The MMSP plan of this batch over the CP group (heads and sequence length checked)."""
        cfg, tp = self.config, self.tensor_model_parallel_size_lm
        groups = self._groups() if self.language_model is not None else None
        if groups is not None and (cfg.num_attention_heads // tp) % groups.ulysses_size:
            raise ValueError(
                f"num_attention_heads ({cfg.num_attention_heads}) / "
                f"tensor_model_parallel_size ({tp}) must be divisible by the Ulysses "
                f"size ({groups.ulysses_size}, from cp_comm_type {cfg.cp_comm_type!r})"
            )
        batch = plan_batch(
            input_ids,
            tiles,
            token,
            self.img_seq_len,
            self.cp_group.rank(),
            self.context_parallel_lm,
            self.tubelet_size,
            seq_len=self._language_max_sequence_length
            if self._language_is_pipeline_parallel
            else None,
            group=self.cp_group,
        )
        if batch.layout.seq_len > self._language_max_sequence_length:
            raise ValueError(
                f"combined sequence length ({int(batch.layout.lengths.max())}, padded "
                f"to {batch.layout.seq_len} for 2 * context_parallel_size) must be <= "
                f"language_max_sequence_length ({self._language_max_sequence_length})"
            )
        return batch

    def _combined_embeddings(self, images, has_images, input_ids, position_ids, token, batch):
        """The first stage's LLM input ``[s, b, h]``: this rank's text and visual tokens on the
        LLM's zigzag shard (visual tokens encoded here or handed by an encoder stage)."""
        cfg = self.config
        if self.add_encoder and has_images:
            visual = encode_local(self._encode, images, batch)  # this rank's frames only
        elif self.add_encoder:
            visual = torch.zeros(0, cfg.hidden_size, dtype=cfg.params_dtype)
        else:
            visual = self.encoder_hidden_state  # this rank's visual tokens from an encoder stage
        ids = input_ids.clone()
        ids[ids == token] = 0
        text = self.language_model.embedding(input_ids=ids, position_ids=position_ids)  # [T, b, h]
        text = text.transpose(0, 1).reshape(-1, text.shape[-1])
        visual = visual.to(text.dtype) if visual.numel() == 0 else visual
        return reshard_to_llm(visual, text, batch, self.cp_group).transpose(0, 1).contiguous()

    def forward(
        self,
        images,
        input_ids,
        position_ids,
        attention_mask,
        labels=None,
        loss_mask=None,
        inference_context=None,
        num_image_tiles=None,
        image_token_index=None,
        runtime_gather_output=None,
        packed_seq_params=None,
        *args,
        **kwargs,
    ):
        if self.context_parallel_lm == 1:
            return super().forward(
                images,
                input_ids,
                position_ids,
                attention_mask,
                labels,
                loss_mask,
                inference_context,
                num_image_tiles,
                image_token_index,
                runtime_gather_output,
                packed_seq_params,
                *args,
                **kwargs,
            )
        self._check_cp_forward(args, kwargs, inference_context, input_ids, packed_seq_params)
        token = self.image_token_index if image_token_index is None else image_token_index
        tiles, has_images = self._tiles(images, num_image_tiles)
        batch = self._plan(input_ids, tiles, token)
        self.last_mmsp_batch = batch
        if packed_seq_params is not None:
            # RoPE length: Megatron takes max_seqlen for packed input and cuts it in zigzag; with
            # documents on the global sequence, positions are global up to the padded length.
            packed_seq_params = dataclasses.replace(
                packed_seq_params,
                max_seqlen_q=batch.layout.seq_len,
                max_seqlen_kv=batch.layout.seq_len,
            )

        combined = None
        if self.pre_process:
            combined = self._combined_embeddings(
                images, has_images, input_ids, position_ids, token, batch
            )

        new_labels = new_loss_mask = None
        if self.post_process and labels is not None:
            new_labels, new_loss_mask = self.local_labels(
                input_ids, labels, loss_mask, tiles, token, batch
            )
        output = self.language_model(
            input_ids=None,
            position_ids=None,
            attention_mask=attention_mask,
            decoder_input=combined,
            labels=new_labels,
            runtime_gather_output=runtime_gather_output,
            packed_seq_params=packed_seq_params,
        )
        return output, new_loss_mask

    def local_labels(
        self,
        input_ids,
        labels,
        loss_mask,
        num_image_tiles,
        image_token_index=None,
        batch: Optional[MMSPBatch] = None,
    ):
        """Megatron's combined labels / loss mask (``_preprocess_data`` on a one-wide probe); with
        ``batch`` (an ``MMSPBatch``, e.g. ``last_mmsp_batch``) padded to the CP length and cut to this
        rank's zigzag positions, else the full combined ``[b, s]``."""
        token = self.image_token_index if image_token_index is None else image_token_index
        tiles = [
            int(t)
            for t in torch.as_tensor(
                num_image_tiles if num_image_tiles is not None else []
            ).flatten()
        ]
        b, T = input_ids.shape
        probe_img = torch.zeros(self.img_seq_len, sum(tiles), 1) if tiles else torch.zeros(0, 0, 1)
        probe_txt = torch.zeros(b, T, 1)
        n_tiles = torch.tensor(tiles, dtype=torch.int)
        _, full_labels, full_mask = self._preprocess_data(
            probe_img, probe_txt, input_ids, loss_mask, labels, False, None, token, n_tiles
        )
        if batch is None:
            return full_labels, full_mask
        pad = batch.layout.seq_len - full_labels.shape[1]
        full_labels = torch.nn.functional.pad(full_labels, (0, pad), value=_llava.IGNORE_INDEX)
        full_mask = torch.nn.functional.pad(full_mask, (0, pad), value=0)
        pos = batch.plan.positions.to(full_labels.device)
        return full_labels[:, pos].contiguous(), full_mask[:, pos].contiguous()
