"""Model families: one spec object per family, the only place a family's choices are written.

A :class:`FamilySpec` bundles what differs between the families of ``model.family``: the model
class, the attention layer type, the training objectives it admits (and its default), the token
layout of a sample (plain frame order, or Balanced SP teacher forcing with a clean and a noisy
copy), the objective object the trainer calls, and the family's own configuration rules. The
config, the model factory, the trainer and the Megatron-LM entry ask the spec; none of them
branches on the family's name (docs/architecture.md, "Model families").

Add a family by registering a ``FamilySpec`` in :data:`FAMILIES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from .config import Config, latent_shape, token_grid_of

__all__ = ["FamilySpec", "SampleLayout", "FAMILIES", "family_names", "get_family"]


@dataclass(frozen=True)
class SampleLayout:
    """How one sample is laid out for the model: the Balanced SP layout (None for plain frame order),
    the token geometry and the number of tokens the model processes per sample."""
    layout: Optional[object]
    geometry: object
    seq_length: int


@dataclass(frozen=True)
class FamilySpec:
    name: str
    layer_type: str                          # VideoDiTConfig.layer_type: "full" | "stdit"
    objectives: Tuple[str, ...]              # admitted diffusion.objective values; the first is the default
    autoregressive: bool                     # Balanced SP teacher forcing ([clean ; noisy] per rank)
    model: Callable[[], type]                # the model class (imported on use)
    check: Callable[[Config, int], None]     # family-specific configuration rules (ValueError),
                                             # called by config.validate
    summary: str
    needs_vae: bool = True                   # latents from the cached causal VAE (the diffusion families)

    @property
    def default_objective(self) -> str:
        return self.objectives[0]

    def check_objective(self, objective: str) -> None:
        if objective not in self.objectives:
            allowed = " or ".join(repr(o) for o in self.objectives)
            raise ValueError(f"diffusion.objective ({objective!r}) must be {allowed} for model.family "
                             f"{self.name!r}" + (" (teacher forcing trains with flow matching)"
                                                 if self.autoregressive else ""))

    def build_model(self, tcfg, pre_process: bool = True, post_process: bool = True, vp_stage=None,
                    config: Optional[Config] = None):
        return self.model()(tcfg, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    def transformer_config(self, config: Config, has_gpu: bool = False):
        """The Megatron ``TransformerConfig`` of the model (``model_factory.transformer_config``)."""
        from .model_factory import transformer_config

        return transformer_config(config, has_gpu)

    def megatron_lm_config(self, base, config: Config):
        """The model's ``TransformerConfig`` from ``base``, the one Megatron-LM built from its
        command line: only the video fields are added (``model_factory.video_transformer_config``)."""
        from .model_factory import video_transformer_config

        return video_transformer_config(base, config)

    def check_megatron_lm_args(self, config: Config, args) -> None:
        """Family rules on Megatron-LM's arguments (``training.megatron_lm``; ``ValueError`` naming
        the flag). The shared ones -- sizes, ``--seq-length`` -- are checked there."""

    def make_batches(self, config: Config, **kw):
        """This rank's micro-batch maker (``data.BatchMaker``: VAE latents, noise, timesteps)."""
        from .data import BatchMaker

        return BatchMaker(config, **kw)

    def sample_layout(self, config: Config, cp_size: int) -> SampleLayout:
        from megatron_video.layouts.geometry import VideoGeometry

        F, _, _ = latent_shape(config)
        T, Hp, Wp = token_grid_of(config)
        if self.autoregressive:
            from megatron_video.layouts.balanced_sp import BalancedSPLayout

            p = config.parallel
            layout = BalancedSPLayout(F, Hp * Wp, config.model.frames_per_block, cp_size,
                                      ring_size=p.ring_size, ring_balance=p.ring_balance)
            return SampleLayout(layout, VideoGeometry(F, Hp, Wp), 2 * F * Hp * Wp)
        return SampleLayout(None, VideoGeometry(T, Hp, Wp), T * Hp * Wp)

    def seq_length(self, config: Config) -> int:
        """Tokens per sample that the model processes (no process groups needed)."""
        T, Hp, Wp = token_grid_of(config)
        return (2 if self.autoregressive else 1) * T * Hp * Wp

    def make_objective(self, config: Config, groups, sample: SampleLayout):
        from .objectives import EDMObjective, FlowObjective, TeacherForcing

        if self.autoregressive:
            return TeacherForcing(sample.layout, groups, sample.geometry)
        if config.objective == "edm":
            return EDMObjective(config.diffusion.sigma_data, sample.geometry)
        return FlowObjective(sample.geometry)


