"""What the video-DiT layers (``VideoDiTLayer``, ``STDiTLayer``, ``ARDiTLayer``) share: the
``DiTParams`` they take, their submodule slots, the ``DiTLayerBase`` Megatron ``TransformerLayer``
and the ``VideoTransformerBlock`` that hands them ``DiTParams`` (stock ``TransformerBlock.forward``
has no slot for it). Design: docs/architecture.md, "Megatron integration" and "Groups".
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import make_viewless_tensor

from megatron_video.attention.masks import AttentionMask
from megatron_video.compat.cp_comm_type import layer_cp_comm_type, megatron_reads_layer_cp_comm_type
from megatron_video.layouts.packed_video import PackedVideo
from megatron_video.layouts.placement import Placement
from megatron_video.layouts.stdit import VideoGeometry
from megatron_video.models.dit_blocks import AdaLNLoRAModulation, gated, modulate
from megatron_video.models.packed import check_packed, packed_text_mask
from megatron_video.parallel.comm import check_same_shape, group_rank, shape_check_scope
from megatron_video.parallel.topology import resolve_video_groups

__all__ = [
    "DiTParams",
    "DiTLayerSubmodules",
    "DiTLayerBase",
    "VideoTransformerBlock",
    "mlp_submodule",
    "adaln_branch",
    "token_adaln_branch",
]


@dataclass
class DiTParams:
    """Per-batch inputs of the DiT layers besides hidden states and text.

    ``conditioning``: AdaLN conditioning, ``[b, D]`` per sample (VideoDiT, ST-DiT) or ``[s, b, D]``
    per token (AR DiT); ``geometry``: the global token grid of every sample; ``attention_mask``:
    the self-attention mask on global token ids (AR DiT: teacher forcing); ``rotary_pos_emb``:
    precomputed RoPE in Megatron's ``[s, 1, 1, d]`` format (AR DiT; the others derive it from the
    geometry and their CP rank).

    A packed micro-batch (batch 1, several clips; docs/architecture.md, "Packed micro-batches in
    the models") sets ``packed`` (the ``PackedVideo``: each token's clip, grid position, side) and
    ``placement`` (the global ids each CP rank holds; ``None`` only at CP = 1), passed on to the
    core attention; ``conditioning`` is then ``[num_clips, D]`` per clip (VideoDiT) or ``[s, 1,
    D]`` per token (AR DiT), and ``attention_mask`` the clips' mask (``models.packed``).
    """

    conditioning: torch.Tensor
    geometry: Optional[VideoGeometry] = None
    attention_mask: Optional[AttentionMask] = None
    rotary_pos_emb: Optional[torch.Tensor] = None
    packed: Optional[PackedVideo] = None
    placement: Optional[Placement] = None


@dataclass
class DiTLayerSubmodules(TransformerLayerSubmodules):
    """Megatron's layer slots (norms, ``self_attention`` with its ``core_attention``,
    ``cross_attention``, ``mlp``) plus the AdaLN-LoRA ``modulation``."""

    modulation: Union[ModuleSpec, type] = AdaLNLoRAModulation


def mlp_submodule(submodules):
    """The ``mlp`` slot in the form this megatron-core builds it (feature-detected): the
    ``MLP.as_mlp_submodule`` builder where it exists (0.19), else a ``ModuleSpec`` of ``MLP``."""
    if hasattr(MLP, "as_mlp_submodule"):
        return functools.partial(MLP.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=MLP, submodules=submodules)


def adaln_branch(x, mods, i: int, norm, f):
    """``x + gate_i * f(modulate(norm(x), shift_i, scale_i))`` with per-sample ``[b, D]`` chunks."""
    shift, scale, gate = mods[3 * i : 3 * i + 3]
    return x + gated(f(modulate(norm(x), shift, scale)), gate)


def token_adaln_branch(x, mods, i: int, norm, f):
    """``adaln_branch`` with per-token chunks shaped like ``x`` (broadcastable)."""
    shift, scale, gate = mods[3 * i : 3 * i + 3]
    return x + gate * f(norm(x) * (1 + scale) + shift)


class DiTLayerBase(TransformerLayer):
    """Base of the DiT layers: Megatron's ``forward`` (unused slots checked, ``params`` a
    ``DiTParams``) calls the subclass's ``_forward``; subclasses set the error-message fragments
    (``sequence_parallel_reason``, ``cp_order_note``, ``params_what``)."""

    # why ``config.sequence_parallel`` cannot be used (completes "... is not supported by X: ")
    sequence_parallel_reason: str = "its sequence is already split by context parallelism"
    # appended to the CP rank-order error
    cp_order_note: str = ""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: DiTLayerSubmodules,
        layer_number: int = 1,
        groups=None,
        **kwargs,
    ):
        if config.sequence_parallel:
            raise ValueError(
                f"config.sequence_parallel (True) is not supported by "
                f"{type(self).__name__}: {self.sequence_parallel_reason}"
            )
        # Megatron hands the attention it builds config.cp_comm_type's entry for this layer; make
        # every megatron-core read the entry _cp_comm_type() reads (compat.cp_comm_type).
        with megatron_reads_layer_cp_comm_type(config):
            super().__init__(
                config=config, submodules=submodules, layer_number=layer_number, **kwargs
            )
        self._groups, self._resolved = groups, False

    def _build_modulation(self, spec, num_chunks: int, lora_rank: int) -> None:
        self.modulation = build_module(
            spec, config=self.config, num_chunks=num_chunks, lora_rank=lora_rank
        )

    def _build(self, spec, **kwargs):
        """A submodule the layer adds to Megatron's slots, built with the same keyword arguments
        ``TransformerLayer`` gives its attention (``layer_number``, ``pg_collection``,
        ``cp_comm_type`` when CP > 1)."""
        extra = dict(pg_collection=getattr(self, "pg_collection", None))
        if self.config.context_parallel_size > 1 and self.config.cp_comm_type is not None:
            extra["cp_comm_type"] = self._cp_comm_type()
        return build_module(
            spec, config=self.config, layer_number=self.layer_number, **extra, **kwargs
        )

    # -- groups -------------------------------------------------------------------------------
    def _cp_comm_type(self):
        return layer_cp_comm_type(self.config, self.layer_number)

    @property
    def groups(self):
        """The U x R groups (``None`` without CP), resolved at the first use like the core
        attention's (same ``pg_collection`` and ``cp_comm_type``, same rule)."""
        if not self._resolved:
            g = resolve_video_groups(
                self._groups, getattr(self, "pg_collection", None), self._cp_comm_type()
            )
            cp = 1 if g is None else g.cp_size
            if cp != self.config.context_parallel_size:
                raise ValueError(
                    f"config.context_parallel_size ({self.config.context_parallel_size}) "
                    f"must equal the size of the CP group Megatron set up ({cp}) for "
                    f"{type(self).__name__}"
                )
            if g is not None and group_rank(g.cp_group) != g.cp_rank:
                raise RuntimeError(
                    "the CP group's rank order differs from the CP index order" + self.cp_order_note
                )
            self._groups, self._resolved = g, True
        return self._groups

    def _cp(self):
        """``(cp_size, cp_rank)``; ``(1, 0)`` without context parallelism."""
        g = self.groups
        return (1, 0) if g is None else (g.cp_size, g.cp_rank)

    # -- forward -------------------------------------------------------------------------------
    # what ``params`` carries for this layer (completes "must be a DiTParams (...)")
    params_what: str = "the AdaLN conditioning and the global token grid"
    # whether ``context_mask`` is a Megatron slot that must stay None (the layer masks no text)
    context_mask_unused: bool = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        params: Optional[DiTParams] = None,
        rotary_pos_emb=None,
        attention_bias=None,
        packed_seq_params=None,
        **unused,
    ):
        """Megatron's layer interface: the slots this layer does not use must be None, ``params``
        a ``DiTParams``; the layer itself is ``_forward(hidden_states, context, context_mask,
        params)`` -> ``(hidden_states, context)``."""
        slots = dict(
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        if self.context_mask_unused:
            slots["context_mask"] = context_mask
        params = self._check_params(params, self.params_what, slots)
        return self._forward(hidden_states, context, context_mask, params)

    def _forward(self, hidden_states, context, context_mask, params: DiTParams):
        raise NotImplementedError

    # -- shared forward helpers ---------------------------------------------------------------
    def _check_conditioning(self, conditioning, shape, what: str) -> torch.Tensor:
        """``conditioning`` must be a tensor of ``shape``; ``what`` is the error's start
        ("params.conditioning must be [b, D]")."""
        if not isinstance(conditioning, torch.Tensor) or tuple(conditioning.shape) != tuple(shape):
            raise ValueError(
                f"{what} = {list(shape)}, got {tuple(getattr(conditioning, 'shape', ())) or None}"
            )
        return conditioning

    def _check_same_shapes(self, packed: Optional[PackedVideo] = None, **tensors) -> None:
        """With CP, every CP rank must pass the same shapes (``None`` tensors are skipped) and
        the same packed micro-batch (its digest rides along as a tensor length)."""
        if self._cp()[0] > 1:
            shapes = {k: v for k, v in tensors.items() if v is not None}
            if packed is not None:
                shapes["packed"] = torch.empty(int(packed.digest[:3], 16))
            check_same_shape(shapes, self.groups.cp_group, where=type(self).__name__)

    def _check_params(self, params, what: str, slots: Optional[dict] = None) -> DiTParams:
        """``params`` as a ``DiTParams``; Megatron slots in ``slots`` must be unused (None)."""
        used = sorted(k for k, v in (slots or {}).items() if v is not None)
        if used:
            raise ValueError(
                f"{', '.join(used)} must be None for {type(self).__name__}: "
                f"conditioning, geometry, masks and RoPE travel in params (DiTParams)"
            )
        if not isinstance(params, DiTParams):
            raise ValueError(
                f"params ({type(params).__name__}) must be a DiTParams ({what}); run "
                f"{type(self).__name__} in a VideoTransformerBlock or call it with "
                f"params=DiTParams(...)"
            )
        return params

    def _geometry(self, params: DiTParams, what: str) -> VideoGeometry:
        if not isinstance(params.geometry, VideoGeometry):
            raise ValueError(
                f"params.geometry ({type(params.geometry).__name__}) must be a "
                f"VideoGeometry; {type(self).__name__} needs {what}"
            )
        return params.geometry

    def _packed_tokens(self, params: DiTParams, hidden_states, kind: str):
        """``(global ids, clip of each)`` of this CP rank's tokens of a packed micro-batch, after
        the checks of ``models.packed.check_packed`` (before any collective)."""
        s, b = hidden_states.shape[:2]
        ids = check_packed(
            params.packed, kind, type(self).__name__, params.placement, self._cp(), s, b
        )
        return ids, params.packed.clip_of(ids).to(hidden_states.device)

    def _packed_text_mask(self, params: DiTParams, clip, context, context_mask):
        """Cross-attention mask of a packed micro-batch (each clip its own caption), or None."""
        if context is None:
            return None
        return packed_text_mask(clip, params.packed.num_clips, context_mask, context.shape[0])

    def _mlp(self, x):
        # Megatron's linear layers take 3-D activations (their weight-gradient GEMM flattens 3-D)
        out, bias = self.mlp(x.reshape(x.shape[0], -1, x.shape[-1]))
        out = out if bias is None else out + bias
        return out.reshape(x.shape)


class VideoTransformerBlock(TransformerBlock):
    """``TransformerBlock`` of DiT layers: ``forward(hidden_states, params, context=None,
    context_mask=None)`` with ``params`` a ``DiTParams``.

    It runs the layers itself: with full activation recompute (``recompute_method`` uniform or
    block, as Megatron) the conditioning -- a tensor that needs its gradient -- is a checkpoint
    argument and the rest of the ``DiTParams`` is closed over per call, so pipelined
    micro-batches cannot mix them up (stock ``forward`` hands checkpoints only tensors). The layers
    run in one ``parallel.comm.shape_check_scope``: the cross-rank shape checks of the layers and
    their attention cost one all-gather per distinct call per micro-batch, not per layer."""

    def forward(
        self,
        hidden_states: Optional[torch.Tensor],
        params: DiTParams = None,
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        **unused,
    ):
        used = sorted(k for k, v in unused.items() if v is not None)
        if used:
            raise ValueError(
                f"{', '.join(used)} must be None for VideoTransformerBlock: "
                f"conditioning, geometry, masks and RoPE travel in params (DiTParams)"
            )
        if not isinstance(params, DiTParams):
            raise ValueError(
                f"params ({type(params).__name__}) must be a DiTParams (the AdaLN "
                f"conditioning and video geometry of this batch)"
            )
        if not self.pre_process:  # see set_input_tensor()
            hidden_states = self.input_tensor
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)

        def run(start: int, end: int):
            def forward_chunk(h, ctx, ctx_mask, conditioning):
                p = dataclasses.replace(params, conditioning=conditioning)
                for layer in self.layers[start:end]:
                    h, _ = layer(h, context=ctx, context_mask=ctx_mask, params=p)
                return h

            return forward_chunk

        n, cfg = len(self.layers), self.config
        if cfg.recompute_granularity == "full" and self.training:
            k = cfg.recompute_num_layers
            if cfg.recompute_method == "uniform":
                chunks = [(i, min(i + k, n), True) for i in range(0, n, k)]
            elif cfg.recompute_method == "block":
                chunks = [(i, i + 1, i < k) for i in range(n)]
            else:
                raise ValueError(
                    f"config.recompute_method ({cfg.recompute_method!r}) must be "
                    f"'uniform' or 'block' with recompute_granularity 'full'"
                )
        else:
            chunks = [(0, n, False)]
        quantization = nullcontext()
        if cfg.fp8:
            from megatron.core.fp8_utils import get_fp8_context

            quantization = get_fp8_context(cfg)
        args = (context, context_mask, params.conditioning)
        # one cross-rank shape check per distinct call of this micro-batch, not per layer
        with quantization, shape_check_scope():
            for start, end, checkpointed in chunks:
                if not checkpointed:
                    hidden_states = run(start, end)(hidden_states, *args)
                elif cfg.fp8:
                    from megatron.core.extensions.transformer_engine import te_checkpoint

                    hidden_states = te_checkpoint(
                        run(start, end),
                        cfg.distribute_saved_activations,
                        tensor_parallel.random.get_cuda_rng_tracker,
                        self.pg_collection.tp,
                        hidden_states,
                        *args,
                    )
                else:
                    hidden_states = tensor_parallel.checkpoint(
                        run(start, end), cfg.distribute_saved_activations, hidden_states, *args
                    )
        # as Megatron's TransformerBlock: a viewless output, which the pipeline schedule frees
        # after sending it (deallocate_pipeline_outputs, Megatron-LM's default, asserts it)
        return make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
