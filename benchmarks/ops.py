"""megatron_video.ops: compiled kernels vs the pure-PyTorch references, in one run.

Halo scatter (8 ranks' raw-frame windows with a left halo out of a [B, C, T, H, W] video), halo
gather (kept latents of all ranks into one tensor), the dense mask and the tile status of the
teacher-forcing mask in Balanced-SP rank-major order, beside the best plain-torch formulation (per-tile
id bounds), and the share of an attention step spent on mask work. Prints times, bytes moved,
bandwidth against
a plain device copy of the same bytes, and the extension/reference time ratio.

    python benchmarks/ops.py                      # CPU, the default sizes
    python benchmarks/ops.py --device cuda        # what benchmarks/gpu_check.sh runs

The tile-status reference evaluates every query-key pair (O(L^2)); the kernel decides most tiles
from per-tile id bounds and scans only tiles that straddle a rule boundary, so that ratio is mostly
algorithmic. The copies are memory-bound: their ratio is bounded by the reference's extra passes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from megatron_video.layouts.vae_halo import window_tensors, windows_for_bounds  # noqa: E402
from megatron_video.ops import (  # noqa: E402
    ENV_VAR,
    TokenIds,
    block_mask_status,
    block_mask_status_reference,
    dense_mask,
    dense_mask_reference,
    halo_gather,
    halo_gather_reference,
    halo_scatter,
    halo_scatter_reference,
)

# The project's causal VAE strides (megatron_video.models.vae, whose package needs megatron-core,
# which the GPU machine lacks); tests/test_gpu_check.py checks that they agree.
VAE_TEMPORAL_STRIDE, VAE_SPATIAL_STRIDE = 4, 8


def timed(fn, device: torch.device, repeat: int) -> float:
    """Best wall time of ``repeat`` runs after one warm-up call (each allocates its output, as real
    calls do)."""
    del_out = fn()
    del del_out
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
        del out
    return best


def even_bounds(num: int, parts: int) -> list[tuple[int, int]]:
    cuts = [num * p // parts for p in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def row(
    name: str, t_ext: float, t_ref: float, moved: int | None = None, t_copy: float | None = None
) -> None:
    line = f"{name:<28} ext {t_ext * 1e3:9.2f} ms   ref {t_ref * 1e3:10.2f} ms   ratio {t_ref / t_ext:7.2f}x"
    if moved is not None:
        line += f"   moved {moved / 2**30:6.2f} GiB   {moved / t_ext / 1e9:7.1f} GB/s"
        if t_copy is not None:
            line += f" ({100 * t_copy / t_ext:5.1f}% of copy bandwidth)"
    print(line, flush=True)


def bench_halo(args, device: torch.device) -> None:
    dtype = getattr(torch, args.dtype)
    st, ss = VAE_TEMPORAL_STRIDE, VAE_SPATIAL_STRIDE
    F = (args.raw_frames - 1) // st + 1
    metas = windows_for_bounds(even_bounds(F, args.ranks), args.halo, temporal_stride=st)
    windows, drop = window_tensors(metas)
    video = torch.randn(1, 3, args.raw_frames, args.height, args.width, device=device, dtype=dtype)
    print(
        f"halo: video [1, 3, {args.raw_frames}, {args.height}, {args.width}] {args.dtype} "
        f"({video.numel() * video.element_size() / 2**30:.2f} GiB), {args.ranks} ranks, halo "
        f"{args.halo} latents, "
        f"windows {windows.tolist()}",
        flush=True,
    )
    packed = halo_scatter(video, windows)
    moved = 2 * packed.buffer.numel() * packed.buffer.element_size()  # read + write
    t_copy = timed(lambda p=packed: p.buffer.clone(), device, args.repeat)
    print(
        f"{'device copy (clone)':<28} {t_copy * 1e3:9.2f} ms   {moved / t_copy / 1e9:7.1f} GB/s",
        flush=True,
    )
    t_ext = timed(lambda x=video: halo_scatter(x, windows), device, args.repeat)
    t_ref = timed(lambda x=video: halo_scatter_reference(x, windows), device, args.repeat)
    row("halo_scatter", t_ext, t_ref, moved, t_copy)
    del packed, video
    # Inverse: 16-channel latents at the VAE's spatial stride, one tensor per rank.
    latents = [
        torch.randn(
            1,
            16,
            m.num_window_latents,
            args.height // ss,
            args.width // ss,
            device=device,
            dtype=dtype,
        )
        for m in metas
    ]
    out = halo_gather(latents, drop)
    moved = 2 * out.numel() * out.element_size()
    t_ext = timed(lambda: halo_gather(latents, drop), device, args.repeat)
    t_ref = timed(lambda: halo_gather_reference(latents, drop), device, args.repeat)
    row(f"halo_gather ({F} latents)", t_ext, t_ref, moved)


def rank_major_ids(frames: int, tokens: int, ranks: int, frames_per_block: int, device) -> TokenIds:
    """Teacher-forcing ids in Balanced-SP order [c_0 n_0 c_1 n_1 ...]."""
    side, frame = [], []
    for lo, hi in even_bounds(frames, ranks):
        fr = torch.arange(lo, hi).repeat_interleave(tokens)
        side += [torch.zeros_like(fr), torch.ones_like(fr)]
        frame += [fr, fr]
    return TokenIds.from_frames(
        torch.cat(frame).to(device), frames_per_block, side=torch.cat(side).to(device)
    )


def tile_status_from_bounds(ids: TokenIds, tile: int) -> torch.Tensor:
    """Teacher-forcing tile status from per-tile bounds of each side's blocks, in plain torch."""
    L = ids.side.numel()
    n = -(-L // tile)
    pad = n * tile - L
    big = torch.iinfo(torch.int64).max // 4
    side = torch.nn.functional.pad(ids.side, (0, pad), value=-1).view(n, tile)
    block = torch.nn.functional.pad(ids.block, (0, pad), value=0).view(n, tile)
    lo, hi, has = [], [], []
    for sd in (0, 1):
        on = side == sd
        lo.append(torch.where(on, block, big).amin(1))
        hi.append(torch.where(on, block, -big).amax(1))
        has.append(on.any(1))
    full = torch.ones(n, n, dtype=torch.bool, device=side.device)
    empty = torch.ones_like(full)
    for qs in (0, 1):
        for ks in (0, 1):
            present = has[qs][:, None] & has[ks][None, :]
            qlo, qhi, klo, khi = lo[qs][:, None], hi[qs][:, None], lo[ks][None, :], hi[ks][None, :]
            if qs == 0 and ks == 1:
                f, e = torch.zeros_like(full), torch.ones_like(full)
            elif ks == 0:
                f, e = (khi <= qlo, klo > qhi) if qs == 0 else (khi < qlo, klo >= qhi)
            else:
                f, e = (qlo == qhi) & (klo == khi) & (qlo == klo), (khi < qlo) | (klo > qhi)
            full &= ~present | f
            empty &= ~present | e
    return torch.where(empty, 0, torch.where(full, 2, 1)).to(torch.uint8)


def bench_mask_share(args) -> None:
    """Share of an attention step's time spent on mask work (tile status, tile masks, planning)."""
    from megatron_video.attention import RingStats, dist_attention
    from megatron_video.diffusion.teacher_forcing import TeacherForcingMask
    from megatron_video.layouts import BalancedSPLayout

    F, S = args.share_frames, args.share_tokens
    lay = BalancedSPLayout(
        num_latent_frames=F, tokens_per_frame=S, frames_per_block=args.frames_per_block, sp_size=1
    )
    L = 2 * F * S
    q, k, v = (torch.randn(1, L, 4, 32).requires_grad_() for _ in range(3))
    st = RingStats()
    t0 = time.perf_counter()
    dist_attention(q, k, v, None, mask=TeacherForcingMask(lay), stats=st).sum().backward()
    total = time.perf_counter() - t0
    print(
        f"mask share of a step: teacher forcing, {L} tokens (F={F}, {S} tokens/frame), H=4 D=32 fp32 fwd+bwd "
        f"{total:.2f} s, mask work {st.mask_seconds * 1e3:.1f} ms = {100 * st.mask_seconds / total:.2f}% "
        f"({st.tiles} tiles, {st.tiles_skipped} skipped, {st.kernel_calls} kernel calls)",
        flush=True,
    )


def bench_masks(args, device: torch.device) -> None:
    ids = rank_major_ids(
        args.latent_frames, args.tokens_per_frame, args.ranks, args.frames_per_block, device
    )
    L = ids.side.numel()
    print(
        f"masks: teacher forcing, {args.latent_frames} latent frames x {args.tokens_per_frame} "
        "tokens, clean+noisy "
        f"= {L} tokens, {args.ranks} ranks, {args.frames_per_block} frames/block, {args.tile}-token tiles",
        flush=True,
    )
    tile = args.tile
    t_ext = timed(
        lambda: block_mask_status(ids, ids, "teacher_forcing", tile, tile), device, args.repeat
    )
    status = block_mask_status(ids, ids, "teacher_forcing", tile, tile)
    # The O(L^2) reference costs the same for every q-tile row: time evenly spread rows, scale up,
    # and check those rows against the kernel.
    nq = status.shape[0]
    rows = sorted({nq * i // args.ref_rows for i in range(args.ref_rows)})
    t_ref = 0.0
    for r in rows:
        sub = TokenIds(
            side=ids.side[r * tile : (r + 1) * tile], block=ids.block[r * tile : (r + 1) * tile]
        )
        t_ref += timed(
            lambda: block_mask_status_reference(sub, ids, "teacher_forcing", tile, tile), device, 1
        )
        assert torch.equal(
            block_mask_status_reference(sub, ids, "teacher_forcing", tile, tile)[0], status[r]
        )
    t_ref *= nq / len(rows)
    row(f"block_mask_status {tuple(status.shape)}", t_ext, t_ref)
    print(
        f"{'':<28} reference timed on {len(rows)} of {nq} q-tile rows and scaled; "
        f"{L * L / t_ext / 1e9:.1f} Gpairs/s, {status.numel() / t_ext / 1e6:.2f} Mtiles/s, "
        f"{100 * float((status == 1).float().mean()):.1f}% partial tiles",
        flush=True,
    )
    # What a user would write in torch instead: per-tile id bounds (min/max of each side's blocks),
    # vectorised over all tile pairs; tiles the bounds cannot decide are called PARTIAL.
    t_bounds = timed(lambda: tile_status_from_bounds(ids, tile), device, args.repeat)
    bounds = tile_status_from_bounds(ids, tile)
    agree = 100 * float((bounds == status).float().mean())
    row("torch per-tile id bounds", t_ext, t_bounds)
    print(
        f"{'':<28} the bounds formulation agrees with the exact status on {agree:.1f}% of tiles "
        f"(the rest: PARTIAL where the kernel proves EMPTY / FULL)",
        flush=True,
    )
    small = rank_major_ids(
        args.dense_frames, args.tokens_per_frame, args.ranks, args.frames_per_block, device
    )
    Ls = small.side.numel()
    t_ext = timed(lambda: dense_mask(small, small, "teacher_forcing"), device, args.repeat)
    t_ref = timed(
        lambda: dense_mask_reference(small, small, "teacher_forcing"), device, args.repeat
    )
    row(f"dense_mask [{Ls}, {Ls}]", t_ext, t_ref, moved=Ls * Ls)
    print(f"{'':<28} {Ls * Ls / t_ext / 1e9:.2f} Gelements/s (moved = bytes written)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16", "float64"]
    )
    p.add_argument("--raw-frames", type=int, default=385)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--halo", type=int, default=2, help="halo in latents")
    p.add_argument("--latent-frames", type=int, default=96)
    p.add_argument("--tokens-per-frame", type=int, default=880)
    p.add_argument("--frames-per-block", type=int, default=4)
    p.add_argument("--tile", type=int, default=128)
    p.add_argument(
        "--dense-frames", type=int, default=8, help="latent frames of the dense-mask case"
    )
    p.add_argument(
        "--ref-rows", type=int, default=8, help="q-tile rows the tile-status reference is timed on"
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--share-frames", type=int, default=16, help="latent frames of the mask-share case"
    )
    p.add_argument(
        "--share-tokens", type=int, default=440, help="tokens per frame of the mask-share case"
    )
    p.add_argument("--only", choices=["halo", "masks"], default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    os.environ[ENV_VAR] = "extension"  # the *_reference functions are timed explicitly
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    if args.only in (None, "halo"):
        bench_halo(args, device)
    if args.only in (None, "masks"):
        bench_masks(args, device)
        if device.type == "cpu":
            bench_mask_share(args)


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
