"""A small causal video VAE: causal 3D convolutions, 4x temporal and 8x spatial compression.

Temporal rule (``causal_first_frame``): latent 0 <- raw frame 0, latent ``k`` <- raw frames
``4k-3..4k``; ``T = 1 + 4(F-1)`` raw frames <-> ``F`` latents. Every temporal op is causal (left
zero padding of ``kernel - 1`` frames) and declares ``causal_time_op`` so that
``megatron_video.models.vae_halo_probe.temporal_receptive_field`` derives the SP halo from the network
itself. Nothing mixes frames except these convolutions (no temporal norms), which is what makes
windowed encoding exact. Tensors are ``[B, C, T, H, W]``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CausalConv3d",
    "CausalTemporalUpsample",
    "CausalVideoEncoder",
    "CausalVideoDecoder",
    "CausalVideoVAE",
]

TEMPORAL_STRIDE = 4
SPATIAL_STRIDE = 8


class CausalConv3d(nn.Module):
    """Conv3d, causal in time (left pad ``kt-1`` zero frames), 'same' spatial padding."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel: Tuple[int, int, int] = (3, 3, 3),
        stride: Tuple[int, int, int] = (1, 1, 1),
    ):
        super().__init__()
        kt, kh, kw = kernel
        self.time_pad = kt - 1
        self.causal_time_op = (kt, stride[0], kt - 1)
        self.conv = nn.Conv3d(
            in_channels, out_channels, kernel, stride=stride, padding=(0, kh // 2, kw // 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 0, 0, 0, self.time_pad, 0)))


class CausalTemporalUpsample(nn.Module):
    """x2 in time and space, causal: input frame 0 -> output frame 0, input ``j`` -> ``2j-1, 2j``."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.out_channels = out_channels
        self.conv = CausalConv3d(in_channels, 2 * out_channels, (3, 3, 3))
        self.refine = CausalConv3d(out_channels, out_channels, (1, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, t, h, w = x.shape
        y = self.conv(x).view(b, 2, self.out_channels, t, h, w)
        # interleave the two phases: frame 2j+p <- phase p of input j; frame 0 has no predecessor
        y = y.permute(0, 2, 3, 1, 4, 5).reshape(b, self.out_channels, 2 * t, h, w)[:, :, 1:]
        y = F.interpolate(y, scale_factor=(1, 2, 2), mode="nearest")
        return self.refine(y)


class _Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = CausalConv3d(channels, channels, (3, 3, 3))

    def forward(self, x):
        return x + self.conv(F.silu(x))


class CausalVideoEncoder(nn.Module):
    """Video ``[B, C, 1+4(F-1), 8h, 8w]`` -> moments ``[B, 2*z, F, h, w]`` (mean, logvar).

    Modules are registered in execution order (the receptive-field derivation relies on it).
    """

    def __init__(self, in_channels: int = 3, latent_channels: int = 4, base_channels: int = 8):
        super().__init__()
        c = base_channels
        self.in_channels, self.latent_channels = in_channels, latent_channels
        self.conv_in = CausalConv3d(in_channels, c, (3, 3, 3))
        self.down1 = CausalConv3d(c, c, (2, 3, 3), stride=(2, 2, 2))
        self.res1 = _Residual(c)
        self.down2 = CausalConv3d(c, 2 * c, (2, 3, 3), stride=(2, 2, 2))
        self.down3 = CausalConv3d(2 * c, 2 * c, (1, 3, 3), stride=(1, 2, 2))
        self.conv_out = CausalConv3d(2 * c, 2 * latent_channels, (1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_video(x, self.in_channels)
        x = F.silu(self.conv_in(x))
        x = self.res1(F.silu(self.down1(x)))
        x = F.silu(self.down2(x))
        x = F.silu(self.down3(x))
        return self.conv_out(x)


class CausalVideoDecoder(nn.Module):
    """Latents ``[B, z, F, h, w]`` -> video ``[B, C, 1+4(F-1), 8h, 8w]`` (causal in time)."""

    def __init__(self, out_channels: int = 3, latent_channels: int = 4, base_channels: int = 8):
        super().__init__()
        c = base_channels
        self.latent_channels = latent_channels
        self.conv_in = CausalConv3d(latent_channels, 2 * c, (3, 3, 3))
        self.up3 = CausalConv3d(2 * c, 2 * c, (1, 3, 3))
        self.up2 = CausalTemporalUpsample(2 * c, c)
        self.res = _Residual(c)
        self.up1 = CausalTemporalUpsample(c, c)
        self.conv_out = CausalConv3d(c, out_channels, (3, 3, 3))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if z.dim() != 5 or z.shape[1] != self.latent_channels:
            raise ValueError(
                f"latents shape ({tuple(z.shape)}) must be [B, {self.latent_channels}, F, h, w]"
            )
        x = F.silu(self.conv_in(z))
        x = F.silu(self.up3(F.interpolate(x, scale_factor=(1, 2, 2), mode="nearest")))
        x = self.res(F.silu(self.up2(x)))
        x = F.silu(self.up1(x))
        return self.conv_out(x)


def _check_video(x: torch.Tensor, channels: int) -> None:
    if x.dim() != 5 or x.shape[1] != channels:
        raise ValueError(f"video shape ({tuple(x.shape)}) must be [B, {channels}, T, H, W]")
    t, h, w = x.shape[2:]
    if (t - 1) % TEMPORAL_STRIDE:
        raise ValueError(f"num_frames ({t}) must be 1 + {TEMPORAL_STRIDE}*k (causal first frame)")
    if h % SPATIAL_STRIDE or w % SPATIAL_STRIDE:
        raise ValueError(f"frame size ({h}x{w}) must be divisible by {SPATIAL_STRIDE}")


class CausalVideoVAE(nn.Module):
    """Causal video VAE with a diagonal-Gaussian posterior (``encode``/``decode``/``loss``)."""

    temporal_stride = TEMPORAL_STRIDE
    spatial_stride = SPATIAL_STRIDE

    def __init__(self, in_channels: int = 3, latent_channels: int = 4, base_channels: int = 8):
        super().__init__()
        self.encoder = CausalVideoEncoder(in_channels, latent_channels, base_channels)
        self.decoder = CausalVideoDecoder(in_channels, latent_channels, base_channels)

    @staticmethod
    def split_moments(moments: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        mean, logvar = moments.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def encode(
        self, x: torch.Tensor, sample: bool = False, generator: Optional[torch.Generator] = None
    ) -> torch.Tensor:
        mean, logvar = self.split_moments(self.encoder(x))
        if not sample:
            return mean
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
        return mean + torch.exp(0.5 * logvar) * eps

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)

    def loss(
        self, x: torch.Tensor, kl_weight: float = 1e-4, generator: Optional[torch.Generator] = None
    ) -> Tuple[torch.Tensor, dict]:
        """Reconstruction MSE + ``kl_weight`` * KL(q(z|x) || N(0, I)) (per element means)."""
        mean, logvar = self.split_moments(self.encoder(x))
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
        recon = self.decoder(mean + torch.exp(0.5 * logvar) * eps)
        rec = F.mse_loss(recon, x)
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        return rec + kl_weight * kl, {"recon": rec.detach(), "kl": kl.detach()}
