"""Model input/output pieces on one process: 3D patchify, CP sampling building blocks, AR sampling.

The multi-rank equivalence of whole models and of CP sampling is in ``test_models_parallel.py``.
"""

import pytest
import torch

from megatron_video.generation import cp_sampling as cps
from megatron_video.layouts.balanced_sp import BalancedSPLayout
from megatron_video.models.embedders import patchify, token_grid, unpatchify


def test_patchify_is_frame_major_and_inverts():
    x = torch.randn(2, 3, 4, 6, 8)
    tok = patchify(x, (2, 3, 2))
    assert tok.shape == (2, 2 * 2 * 4, 3 * 2 * 3 * 2)
    # token g = f*H'*W' + y*W' + x holds the patch at (2f.., 3y.., 2x..), channel-major inside
    f, y, xx = 1, 1, 2
    g = f * 2 * 4 + y * 4 + xx
    patch = x[:, :, 2 * f : 2 * f + 2, 3 * y : 3 * y + 3, 2 * xx : 2 * xx + 2]
    assert torch.equal(tok[:, g], patch.reshape(2, -1))
    assert torch.equal(unpatchify(tok, (2, 3, 2), (2, 2, 4), 3), x)
    # a rank's frames patchify to its contiguous slice of the global tokens
    assert torch.equal(patchify(x[:, :, 2:4], (2, 3, 2)), tok[:, 8:16])
    with pytest.raises(
        ValueError, match=r"latent height \(6\) must be divisible by patch size \(4\)"
    ):
        token_grid((4, 6, 8), (1, 4, 2))


def test_partition_gather_roundtrip():
    x = torch.randn(2, 12, 5)
    ids = torch.tensor([3, 0, 7, 1, 2, 4, 5, 6, 8, 9, 10, 11])
    assert torch.equal(cps.gather_tokens(cps.partition_tokens(x, ids), ids, None, 12), x)
    with pytest.raises(ValueError, match="must partition range"):
        cps.gather_tokens(x[:, :11], ids[:11], None, 12)


def test_edm_denoiser_preconditioning():
    sig = torch.tensor([0.3, 2.0])
    x = torch.randn(2, 4, 3)
    seen = {}

    def net(x_in, c_noise, cond):
        seen["x_in"], seen["c_noise"] = x_in, c_noise
        return torch.ones_like(x_in)

    out = cps.edm_denoiser(net, sigma_data=0.5)(x, sig, None)
    s2 = sig[:, None, None] ** 2
    assert torch.allclose(seen["x_in"], x / torch.sqrt(s2 + 0.25))
    assert torch.allclose(seen["c_noise"], torch.log(sig) / 4)
    assert torch.allclose(
        out, 0.25 / (s2 + 0.25) * x + sig[:, None, None] * 0.5 / torch.sqrt(s2 + 0.25)
    )


def test_autoregressive_sampling_matches_block_oracle():
    """Block-by-block generation on the teacher-forcing sequence == an oracle that generates each
    block from only the frames before it (the velocity is a masked mean, so it depends on exactly
    what the teacher-forcing mask lets a token see)."""
    F, S, nb, C, steps = 6, 2, 2, 3, 4
    lay = BalancedSPLayout(F, S, nb, 1)
    allow = lay.teacher_forcing_mask().double()  # attention order == [clean; noisy]
    weights = allow / allow.sum(1, keepdim=True)

    def velocity(x, t, cond):
        return (weights @ x) * (1 + t[..., None]) - 0.5 * x

    g = torch.Generator().manual_seed(0)
    noise = torch.randn(1, F * S, C, generator=g, dtype=torch.float64)
    got = cps.sample_autoregressive(velocity, lay, 0, noise, None, num_steps=steps)

    ts = [float(v) for v in torch.linspace(1, 0, steps + 1, dtype=torch.float64)]
    done = []  # generated blocks, oracle side
    for j in range(F // nb):
        ctx = torch.cat(done, dim=1) if done else noise[:, :0]
        z = noise[:, j * nb * S : (j + 1) * nb * S].clone()
        for i in range(steps):
            # a noisy token of block j sees the clean frames of blocks < j and its own block
            vis = torch.cat([ctx, z], dim=1)
            v = vis.mean(dim=1, keepdim=True) * (1 + ts[i]) - 0.5 * z
            z = z + (ts[i + 1] - ts[i]) * v
        done.append(z)
    assert torch.allclose(got, torch.cat(done, dim=1), rtol=0, atol=1e-12)
