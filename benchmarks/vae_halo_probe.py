"""The halo of the Wan 2.1 VAE (diffusers' ``AutoencoderKLWan``, its default = the released Wan 2.1
configuration, RANDOM weights: the look-back is structural) derived by ``models.vae_halo_probe.probe_halo``,
next to the 28 raw frames of history LongLive hard-codes for its windowed VAE encoding.

Also measures, for the derived halo ``h`` and ``h - 1`` .. ``h - k``, the largest error of a
windowed encoding against the full-clip encoding (float64), to show what a shorter halo costs with
random weights (trained weights decay faster; exactness needs ``h``).

    python benchmarks/vae_halo_probe.py [--hw 16] [--latents 32] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from megatron_video.layouts.vae_halo import halo_window, num_raw_frames  # noqa: E402
from megatron_video.models.vae_halo_probe import probe_halo  # noqa: E402

LONGLIVE_RAW_FRAMES = 28


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--hw", type=int, default=16, help="probe frame size (pixels)")
    ap.add_argument(
        "--tiny", action="store_true", help="the tiny config of tests/test_vae_halo_probe.py"
    )
    ap.add_argument("--shorter", type=int, default=3, help="also measure halos h-1 .. h-SHORTER")
    args = ap.parse_args()
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    kw = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1) if args.tiny else {}
    vae = AutoencoderKLWan(**kw).eval()
    n = sum(p.numel() for p in vae.parameters())
    print(
        f"AutoencoderKLWan({'tiny' if args.tiny else 'Wan 2.1 default config'}): {n / 1e6:.1f} M "
        f"parameters, random weights; probe at {args.hw}x{args.hw}, float64"
    )
    encode = lambda x: vae.encode(x).latent_dist.mean  # noqa: E731
    t0 = time.time()
    p = probe_halo(encode, spatial=(args.hw, args.hw))
    dt = time.time() - t0
    st = p.temporal_stride  # the stride the probe checked the encoder's latent count against
    longlive = LONGLIVE_RAW_FRAMES // st
    print(
        f"derived: look-back {p.lookback} raw frames -> halo {p.halo} latents = "
        f"{st * p.halo} raw frames "
        f"(+1 first-frame pseudo frame) [probe clip {p.probe_latents} latents, {dt:.1f} s]"
    )
    print(
        f"LongLive hard-codes {LONGLIVE_RAW_FRAMES} raw frames = {longlive} latents: "
        f"{'enough' if longlive >= p.halo else 'NOT exact'} for this architecture "
        f"(ratio derived/LongLive = {st * p.halo / LONGLIVE_RAW_FRAMES:.2f})"
    )
    vae.double()
    N = p.probe_latents
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, num_raw_frames(N, st), args.hw, args.hw, generator=g, dtype=torch.float64)
    with torch.no_grad():
        full = encode(x)[:, :, -1:]
        scale = float(full.abs().max())
        print("halo (latents) | raw frames | max |windowed - full| of the last latent (relative)")
        for h in [p.halo - k for k in range(args.shorter + 1)] + [longlive]:
            if h < 0:
                continue
            w = halo_window(N - 1, N, h, st)
            err = float((encode(w.slice_raw(x))[:, :, -1:] - full).abs().max()) / scale
            tag = " (LongLive)" if h == longlive else (" (derived)" if h == p.halo else "")
            print(f"{h:14d} | {st * h:10d} | {err:.3e}{tag}")


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
