"""One Wan layer, ours against diffusers, and the per-rank memory of Wan 2.1 14B under CP.

1. Layer: one Wan-2.1-1.3B-shaped block (D 1536, 12 heads x 128, FFN 8960, cross-attention to 512
   text tokens of width D, qk RMS norm, cross-attention norm), forward + backward at each S, our
   ``WanLayer`` (CP = 1, the 2D-attention core) beside diffusers' ``WanTransformerBlock`` on the
   same weights (``from_diffusers``), fp32 (or ``--dtype bfloat16``), one thread, in one process
   side by side. Time: process CPU time (``time.process_time``); memory: growth of the resident
   set's high-water mark during the step (``attention_memory._measure``: VmHWM after
   ``clear_refs``, glibc mapping every large tensor on its own), parameter gradients included
   (the same for both). Targets: CPU time ratio <= 1.0, peak ratio <= 1.0, ours linear in S.
2. Table: per-rank memory of Wan 2.1 14B (D 5120, 40 layers, 40 heads, FFN 13824) at 720p x 81
   frames (21 x 45 x 80 = 75,600 tokens), 16 CP ranks: ours U8 x R2 and R16, Megatron / TE p2p
   CP (ring of 16), and no CP. Computed: parameters counted on the meta device; activations from
   the bytes autograd saves per token in our layer (saved-tensor hooks, measured here at two tiny
   S on the 14B layer) plus each layout's attention transients (formulas printed).

    python benchmarks/wan.py                    # S = 4096 and 16384, then the table
    python benchmarks/wan.py --seqs 4096 --no-table
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from attention_memory import _measure  # noqa: E402  (peak RSS growth of one call)

WAN_1_3B = dict(hidden=1536, heads=12, ffn=8960, text_dim=4096, text_len=512)
WAN_14B = dict(hidden=5120, heads=40, ffn=13824, layers=40, text_dim=4096, text_len=512)
TOKENS_720P = (
    21,
    45,
    80,
)  # latent frames x (720 / 16) x (1280 / 16): 81 frames, VAE 4x8x8, patch 2


def diffusers_wan(hidden, heads, ffn, text_dim, num_layers=1, in_channels=16, device=None):
    """A random diffusers ``WanTransformer3DModel`` of these sizes (Wan 2.1 defaults otherwise)."""
    from diffusers import WanTransformer3DModel

    with torch.device(device or "cpu"):
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=heads,
            attention_head_dim=hidden // heads,
            in_channels=in_channels,
            out_channels=in_channels,
            text_dim=text_dim,
            freq_dim=256,
            ffn_dim=ffn,
            num_layers=num_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
        )


def grid_for(S: int):
    """A token grid ``(F, H, W)`` with ``F * H * W = S`` (W 32 wide, frames as needed)."""
    w = 32 if S % 32 == 0 else 1
    h = 32 if (S // w) % 32 == 0 else 1
    return S // (w * h), h, w


class LayerPair:
    """Our ``WanLayer`` and diffusers' block on the same weights, with inputs for a token grid."""

    def __init__(self, dims: dict, dtype=torch.float32, seed: int = 0):
        from megatron_video.models.wan import from_diffusers

        torch.manual_seed(seed)
        self.dims, self.dtype = dims, dtype
        self.theirs = diffusers_wan(dims["hidden"], dims["heads"], dims["ffn"], dims["text_dim"])
        self.theirs = self.theirs.to(dtype)
        self.ours = from_diffusers(self.theirs, dtype=dtype, cp_comm_type="p2p")
        self.block, self.layer = self.theirs.blocks[0], self.ours.decoder.layers[0]

    def inputs(self, S: int, seed: int = 1):
        from megatron_video.layouts.geometry import VideoGeometry

        d, g = self.dims, torch.Generator().manual_seed(seed)
        D, grid = d["hidden"], grid_for(S)
        geometry = VideoGeometry(*grid)
        x = torch.randn(1, S, D, generator=g).to(self.dtype)
        text = torch.randn(1, d["text_len"], D, generator=g).to(self.dtype)
        temb = torch.randn(1, 6, D, generator=g).to(self.dtype)
        latent = torch.empty(1, 16, grid[0], 2 * grid[1], 2 * grid[2])
        rope_theirs = self.theirs.rope(latent)
        cos, sin = self.ours.rope(torch.arange(S), geometry)
        rope_ours = torch.stack([cos, sin])
        return dict(x=x, text=text, temb=temb, geometry=geometry, rope=(rope_theirs, rope_ours))

    def forward(self, which: str, inp: dict, x=None):
        """Output of ``which`` ("ours" / "diffusers") as ``[1, S, D]``."""
        from megatron_video.models.dit_layer import DiTParams

        x = inp["x"] if x is None else x
        if which == "diffusers":
            return self.block(x, inp["text"], inp["temb"], inp["rope"][0])
        params = DiTParams(
            conditioning=inp["temb"], geometry=inp["geometry"], rotary_pos_emb=inp["rope"][1]
        )
        out = self.layer(x.transpose(0, 1), context=inp["text"].transpose(0, 1), params=params)
        return out[0].transpose(0, 1)

    def step(self, which: str, inp: dict):
        """One forward + backward (loss ``out.sum()``, input and parameter gradients)."""
        out = self.forward(which, inp, inp["x"].clone().requires_grad_(True))
        out.float().sum().backward()

    def zero_grad(self):
        for m in (self.block, self.layer):
            for p in m.parameters():
                p.grad = None


