"""Per-rank frame-range decoding vs decode-everything-then-slice (data.energon_video), P = 1, 2, 4, 8.

A prepared energon dataset of procedural mp4 clips (H.264, a key frame every 8 frames) of
``T = 1 + 4(F-1)`` raw frames. For every SP degree ``P`` and rank, the rank's halo window
(``layouts.vae_halo.halo_windows``, halo of the project's VAE) is decoded with energon's
``AVDecoder.get_video_clips`` (frame range) and, for comparison, the whole clip is decoded and
sliced. Printed per P: raw frames decoded per rank (max), the target ``F/P`` share + halo in raw
frames, and decode time per rank (max over ranks, mean over clips); then the clips-by-key reader's
(``KeyedClips``, what training reads) samples/s for one rank's window.

    python benchmarks/video_data.py [--latents 32] [--hw 64] [--clips 6]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_video.data.buckets import BucketConfig, BucketGrid  # noqa: E402
from megatron_video.data.energon_video import (  # noqa: E402
    KeyedClips,
    dataset_records,
    prepare_dataset,
    write_procedural_videos,
)
from megatron_video.layouts.vae_halo import halo_windows, num_raw_frames  # noqa: E402
from megatron_video.models.vae import CausalVideoEncoder, CausalVideoVAE  # noqa: E402
from megatron_video.models.vae_halo_probe import encoder_halo  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--latents", type=int, default=32)
    ap.add_argument("--hw", type=int, default=64)
    ap.add_argument("--clips", type=int, default=6)
    args = ap.parse_args()
    from megatron.energon.av import AVDecoder

    st = CausalVideoVAE.temporal_stride  # the project's VAE
    F, T = args.latents, num_raw_frames(args.latents, st)
    h = encoder_halo(CausalVideoEncoder())
    root = Path(tempfile.mkdtemp(prefix="video_data_"))
    try:
        t0 = time.time()
        write_procedural_videos(
            root / "src", args.clips, num_frames=T, height=args.hw, width=args.hw
        )
        prepare_dataset(root / "src", root / "ds")
        print(
            f"{args.clips} clips of {T} raw frames ({F} latents) at {args.hw}x{args.hw}, halo {h} latents; "
            f"written + prepared in {time.time() - t0:.1f} s"
        )
        blobs = [p.read_bytes() for p in sorted((root / "src").glob("*.mp4"))]

        def clip_time(ranges, blob):
            t = time.perf_counter()
            clips, _ = AVDecoder(io.BytesIO(blob)).get_video_clips(ranges, video_unit="frames")
            return time.perf_counter() - t, sum(c.shape[0] for c in clips)

        print(
            " P | frames/rank windowed (max) | F/P+halo raw | frames/rank full | time/rank windowed | "
            "time/rank full+slice | ratio"
        )
        for P in (1, 2, 4, 8):
            ws = halo_windows(F, P, h, temporal_stride=st)
            per_rank_w, per_rank_f, frames_w = [], [], []
            for w in ws:
                tw = tf = 0.0
                for b in blobs:
                    a, n = clip_time([(w.raw_start, w.raw_end - 1)], b)
                    tw += a
                    frames_w.append(n)
                    a, _ = clip_time([(0, T - 1)], b)
                    tf += a
                per_rank_w.append(tw / len(blobs))
                per_rank_f.append(tf / len(blobs))
            target = min(T, st * (F // P) + st * h + 1)
            print(
                f"{P:2d} | {max(frames_w):26d} | {target:12d} | {T:16d} | {1e3 * max(per_rank_w):15.1f} ms | "
                f"{1e3 * max(per_rank_f):17.1f} ms | {max(per_rank_f) / max(per_rank_w):5.2f}x"
            )
        lat = args.hw // 8  # one bucket: the clips' own shape
        grid = BucketGrid(BucketConfig(area=lat * lat, area_tolerance=0.0, aspect_ratios=[1.0],
                                       max_frames=T, frame_counts=[T], patch_size=[1, 1, 1],
                                       tokens_per_microbatch=F * lat * lat))  # fmt: skip
        plans = grid.plan_many(dataset_records(root / "ds"))
        clips = KeyedClips(root / "ds")
        for P in (1, 4):
            w = halo_windows(F, P, h, temporal_stride=st)[P - 1]
            n, t = 3 * len(plans), time.perf_counter()
            frames = sum(clips.read(plans[i % len(plans)], w).shape[1] for i in range(n))
            dt = time.perf_counter() - t
            print(
                f"clips by key, last rank of P={P} (window {w.window}): {n / dt:.1f} samples/s "
                f"({frames / n:.0f} raw frames decoded per sample)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
