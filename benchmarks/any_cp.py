"""Wan's own clip (81 frames = 21 latent frames) over CP 4 / 8 / 16: our token placement against
Megatron-Bridge's rule, side by side, on the same clip (pure index arithmetic, no model: seconds).

* **Ours** (``training/batches/placed.py``, the trainer's path where CP does not divide the token
  frames): the clip's ``F x H x W`` tokens padded to a multiple of ``2·CP``, placed over
  ``U x R`` by ``layouts.placement.plan_placement`` (``PackedVideo.plan``), each CP rank's global
  ids from the plan.
* **Bridge** (Megatron-Bridge's Wan recipes, TE's THD partitioning): the video padded to a
  multiple of ``2·CP`` and cut into ``2·CP`` equal chunks; CP rank ``r`` holds chunks ``r`` and
  ``2·CP-1-r``.

Per CP size and method: real tokens per CP rank (min-max), padding overhead (padding / the clip's
tokens; target <= 1 %), attention work balance (max / mean over CP ranks of the attention pairs a
rank computes: full attention inside the clip, so a real query costs the clip's tokens; under
``U x R`` the all-to-all splits the heads, so the CP ranks of one ring rank share its queries'
pairs equally; target <= 1.05), and the raw frames each CP rank decodes for its tokens (the union
of the VAE halo windows, ``layouts.vae_halo.halo_window``, of the latent frames its tokens lie
on) at the halos of ``--halos``, max and mean over ranks, against the whole clip.

    python benchmarks/any_cp.py [--frames 81 --height 720 --width 1280 --cps 4,8,16 --halos 2,27]

The layouts (``--layouts``): CP 4 = U2 x R2, CP 8 = U4 x R2, CP 16 = U8 x R2 (Wan's Ulysses 8
inside a node x ring 2 across nodes). ``--verbose``: the known environment warnings too.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_video.layouts import max_over_mean
from megatron_video.layouts.packed_video import PackedVideo, VideoClip
from megatron_video.layouts.vae_halo import halo_window

TEMPORAL, SPATIAL, PATCH = 4, 8, (1, 2, 2)  # Wan 2.1's VAE strides and patch
LAYOUTS = {2: (2, 1), 4: (2, 2), 8: (4, 2), 16: (8, 2)}  # CP -> (U, R)


def token_grid(frames: int, height: int, width: int) -> Tuple[int, int, int]:
    """Latent token grid ``(F, Hp, Wp)`` of a raw clip (Wan 2.1: 4x temporal, 8x spatial, patch
    1 x 2 x 2)."""
    if (frames - 1) % TEMPORAL or height % (SPATIAL * PATCH[1]) or width % (SPATIAL * PATCH[2]):
        raise ValueError(
            f"--frames ({frames}) must be 1 + {TEMPORAL} k and --height / --width ({height} / "
            f"{width}) multiples of {SPATIAL * PATCH[1]} (VAE stride x patch)"
        )
    return 1 + (frames - 1) // TEMPORAL, height // 16, width // 16


def ours(grid, U: int, R: int) -> Tuple[List[torch.Tensor], int]:
    """Per CP rank its global ids, and the padded length: the trainer's placement."""
    cp = U * R
    packed = PackedVideo((VideoClip(*grid),)).padded_to(2 * cp)
    plan = packed.plan(U, R)
    return [packed.local_ids(plan.placement, cp, c) for c in range(cp)], packed.seq_len


