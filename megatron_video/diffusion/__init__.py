"""Diffusion objectives and samplers: EDM, flow matching, Heun/Euler samplers, classifier-free guidance."""

from .cfg import classifier_free_guidance, drop_condition, guided_denoise
from .edm import (
    EDMConfig,
    EDMPrecond,
    edm_loss,
    edm_loss_weight,
    edm_scalings,
    expand_like,
    reduce_token_loss,
    sample_sigma,
)
from .flow_matching import (
    expand_block_timesteps,
    fm_interpolate,
    fm_loss,
    fm_target,
    sample_timesteps,
    shift_timesteps,
)
from .samplers import (
    edm_euler_sampler,
    edm_heun_sampler,
    edm_sampler,
    flow_euler_sampler,
    flow_timesteps,
    karras_sigmas,
)

__all__ = [
    "EDMConfig",
    "EDMPrecond",
    "edm_loss",
    "edm_loss_weight",
    "edm_scalings",
    "expand_like",
    "reduce_token_loss",
    "sample_sigma",
    "expand_block_timesteps",
    "fm_interpolate",
    "fm_loss",
    "fm_target",
    "sample_timesteps",
    "shift_timesteps",
    "edm_euler_sampler",
    "edm_heun_sampler",
    "edm_sampler",
    "flow_euler_sampler",
    "flow_timesteps",
    "karras_sigmas",
    "classifier_free_guidance",
    "drop_condition",
    "guided_denoise",
]
from .teacher_forcing import (  # noqa: E402
    TeacherForcingMask,
    TeacherForcingObjective,
    TeacherForcingOutput,
    local_frame_tokens,
)

__all__ += [
    "TeacherForcingMask",
    "TeacherForcingObjective",
    "TeacherForcingOutput",
    "local_frame_tokens",
]
