"""The video-generation families: ``video_dit``, ``stdit`` and ``ar_dit`` (VAE latents, diffusion).

:class:`DiffusionFamily` holds what these share (the VAE latents of ``batches.FixedBatchMaker``,
the ``VideoDiTConfig`` of ``training.model_factory``, the objectives of ``training.objectives``);
each family adds its layer type, model class, admitted objectives and configuration rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_video.layouts.balanced_sp import BalancedSPLayout, check_whole_blocks
from megatron_video.layouts.geometry import VideoGeometry
from megatron_video.models.ar_dit import ARVideoDiT
from megatron_video.models.stdit import VARIANTS
from megatron_video.models.video_dit import VideoDiT

from ..batches.fixed import FixedBatchMaker
from ..batches.placed import PlacedBatchMaker, tokens_placed
from ..config import Config, latent_shape, token_grid_of
from ..family_spec import FamilySpec, SampleLayout, get_family, register_family
from ..model_factory import transformer_config, video_transformer_config
from ..objectives import EDMObjective, FlowObjective, PackedObjective, TeacherForcing

__all__ = ["DiffusionFamily", "VIDEO_DIT", "STDIT", "AR_DIT"]


@dataclass(frozen=True, kw_only=True)
class DiffusionFamily(FamilySpec):
    """A DiT on VAE latents trained with EDM or flow matching (``autoregressive``: Balanced SP
    teacher forcing, ``[clean ; noisy]`` per rank, per-block flow timesteps)."""

    layer_type: str  # VideoDiTConfig.layer_type: "full" | "stdit"
    autoregressive: bool
    model: type  # built as model(tcfg, pre_process=, post_process=, vp_stage=)
    needs_vae: bool = True

    @property
    def objective_note(self) -> str:
        return " (teacher forcing trains with flow matching)" if self.autoregressive else ""

    def check_rl(self, config: Config) -> None:
        """``train.objective: grpo``: Flow-GRPO where the family has the trainer and trains with
        flow matching (``rl.rules.check_flow_rl``); else refused, naming the reason."""
        from megatron_video.rl.rules import check_flow_rl, refuse_rl

        from ..batches.placed import tokens_placed
        from ..family_spec import rl_families

        if dict(self.trainers).get("grpo") and config.objective == "flow":
            return check_flow_rl(config, tokens_placed(config, self), self.autoregressive)
        refuse_rl(self.name, config.objective, rl_families())

    def transformer_config(self, config: Config, has_gpu: bool = False):
        """``model_factory.transformer_config``."""
        return transformer_config(config, has_gpu)

    def build_model(
        self,
        tcfg,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage=None,
        config: Config = None,
    ):
        model = self.model(
            tcfg, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
        if config is not None and config.model.init_from is not None:  # collective
            from ..checkpoint import load_model_weights

            load_model_weights(_init_from(config), model)
        return model

    def megatron_lm_config(self, base, config: Config):
        """``base`` plus only the video fields (``model_factory.video_transformer_config``)."""
        return video_transformer_config(base, config)

    def check_megatron_lm_args(self, config: Config, args) -> None:
        """No rules beyond the shared ones."""

    def make_batches(self, config: Config, *, coords, **kw) -> FixedBatchMaker:
        """``batches.fixed.FixedBatchMaker``: VAE latents, noise, timesteps; at a CP size that
        does not divide the token frames, ``batches.placed.PlacedBatchMaker`` (by token)."""
        log = kw.pop("log", None)  # the console rank's printer (the placement, once)
        if tokens_placed(config, self):
            return PlacedBatchMaker(config, coords, self.packed_kind, log=log, **kw)
        return FixedBatchMaker(config, coords, **kw)

    def sample_layout(self, config: Config, cp_size: int) -> SampleLayout:
        F, _, _ = latent_shape(config)
        T, Hp, Wp = token_grid_of(config)
        if self.autoregressive and tokens_placed(config, self):  # batches.placed, by token
            return SampleLayout(None, VideoGeometry(F, Hp, Wp), 2 * F * Hp * Wp)
        if self.autoregressive:
            p = config.parallel
            layout = BalancedSPLayout(
                F,
                Hp * Wp,
                config.model.frames_per_block,
                cp_size,
                ring_size=p.ring_size,
                ring_balance=p.ring_balance,
            )
            return SampleLayout(layout, VideoGeometry(F, Hp, Wp), 2 * F * Hp * Wp)
        return SampleLayout(None, VideoGeometry(T, Hp, Wp), T * Hp * Wp)

    def seq_length(self, config: Config) -> int:
        T, Hp, Wp = token_grid_of(config)
        return (2 if self.autoregressive else 1) * T * Hp * Wp

    def make_objective(self, config: Config, groups, sample: SampleLayout):
        if tokens_placed(config, self):  # batches.placed: packed micro-batches of one shape
            return self.make_packed_objective(config)
        if self.autoregressive:
            return TeacherForcing(sample.layout, groups, sample.geometry)
        if config.objective == "edm":
            return EDMObjective(config.diffusion.sigma_data, sample.geometry)
        return FlowObjective(sample.geometry)

    def make_packed_objective(self, config: Config):
        """``objectives.PackedObjective``: teacher forcing (AR) or the configured T2V objective."""
        if self.packed_kind is None:
            return super().make_packed_objective(config)
        kind = "teacher_forcing" if self.autoregressive else config.objective
        return PackedObjective(kind, config.diffusion.sigma_data)


# ----------------------------------------------------------------------------------------------
# Family-specific rules
# ----------------------------------------------------------------------------------------------
def _whole_frames_per_cp_rank(config: Config, world_size: int) -> None:
    """ST-DiT: each CP rank holds whole frames (its spatial / temporal layouts A / B)."""
    d, p = config.data, config.parallel
    F, _, _ = latent_shape(config)
    pt = config.model.patch_size[0]
    T_tok = F // pt
    if T_tok % p.context_parallel_size:
        raise ValueError(
            f"data.num_frames ({d.num_frames} raw -> {F} latent -> {T_tok} token "
            f"frames with patch {pt}) must give token frames divisible by "
            f"parallel.context_parallel_size ({p.context_parallel_size}) for model.family "
            f"{config.model.family!r}: ST-DiT's spatial attention (layout A: whole frames per "
            f"rank) and temporal attention (layout B: whole frame columns) need whole frames on "
            f"every CP rank; the full-attention families (video_dit, wan) place by token"
        )


def _tokens_per_cp_rank(config: Config, world_size: int) -> None:
    """Full attention places by token (``batches.placed``): any clip length at any CP size of at
    most the clip's tokens (a rank of padding only would hold no work)."""
    d, p = config.data, config.parallel
    T, Hp, Wp = token_grid_of(config)
    if p.context_parallel_size > T * Hp * Wp:
        raise ValueError(
            f"parallel.context_parallel_size ({p.context_parallel_size}) must be at most the "
            f"tokens of a clip ({T * Hp * Wp} = {T} x {Hp} x {Wp} from data.num_frames "
            f"{d.num_frames}, data.height {d.height}, data.width {d.width} over "
            f"model.patch_size {list(config.model.patch_size)}): every CP rank holds at least "
            f"one real token"
        )