def layer_rows(pair: LayerPair, seqs, warmup: bool = True) -> list:
    """``[{S, which, cpu_s, wall_s, peak_mib}]`` for ours and diffusers at each S, alternating."""
    rows = []
    if warmup:  # one-time allocations (thread pools, kernels) are not counted
        inp = pair.inputs(min(seqs))
        for which in ("ours", "diffusers"):
            pair.step(which, inp)
            pair.zero_grad()
    for S in seqs:
        inp = pair.inputs(S)
        for which in ("ours", "diffusers"):
            pair.zero_grad()
            c0 = time.process_time()
            mib, wall = _measure(lambda: pair.step(which, inp))
            rows.append(
                dict(S=S, which=which, cpu_s=time.process_time() - c0, wall_s=wall, peak_mib=mib)
            )
        pair.zero_grad()
    return rows


def check_same_output(pair: LayerPair, S: int) -> float:
    """Relative error of our layer's output against diffusers' block (same weights, inputs)."""
    inp = pair.inputs(S)
    with torch.no_grad():
        a, b = pair.forward("ours", inp), pair.forward("diffusers", inp)
    return ((a - b).float().norm() / b.float().norm()).item()


def print_layer_rows(rows, dims, dtype) -> dict:
    """The side-by-side table; returns ``{S: (cpu ratio, peak ratio)}`` (ours / diffusers)."""
    print(
        f"Wan layer fwd+bwd, D {dims['hidden']} x {dims['heads']} heads, FFN {dims['ffn']}, "
        f"text {dims['text_len']} tokens, {str(dtype).replace('torch.', '')}, "
        f"{torch.get_num_threads()} thread(s), CPU"
    )
    print(
        f"{'S':>7} {'ours CPU s':>11} {'diff CPU s':>11} {'ratio':>6} "
        f"{'ours MiB':>9} {'diff MiB':>9} {'ratio':>6}"
    )
    out = {}
    for S in sorted({r["S"] for r in rows}):
        o, d = (
            next(r for r in rows if r["S"] == S and r["which"] == w) for w in ("ours", "diffusers")
        )
        out[S] = (o["cpu_s"] / d["cpu_s"], o["peak_mib"] / max(d["peak_mib"], 1e-9))
        print(
            f"{S:>7} {o['cpu_s']:>11.2f} {d['cpu_s']:>11.2f} {out[S][0]:>6.2f} "
            f"{o['peak_mib']:>9.1f} {d['peak_mib']:>9.1f} {out[S][1]:>6.2f}"
        )
    ours = [r for r in rows if r["which"] == "ours"]
    if len(ours) > 1 and ours[0]["peak_mib"] > 0:  # tiny sizes may not move the high-water mark
        a, b = ours[0], ours[-1]
        print(f"ours peak growth {b['peak_mib'] / a['peak_mib']:.2f}x for {b['S'] / a['S']:.0f}x S")
    return out


# ---------------------------------------------------------------------------------------------
# Per-rank memory table (analytic)
# ---------------------------------------------------------------------------------------------
def count_params(dims: dict) -> int:
    """Parameters of the full diffusers model of ``dims`` (built on the meta device)."""
    model = diffusers_wan(
        dims["hidden"], dims["heads"], dims["ffn"], dims["text_dim"], dims["layers"], device="meta"
    )
    return sum(p.numel() for p in model.parameters())