# ----------------------------------------------------------------------------------------------
# Family-specific rules
# ----------------------------------------------------------------------------------------------
def _whole_frames_per_cp_rank(config: Config, world_size: int) -> None:
    d, p = config.data, config.parallel
    F, _, _ = latent_shape(config)
    pt = config.model.patch_size[0]
    T_tok = F // pt
    if T_tok % p.context_parallel_size:
        raise ValueError(f"data.num_frames ({d.num_frames} raw -> {F} latent -> {T_tok} token frames with "
                         f"patch {pt}) must give token frames divisible by parallel.context_parallel_size "
                         f"({p.context_parallel_size}): each CP rank holds whole frames")


def _check_stdit(config: Config, world_size: int) -> None:
    _whole_frames_per_cp_rank(config, world_size)
    from megatron_video.models.stdit import VARIANTS

    m, p = config.model, config.parallel
    H, TP, CP = m.num_attention_heads, p.tensor_model_parallel_size, p.context_parallel_size
    if m.stdit_variant not in VARIANTS:
        raise ValueError(f"model.stdit_variant ({m.stdit_variant!r}) must be one of {VARIANTS}")
    bad = [x for x in m.stdit_full_attention_layers if not 1 <= x <= m.num_layers]
    if bad:
        raise ValueError(f"model.stdit_full_attention_layers ({bad}) must lie in [1, model.num_layers "
                         f"({m.num_layers})]")
    if m.stdit_variant == "ulysses_everywhere" and (H // TP) % CP:
        raise ValueError(f"model.num_attention_heads ({H}) / tensor_model_parallel_size ({TP}) must be "
                         f"divisible by parallel.context_parallel_size ({CP}) for stdit_variant "
                         f"'ulysses_everywhere'")


def _check_ar_dit(config: Config, world_size: int) -> None:
    m, p, d = config.model, config.parallel, config.data
    F, h, w = latent_shape(config)
    pt, ph, pw = m.patch_size
    if pt != 1:
        raise ValueError(f"model.patch_size[0] ({pt}) must be 1 for model.family 'ar_dit' (a latent "
                         f"frame is the autoregressive unit)")
    balance = p.ring_balance if p.ring_balance is not None else p.ring_size > 1
    if balance and p.placement == "ring_inner":
        raise ValueError("parallel.ring_balance (True; the default when ring_size > 1) needs "
                         "parallel.placement 'ulysses_inner' for model.family 'ar_dit'; set "
                         "parallel.ring_balance: false to use 'ring_inner'")
    from megatron_video.layouts.balanced_sp import BalancedSPLayout

    try:
        BalancedSPLayout(F, (h // ph) * (w // pw), m.frames_per_block, p.context_parallel_size,
                         ring_size=p.ring_size, ring_balance=p.ring_balance, world_size=world_size,
                         num_heads=m.num_attention_heads // p.tensor_model_parallel_size,
                         ulysses_size=p.ulysses_size)
    except ValueError as e:
        raise ValueError(f"data.num_frames ({d.num_frames} raw -> {F} latent frames) / "
                         f"model.frames_per_block ({m.frames_per_block}) / parallel: {e}") from None


def _video_dit():
    from megatron_video.models.video_dit import VideoDiT
    return VideoDiT


def _ar_dit():
    from megatron_video.models.ar_dit import ARVideoDiT
    return ARVideoDiT


FAMILIES: Dict[str, FamilySpec] = {
    "video_dit": FamilySpec("video_dit", "full", ("edm", "flow"), False, _video_dit,
                            _whole_frames_per_cp_rank,
                            "full 3D attention over all frames (2D attention under CP)"),
    "stdit": FamilySpec("stdit", "stdit", ("edm", "flow"), False, _video_dit, _check_stdit,
                        "spatial / temporal attention with the ST-DiT hybrid CP<->DP transitions"),
    "ar_dit": FamilySpec("ar_dit", "full", ("flow",), True, _ar_dit, _check_ar_dit,
                         "causal autoregressive DiT, Balanced SP teacher forcing"),
}


from .vlm import FAMILY_LIST as _MORE  # noqa: E402  (families defined outside this module)

FAMILIES.update({f.name: f for f in _MORE})


def family_names() -> Tuple[str, ...]:
    return tuple(FAMILIES)


def get_family(name: str) -> FamilySpec:
    """The spec of ``model.family`` ``name``; ``ValueError`` naming the field otherwise."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"model.family ({name!r}) must be one of {family_names()}") from None