def _check_stdit(config: Config, world_size: int) -> None:
    _whole_frames_per_cp_rank(config, world_size)
    m, p = config.model, config.parallel
    H, TP, CP = m.num_attention_heads, p.tensor_model_parallel_size, p.context_parallel_size
    if m.stdit_variant not in VARIANTS:
        raise ValueError(f"model.stdit_variant ({m.stdit_variant!r}) must be one of {VARIANTS}")
    bad = [x for x in m.stdit_full_attention_layers if not 1 <= x <= m.num_layers]
    if bad:
        raise ValueError(
            f"model.stdit_full_attention_layers ({bad}) must lie in [1, "
            f"model.num_layers ({m.num_layers})]"
        )
    if m.stdit_variant == "ulysses_everywhere" and (H // TP) % CP:
        raise ValueError(
            f"model.num_attention_heads ({H}) / tensor_model_parallel_size ({TP}) "
            f"must be divisible by parallel.context_parallel_size ({CP}) for "
            f"stdit_variant 'ulysses_everywhere'"
        )


def _init_from(config: Config):
    """``model.init_from`` (``ar_dit``): a run folder of the same model (e.g. ``make demo``'s
    ``runs/demo``) or its ``checkpoints`` folder; its newest checkpoint's weights start the model
    (GRPO's policy and reference)."""
    from .video_llava import _init_from_dir  # the one rule of a run folder

    return _init_from_dir(config.model.init_from, "examples/configs/demo.yaml")


def _check_ar_dit_family(config: Config, world_size: int) -> None:
    """``ar_dit``'s rules: its ``model.init_from`` (a run folder) and the AR rules it shares with
    ``wan_ar`` (whose ``model.init_from`` is a diffusers folder: ``families/wan.py``)."""
    if config.model.init_from is not None:
        _init_from(config)
    _check_ar_dit(config, world_size)


def _check_ar_dit(config: Config, world_size: int) -> None:
    m, p, d = config.model, config.parallel, config.data
    F, h, w = latent_shape(config)
    pt, ph, pw = m.patch_size
    if pt != 1:
        raise ValueError(
            f"model.patch_size[0] ({pt}) must be 1 for model.family {m.family!r} (a "
            f"latent frame is the autoregressive unit)"
        )
    balance = p.ring_balance if p.ring_balance is not None else p.ring_size > 1
    if balance and p.placement == "ring_inner":
        raise ValueError(
            "parallel.ring_balance (True; the default when ring_size > 1) needs "
            f"parallel.placement 'ulysses_inner' for model.family {m.family!r}; set "
            "parallel.ring_balance: false to use 'ring_inner'"
        )
    if tokens_placed(config, get_family(m.family)):  # uneven blocks: placed by token
        return _check_placed_blocks(config)
    try:
        BalancedSPLayout(
            F,
            (h // ph) * (w // pw),
            m.frames_per_block,
            p.context_parallel_size,
            ring_size=p.ring_size,
            ring_balance=p.ring_balance,
            world_size=world_size,
            num_heads=m.num_attention_heads // p.tensor_model_parallel_size,
            ulysses_size=p.ulysses_size,
        )
    except ValueError as e:
        raise ValueError(
            f"data.num_frames ({d.num_frames} raw -> {F} latent frames) / "
            f"model.frames_per_block ({m.frames_per_block}) / parallel: {e}"
        ) from None


def _check_placed_blocks(config: Config) -> None:
    """AR clips placed by token (``batches.placed``; Balanced SP needs latent frames a multiple
    of CP x frames_per_block): whole blocks, a CP size of at most a clip's tokens."""
    m, d = config.model, config.data
    F, _, _ = latent_shape(config)
    try:
        check_whole_blocks(F, m.frames_per_block)
    except ValueError as e:
        raise ValueError(
            f"data.num_frames ({d.num_frames} raw -> {F} latent frames) / "
            f"model.frames_per_block ({m.frames_per_block}): {e}"
        ) from None
    _tokens_per_cp_rank(config, 0)
    _, Hp, Wp = token_grid_of(config)
    block, cp = m.frames_per_block * Hp * Wp, config.parallel.context_parallel_size
    if config.train.sample and cp > block:
        raise ValueError(
            f"train.sample (True) streams blocks of {block} tokens (model.frames_per_block "
            f"{m.frames_per_block} x {Hp * Wp}), which must be at least "
            f"parallel.context_parallel_size ({cp}): every CP rank holds at least one real token "
            f"of a block (generation/streaming.py pads a block to a multiple of the CP size); "
            f"set train.sample=false"
        )


VIDEO_DIT = register_family(
    DiffusionFamily(
        name="video_dit",
        summary="full 3D attention over all frames (2D attention under CP)",
        objectives=("edm", "flow"),
        layer_type="full",
        autoregressive=False,
        model=VideoDiT,
        check=_tokens_per_cp_rank,
        packed_kind="full",
        trainers=(("grpo", "megatron_video.training.grpo_dit:DiTGRPOTrainer"),),
    )
)
STDIT = register_family(
    DiffusionFamily(
        name="stdit",
        summary="spatial / temporal attention with the ST-DiT hybrid CP<->DP transitions",
        objectives=("edm", "flow"),
        layer_type="stdit",
        autoregressive=False,
        model=VideoDiT,
        check=_check_stdit,
        packed_refusal=(
            "ST-DiT's spatial / temporal attention needs a regular frame grid on every CP rank, "
            "which packed mixed-shape clips do not have (rule: packed clips are refused, not "
            "padded); use model.family 'video_dit' or leave data.buckets null"
        ),
    )
)
AR_DIT = register_family(
    DiffusionFamily(
        name="ar_dit",
        summary="causal autoregressive DiT, Balanced SP teacher forcing",
        objectives=("flow",),
        layer_type="full",
        autoregressive=True,
        model=ARVideoDiT,
        check=_check_ar_dit_family,
        packed_kind="teacher_forcing",
        trainers=(("grpo", "megatron_video.training.grpo_wan_ar:ARDiTGRPOTrainer"),),
        model_fields=("init_from",),
    )
)