def saved_bytes(pair: LayerPair, S: int) -> int:
    """Bytes autograd saves for backward in one forward of our layer at ``S`` tokens (distinct
    storages; the parameters themselves excluded)."""
    params = {p.untyped_storage().data_ptr() for p in pair.layer.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    inp = pair.inputs(S)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pair.forward("ours", inp, inp["x"].clone().requires_grad_(True))
    return sum(seen.values())


def activation_coefficients(pair: LayerPair, s1: int, s2: int):
    """``(per-token bytes, constant bytes)`` of one layer's saved activations, from two S."""
    b1, b2 = saved_bytes(pair, s1), saved_bytes(pair, s2)
    per_token = (b2 - b1) / (s2 - s1)
    return per_token, b1 - per_token * s1


def memory_table(dims: dict, tokens: int, ranks: int, per_token: float, const: float, e=2):
    """Rows ``(name, params, grads, optimizer, activations, transients)`` in bytes per rank.

    Formulas (Psi parameters, bf16 weights ``e`` = 2 bytes, fp32 main gradients, Adam with fp32
    master weights, the distributed optimizer sharded over the 16 data x context ranks; L layers,
    s = S / N tokens per rank, H heads x d = D):
    params ``e Psi``; grads ``4 Psi``; optimizer ``12 Psi / N``; activations
    ``L (alpha s + beta)`` with alpha, beta measured on our layer (saved-tensor bytes per token and
    per text); transients, one layer's attention at a time: ring ``2 (k, v) x 2 (double buffer)
    x s H d e`` (forward; twice in backward with dk, dv), all-to-all ``2 (send, recv) x 3 (q, k,
    v) x s H d e`` when U > 1. No CP: s = S, no transients."""
    psi = count_params(dims)
    L, D = dims["layers"], dims["hidden"]
    rows = []
    for name, U, R in (
        ("ours U8 x R2 (a2a+p2p)", 8, 2),
        ("ours R16 (p2p)", 1, 16),
        ("Megatron / TE p2p CP 16", 1, 16),
        ("no CP (1 rank, full sequence)", 1, 1),
    ):
        n = U * R
        s = tokens / n
        ring = (2 * 2 * 2) * s * D * e if R > 1 else 0  # fwd + bwd (dk, dv) buffers
        a2a = 2 * 3 * s * D * e if U > 1 else 0
        opt = 12 * psi / (ranks if n > 1 else 1)
        rows.append((name, e * psi, 4 * psi, opt, L * (per_token * s + const), ring + a2a))
    return psi, rows


def print_memory_table(psi, rows, tokens):
    gib = 2**30
    print(
        f"\nWan 2.1 14B ({psi / 1e9:.2f} B parameters), {tokens:,} tokens (720p x 81 frames), "
        f"per rank, GiB"
    )
    print(
        f"{'layout':<32}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'transient':>10}"
        f"{'total':>8}"
    )
    for name, *vals in rows:
        print(
            f"{name:<32}"
            + "".join(f"{v / gib:>8.2f}" for v in vals[:4])
            + f"{vals[4] / gib:>10.2f}{sum(vals) / gib:>8.2f}"
        )


def main():
    from megatron_video.compat import ensure_cpu_mode
    from megatron_video.models.wan.convert import _one_process

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-table", action="store_true")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    ensure_cpu_mode()
    with _one_process():
        pair = LayerPair(WAN_1_3B, dtype)
        print(f"same weights: output relative error {check_same_output(pair, 256):.2e}")
        print_layer_rows(layer_rows(pair, [int(s) for s in a.seqs.split(",")]), WAN_1_3B, dtype)
        if not a.no_table:
            del pair
            big = LayerPair(WAN_14B, torch.bfloat16)
            per_token, const = activation_coefficients(big, 64, 128)
            del big
            tokens = TOKENS_720P[0] * TOKENS_720P[1] * TOKENS_720P[2]
            print(f"\nour layer saves {per_token:,.0f} B per token + {const:,.0f} B (text), bf16")
            print_memory_table(*memory_table(WAN_14B, tokens, 16, per_token, const), tokens)


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # see attention_memory.main
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    torch.set_num_threads(1)
    main()
