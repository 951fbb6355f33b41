"""TI2V / I2V first-frame conditioning in training (``wan`` / ``wan_ar``): ``data.i2v_probability``
and its default. The tensor rules (which tokens are the condition, their timestep and loss) are
``diffusion.ti2v``'s; the per-sample draw is ``batches.fixed.clip_draws``'."""

from __future__ import annotations

from .config import Config
from .family_spec import get_family

__all__ = ["TI2V_LATENT_CHANNELS", "i2v_probability_of"]

TI2V_LATENT_CHANNELS = (
    48  # Wan 2.2's VAE: the latent space of Wan2.2-TI2V-5B (one model, T2V + I2V)
)


def i2v_probability_of(config: Config) -> float:
    """``data.i2v_probability``, or its default (null): 0.5 for a family that reads it on Wan 2.2's
    48-channel latents (Wan2.2-TI2V-5B is trained for both tasks; its mix is not published, so
    equal shares), else 0 (Wan 2.1 / 2.2 T2V models have no I2V task)."""
    p = config.data.i2v_probability
    if p is not None:
        return float(p)
    reads = "data.i2v_probability" in get_family(config.model.family).model_fields
    return 0.5 if reads and config.vae.latent_channels == TI2V_LATENT_CHANNELS else 0.0
