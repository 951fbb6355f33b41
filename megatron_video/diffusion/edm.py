"""EDM (Karras et al. 2022): preconditioning, log-normal sigma sampling, loss weighting and loss,
all elementwise on token-major tensors so that a sequence-parallel shard runs the same code; the
loss takes the GLOBAL loss-token count (``reduce_token_loss``, shared with ``flow_matching``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

__all__ = [
    "EDMConfig",
    "EDMPrecond",
    "edm_scalings",
    "edm_loss_weight",
    "sample_sigma",
    "edm_loss",
    "expand_like",
    "reduce_token_loss",
]


@dataclass(frozen=True)
class EDMConfig:
    """EDM hyper-parameters (defaults: the paper's values for images; sigma_data 0.5)."""

    sigma_data: float = 0.5
    p_mean: float = -1.2
    p_std: float = 1.2
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0

    def __post_init__(self):
        for name in ("sigma_data", "p_std", "sigma_min", "rho"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} ({value}) must be > 0")
        if not self.sigma_max > self.sigma_min:
            raise ValueError(f"sigma_max ({self.sigma_max}) must be > sigma_min ({self.sigma_min})")


def expand_like(value: Tensor, x: Tensor, name: str) -> Tensor:
    """View ``value`` (shape a prefix of ``x.shape``, size-1 entries allowed) with trailing unit
    dims.

    Shapes are token-major: ``x`` is ``[b, s, ...]`` (or any ``[b, ...]``). A per-sample or
    per-token quantity (sigma, loss mask) has a shape that is a *prefix* of ``x.shape`` (``[b]``,
    ``[b, s]``) and is broadcast over the trailing dims, so the same code runs on a shard ``[b, s/N,
    ...]``.
    """
    if value.dim() > x.dim():
        raise ValueError(
            f"{name} has {value.dim()} dims ({tuple(value.shape)}); must have at most "
            f"x.dim() ({x.dim()}) dims"
        )
    for i, n in enumerate(value.shape):
        if n not in (1, x.shape[i]):
            raise ValueError(
                f"{name} shape {tuple(value.shape)} must be a prefix of x shape "
                f"{tuple(x.shape)} (dim {i}: {n} vs {x.shape[i]})"
            )
    return value.reshape(tuple(value.shape) + (1,) * (x.dim() - value.dim()))


def _as_sigma(sigma: Union[Tensor, float], x: Tensor) -> Tensor:
    """A scalar sigma becomes one per sample ``[b]`` so the raw network always sees a batch of them."""
    sigma = torch.as_tensor(sigma, device=x.device)
    if not sigma.is_floating_point():
        sigma = sigma.to(torch.float32)
    if sigma.dim() == 0:
        sigma = sigma.expand(x.shape[0])
    return sigma


def edm_scalings(sigma: Tensor, sigma_data: float = 0.5) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(c_skip, c_out, c_in, c_noise)`` of EDM Table 1 for noise level(s) ``sigma``."""
    if not sigma_data > 0:
        raise ValueError(f"sigma_data ({sigma_data}) must be > 0")
    sd2 = sigma_data**2
    s2 = sigma * sigma
    c_skip = sd2 / (s2 + sd2)
    c_out = sigma * sigma_data / torch.sqrt(s2 + sd2)
    c_in = 1.0 / torch.sqrt(s2 + sd2)
    c_noise = torch.log(sigma) / 4.0
    return c_skip, c_out, c_in, c_noise


def edm_loss_weight(sigma: Tensor, sigma_data: float = 0.5) -> Tensor:
    """``lambda(sigma) = (sigma^2 + sigma_d^2) / (sigma * sigma_d)^2 = 1 / c_out^2``."""
    if not sigma_data > 0:
        raise ValueError(f"sigma_data ({sigma_data}) must be > 0")
    return (sigma * sigma + sigma_data**2) / (sigma * sigma_data) ** 2


def sample_sigma(
    shape,
    config: EDMConfig = EDMConfig(),
    *,
    generator: Optional[torch.Generator] = None,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Training noise levels: ``ln(sigma) ~ N(P_mean, P_std^2)``."""
    z = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    return torch.exp(config.p_mean + config.p_std * z)


class EDMPrecond(nn.Module):
    """Turn a raw network ``F(x_in, c_noise, cond)`` into the denoiser ``D(x, sigma, cond)``.

    ``D = c_skip * x + c_out * F(c_in * x, c_noise, cond)``. ``sigma`` is a scalar, ``[b]`` or a
    per-token prefix shape such as ``[b, s]``; ``c_noise`` is passed to ``F`` with that shape (a scalar
    becomes ``[b]``).
    """

    def __init__(self, net: nn.Module, sigma_data: float = 0.5):
        super().__init__()
        if not sigma_data > 0:
            raise ValueError(f"sigma_data ({sigma_data}) must be > 0")
        self.net = net
        self.sigma_data = float(sigma_data)

    def forward(self, x: Tensor, sigma: Union[Tensor, float], cond: Any = None) -> Tensor:
        sigma = _as_sigma(sigma, x)
        # Scalings in >= fp32 even for bf16 activations: c_noise = ln(sigma)/4 needs the precision.
        sigma_f = sigma.to(torch.promote_types(sigma.dtype, torch.float32))
        c_skip, c_out, c_in, c_noise = edm_scalings(sigma_f, self.sigma_data)
        c_skip, c_out, c_in = (
            expand_like(c, x, "sigma").to(x.dtype) for c in (c_skip, c_out, c_in)
        )
        f = self.net(c_in * x, c_noise, cond)
        return c_skip * x + c_out * f.to(x.dtype)


def reduce_token_loss(
    per_element: Tensor, loss_mask: Optional[Tensor], num_loss_tokens: Union[int, float, Tensor]
) -> Tensor:
    """Sum over loss tokens of the per-token mean (over trailing dims), divided by ``num_loss_tokens``.

    ``loss_mask`` (bool/0-1, shape a prefix of ``per_element.shape``) marks loss tokens; ``None`` means
    every ``[b, s]`` position (``[b]`` for 1-D input) is one. Under SP pass the GLOBAL token count.

    The loss is a sum over this rank's loss tokens divided by an explicit ``num_loss_tokens``: under
    sequence/context parallelism the caller passes the GLOBAL count, so the per-rank losses add up
    (via the gradient all-reduce) to exactly the single-GPU loss. A rank-local mean would weight
    ranks with few loss tokens too heavily.
    """
    if loss_mask is None:
        token_dims = min(2, per_element.dim())
        token_loss = (
            per_element.mean(dim=tuple(range(token_dims, per_element.dim())))
            if per_element.dim() > token_dims
            else per_element
        )
        local_count = token_loss.numel()
        if isinstance(num_loss_tokens, (int, float)) and num_loss_tokens < local_count:
            raise ValueError(
                f"num_loss_tokens ({num_loss_tokens}) must be >= the local loss-token count "
                f"({local_count}); pass the global count of loss tokens"
            )
        total = token_loss.sum()
    else:
        if loss_mask.dim() == 0 or tuple(loss_mask.shape) != tuple(
            per_element.shape[: loss_mask.dim()]
        ):
            raise ValueError(
                f"loss_mask shape {tuple(loss_mask.shape)} must be a prefix of the input "
                f"shape {tuple(per_element.shape)}"
            )
        dims = tuple(range(loss_mask.dim(), per_element.dim()))
        token_loss = per_element.mean(dim=dims) if dims else per_element
        total = (token_loss * loss_mask.to(token_loss.dtype)).sum()
    if isinstance(num_loss_tokens, (int, float)) and not num_loss_tokens > 0:
        raise ValueError(f"num_loss_tokens ({num_loss_tokens}) must be > 0")
    return total / num_loss_tokens


def edm_loss(
    denoiser: Callable[[Tensor, Tensor, Any], Tensor],
    x0: Tensor,
    *,
    num_loss_tokens: Union[int, float, Tensor],
    loss_mask: Optional[Tensor] = None,
    sigma: Optional[Tensor] = None,
    noise: Optional[Tensor] = None,
    cond: Any = None,
    config: EDMConfig = EDMConfig(),
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """EDM training loss ``sum_tokens lambda(sigma) * mean_d (D(x0 + sigma*n, sigma) - x0)^2 / N``.

    ``sigma`` (prefix shape, default one log-normal draw per sample) and ``noise`` (like ``x0``) are
    injectable so a sharded run can use exactly the single-GPU draws; otherwise they come from
    ``generator``. ``num_loss_tokens`` is required: the global count of loss tokens.
    """
    if sigma is None:
        sigma = sample_sigma((x0.shape[0],), config, generator=generator, device=x0.device)
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} must equal x0 shape {tuple(x0.shape)}")
    sigma_x = expand_like(sigma, x0, "sigma")
    denoised = denoiser(x0 + sigma_x.to(x0.dtype) * noise, sigma, cond)
    acc = torch.promote_types(x0.dtype, torch.float32)  # bf16 activations: reduce in fp32
    weight = edm_loss_weight(sigma_x.to(acc), config.sigma_data)
    per_element = weight * (denoised.to(acc) - x0.to(acc)) ** 2
    return reduce_token_loss(per_element, loss_mask, num_loss_tokens)