def bridge(tokens: int, cp: int) -> Tuple[List[torch.Tensor], int]:
    """Per CP rank its global ids, and the padded length: pad to ``2·CP``, ``2·CP`` chunks, rank
    ``r`` takes chunks ``r`` and ``2·CP-1-r``."""
    S = -(-tokens // (2 * cp)) * 2 * cp
    chunk = S // (2 * cp)
    ids = torch.arange(S).view(2 * cp, chunk)
    return [torch.cat([ids[r], ids[2 * cp - 1 - r]]) for r in range(cp)], S


def frame_runs(ids: torch.Tensor, tokens: int, per_frame: int) -> List[Tuple[int, int]]:
    """Sorted half-open runs of the latent frames the real ids (``< tokens``) lie on."""
    frames = torch.unique(ids[ids < tokens] // per_frame).tolist()
    runs: List[Tuple[int, int]] = []
    for f in frames:
        if runs and runs[-1][1] == f:
            runs[-1] = (runs[-1][0], f + 1)
        else:
            runs.append((f, f + 1))
    return runs


def decoded_frames(runs: Sequence[Tuple[int, int]], halo: int) -> int:
    """Raw frames decoded for latent frame ``runs``: the union of their halo windows."""
    spans = sorted(halo_window(a, b, halo, TEMPORAL).window for a, b in runs)
    total, end = 0, 0
    for a, b in spans:
        total += max(0, b - max(a, end))
        end = max(end, b)
    return total


def method_row(ids: List[torch.Tensor], S: int, grid, U: int, halos) -> Dict:
    F, Hp, Wp = grid
    T, per_frame = F * Hp * Wp, Hp * Wp
    real = [int((i < T).sum()) for i in ids]
    if sorted(torch.cat(ids).tolist()) != list(range(S)):
        raise AssertionError("the ranks' ids must partition the padded sequence")
    ring = [sum(real[r * U : (r + 1) * U]) for r in range(len(ids) // U)]
    work = [ring[c // U] * T / U for c in range(len(ids))]  # pairs per CP rank (heads split)
    runs = [frame_runs(i, T, per_frame) for i in ids]
    decoded = {h: [decoded_frames(r, h) for r in runs] for h in halos}
    return dict(tokens=real, pad=S - T, padding=(S - T) / T, balance=max_over_mean(work),
                decoded=decoded)  # fmt: skip


def rows(frames: int, height: int, width: int, cps, halos, layouts=None) -> List[Dict]:
    """One row per (CP size, method)."""
    grid = token_grid(frames, height, width)
    T = grid[0] * grid[1] * grid[2]
    out = []
    for cp in cps:
        U, R = (layouts or LAYOUTS)[cp]
        if U * R != cp:
            raise ValueError(f"--layouts: CP {cp} must be U x R (got {U} x {R})")
        if cp > T:
            raise ValueError(f"--cps ({cp}) must be at most the clip's tokens ({T})")
        for name, (ids, S) in (("ours", ours(grid, U, R)), ("Bridge", bridge(T, cp))):
            row = method_row(ids, S, grid, U, halos)
            out.append(dict(row, cp=cp, U=U, R=R, method=name, grid=grid, frames=frames))
    return out


def print_table(table: List[Dict], halos) -> None:
    F, Hp, Wp = table[0]["grid"]
    print(
        f"{table[0]['frames']} frames -> {F} latent frames x {Hp} x {Wp} tokens = "
        f"{F * Hp * Wp} tokens per clip (Wan 2.1 VAE, patch 1x2x2)"
    )
    head = " | ".join(f"decoded frames max / mean (halo {h})" for h in halos)
    print(f"| CP (U x R) | method | real tokens per rank | padding | work max/mean | {head} |")
    print("| --- " * (5 + len(halos)) + "|")
    for r in table:
        dec = " | ".join(
            f"{max(r['decoded'][h])} / {sum(r['decoded'][h]) / len(r['decoded'][h]):.1f} "
            f"of {r['frames']}"
            for h in halos
        )
        print(
            f"| {r['cp']} ({r['U']} x {r['R']}) | {r['method']} | {min(r['tokens'])}-"
            f"{max(r['tokens'])} | {r['pad']} ({100 * r['padding']:.3f} %) | "
            f"{r['balance']:.4f} | {dec} |"
        )
    for r in table:
        if r["method"] == "ours":
            ok = r["balance"] <= 1.05 and r["padding"] <= 0.01
            print(
                f"ours at CP {r['cp']}: work max/mean {r['balance']:.4f} (target <= 1.05), "
                f"padding {100 * r['padding']:.3f} % (target <= 1 %): "
                f"{'met' if ok else 'NOT met'}"
            )


def _layouts(text: str) -> Dict[int, Tuple[int, int]]:
    out = dict(LAYOUTS)
    for item in filter(None, text.split(",")):
        u, r = (int(v) for v in item.lower().split("x"))
        out[u * r] = (u, r)
    return out


def main(argv=None) -> List[Dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--cps", default="4,8,16", help="CP sizes, comma-separated")
    ap.add_argument("--halos", default="2,27", help="VAE halos in latents (27: Wan 2.1 exact)")
    ap.add_argument("--layouts", default="", help="UxR overrides, e.g. 4x1,8x1")
    ap.add_argument("--verbose", action="store_true", help="show known environment warnings")
    a = ap.parse_args(argv)
    cps = [int(v) for v in a.cps.split(",")]
    halos = [int(v) for v in a.halos.split(",")]
    table = rows(a.frames, a.height, a.width, cps, halos, _layouts(a.layouts))
    print_table(table, halos)
    return table


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
