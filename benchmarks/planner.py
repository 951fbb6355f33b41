"""The planner against measurements and published figures (docs/planner.md).

(a) This machine, ``cpu`` profile, at ``--world 2`` (a rank per core, as the planner models a
    device per rank) and ``4`` (two ranks per core): per-rank step time (forward + backward, the
    max over the ranks, the fastest of ``--iters``; each step's batches are made before the timer,
    their time printed apart) and peak live tensor bytes of a tiny ``video_dit`` at several
    layouts, next to the planner's prediction. The profile's constants come from the ``FIT``
    layouts (``_fit``); the error on the others is what it predicts. Rankings: strict, and the
    pairs measured apart by more than their run-to-run spread.
(b) The NeMo video-foundation-model paper (reference/nemo-video-foundation-models.txt): ST-DiT
    7B / 12B TFLOP/s per GPU at 74k / 35k tokens and the DiT-7B layout finding, predicted by
    ``megatron-video plan`` on H100 with the model shapes written next to each row.
Run: ``python benchmarks/planner.py [--iters 7] [--world 2 4] [--save F | --load F]``; the rows
docs/benchmarks.md reports are ``benchmarks/planner_measured.json`` (``--load`` refits them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path

LAYOUTS = {  # world -> [(name, parallel fields)], one node
    # one rank per core of the 2-core machine: what the planner models (a device per rank)
    2: [
        ("DP2", dict()),
        ("DP2 rc", dict(recompute=True)),
        ("DP2 x2", dict(frames=57)),  # twice the tokens (16 latent frames): the per-token rate
        ("U2", dict(context_parallel_size=2, ulysses_size=2)),
        ("R2", dict(context_parallel_size=2, ring_size=2)),
        ("TP2", dict(tensor_model_parallel_size=2)),
        ("PP2", dict(pipeline_model_parallel_size=2)),
        ("U2 rc", dict(context_parallel_size=2, ulysses_size=2, recompute=True)),
        ("R2 rc", dict(context_parallel_size=2, ring_size=2, recompute=True)),
        ("TP2 rc", dict(tensor_model_parallel_size=2, recompute=True)),
        ("DP2 fsdp", dict(fsdp=True)),
        ("U2 fsdp", dict(context_parallel_size=2, ulysses_size=2, fsdp=True)),
    ],
    # two ranks per core: every collective waits for a time slice (not a device per rank)
    4: [
        ("DP4", dict()),
        ("DP4 rc", dict(recompute=True)),
        ("U2 DP2", dict(context_parallel_size=2, ulysses_size=2)),
        ("R2 DP2", dict(context_parallel_size=2, ring_size=2)),
        ("U4", dict(context_parallel_size=4, ulysses_size=4)),
        ("R4", dict(context_parallel_size=4, ring_size=4)),
        ("U2 R2", dict(context_parallel_size=4, ulysses_size=2, ring_size=2)),
        ("TP2 DP2", dict(tensor_model_parallel_size=2)),
        ("U2 R2 rc", dict(context_parallel_size=4, ulysses_size=2, ring_size=2, recompute=True)),
        ("DP4 fsdp", dict(fsdp=True)),
        ("U2 DP2 fsdp", dict(context_parallel_size=2, ulysses_size=2, fsdp=True)),
    ],
}
FIT = {
    2: ("DP2", "DP2 rc", "DP2 x2", "U2", "R2", "TP2", "U2 rc", "DP2 fsdp"),
    4: ("DP4", "DP4 rc", "U4", "R4", "TP2 DP2", "U2 R2 rc", "DP4 fsdp"),
}
# the teacher-forcing AR DiT at some of the same layouts, predicted with the profile fitted on
# video_dit (no refit: another attention mask, Balanced SP's [clean ; noisy] sequence)
OTHER = ("ar_dit", {2: ("DP2", "U2", "R2", "TP2", "U2 rc"), 4: ("DP4", "U2 DP2", "U4", "U2 R2")})
# the one constant the AR DiT adds (its attention mask's cost per query-key element), fitted here
OTHER_FIT = {2: "DP2", 4: "DP4"}
TMP = "runs/bench_planner"
BENCH_MODEL = dict(num_frames=29, height=32, width=32)  # 8 latent frames of 4 x 4: 128 tokens


def _config(tmp, family, par, world):
    from megatron_video.testing.configs import tiny_config

    par = dict(par)
    frames = par.pop("frames", BENCH_MODEL["num_frames"])
    cfg = tiny_config(family, tmp, ranks_per_node=world, **par)
    cfg.data = dataclasses.replace(cfg.data, **{**BENCH_MODEL, "num_frames": frames})
    cfg.model.hidden_size, cfg.model.num_attention_heads = 96, 4
    return cfg


def _tensors(x, out):
    """Every tensor inside a micro-batch (dataclasses, sequences, dicts)."""
    import torch

    if isinstance(x, torch.Tensor):
        out.append(x)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            _tensors(getattr(x, f.name), out)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


def _prefetch(t, step, make):
    """The step's micro-batches made now, outside the timer and the memory count: the planner
    models the model's step; the data path (procedural clips, the per-rank VAE) is timed apart.
    Returns (seconds it took, the batches' tensors)."""
    t0 = time.perf_counter()
    mbs = list(make(step))
    t.batches.step_batches = lambda s, _m=mbs: iter(_m)
    return time.perf_counter() - t0, _tensors(mbs, [])


def _forward_only(t, step):
    """The step's forward alone, with autograd recording (as a recomputed forward runs)."""
    t.ddp.train()
    t.forward_backward_func(
        forward_step_func=t._forward_step,
        data_iterator=t.batches.step_batches(step),
        model=[t.ddp],
        num_microbatches=t.num_microbatches,
        seq_length=t.seq_length,
        micro_batch_size=t.config.train.micro_batch_size,
        forward_only=True,
    )


def _measure(tmp, family, par, iters, world):
    import warnings

    import torch.distributed as dist

    from megatron_video.testing.live_memory import LiveTensors
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    t = Trainer(_config(tmp, family, par, world), progress=False)
    make = t.batches.step_batches
    try:
        t.forward_backward(0)
        times, data, fwd = [], [], []
        for i in range(iters):
            data.append(_prefetch(t, i + 1, make)[0])
            dist.barrier()
            t0 = time.perf_counter()
            t.forward_backward(i + 1)
            times.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            _forward_only(t, i + 1)
            fwd.append(time.perf_counter() - t0)
        params = tuple(getattr(p, "_local_tensor", p) for p in t.ddp.parameters())  # FSDP: shards
        held = params + tuple(_grad_buffers(t.ddp))
        batch = tuple(_prefetch(t, iters + 1, make)[1])
        fsdp = t.config.parallel.fsdp  # FSDP frees and re-allocates gathered weights in place
        with LiveTensors(exclude=held + batch, resized=fsdp) as live:  # the step's own allocations
            t.forward_backward(iters + 1)
        state = sum(x.numel() * x.element_size() for x in held)
        return (
            min(times),
            live.peak,
            state,
            statistics.median(data),
            min(fwd),
            statistics.median(times),
        )
    finally:
        t.close()


def _grad_buffers(ddp):
    buffers = getattr(ddp, "buffers", [])  # Megatron DDP's list; FSDP has none (Module.buffers)
    return [] if callable(buffers) else [b.grad_data for b in buffers]


def _predict(cfg, world, hw):
    from megatron_video.planner import Cluster, Layout, step_cost
    from megatron_video.training.planning import model_shape

    p = cfg.parallel
    tp, cp, pp = (
        p.tensor_model_parallel_size,
        p.context_parallel_size,
        p.pipeline_model_parallel_size,
    )
    dp = world // (tp * cp * pp)
    lay = Layout(tp, pp, dp, p.ulysses_size, p.ring_size, p.recompute, 1, p.fsdp)
    cl = Cluster(world, world, cfg.train.global_batch_size, distributed_optimizer=False)
    return step_cost(model_shape(cfg), lay, cl, hw)


FREE = (
    "peak_flops",
    "layer_overhead_s",
    "nvlink_lat",
    "attn_call_overhead_s",
    "fsdp_call_overhead_s",
)


def _profile(hw, x):
    """``hw`` with the free constants ``x`` (compute time per FLOP, per-layer overhead, per-call
    latency, per-attention-call overhead, per FSDP gather / reduction; zeros allowed)."""
    inv_peak, over, lat, call, fsdp = (float(v) for v in x)
    return dataclasses.replace(
        hw,
        peak_flops=1.0 / inv_peak if inv_peak > 0 else 1e30,
        layer_overhead_s=over,
        nvlink_lat=lat,
        ib_lat=lat,
        attn_call_overhead_s=call,
        fsdp_call_overhead_s=fsdp,
    )


def _nnls(a, y):
    """Non-negative least squares of ``a x = y`` (few columns: every subset, the best feasible)."""
    import torch

    best = None
    for active in itertools.product((0, 1), repeat=a.shape[1]):
        idx = [k for k in range(a.shape[1]) if active[k]]
        if not idx:
            continue
        sol = torch.linalg.lstsq(a[:, idx], y[:, None]).solution[:, 0]
        if (sol < 0).any():
            continue
        x = torch.zeros(a.shape[1], dtype=a.dtype)
        x[idx] = sol
        err = float(((a @ x - y) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, x)
    return best


def _fit(rows, hw, world):
    """The cpu profile from the FIT layouts. The backward's fixed per-layer time as a multiple of
    the forward's comes from DP over the whole world (no communication: step time over
    forward-only time, less one). For a given recompute cost (a recomputed forward against a
    forward) the step time is linear in the five free constants (nothing overlaps on ``cpu``):
    non-negative least squares of the relative step-time error; the recompute cost is the best
    of a grid."""
    import torch

    dp = rows[0]  # DP over the whole world
    hw = dataclasses.replace(hw, backward_overhead=dp["step_s"] / dp["fwd_s"] - 1)
    fit = [r for r in rows if r["name"] in FIT[world]]
    meas = torch.tensor([r["step_s"] for r in fit], dtype=torch.float64)
    best = None
    for cost in [x / 20 for x in range(10, 41)]:  # 0.5 .. 2 forwards
        h = dataclasses.replace(hw, recompute_cost=cost)

        def pred(x, h=h):
            return torch.tensor(
                [_predict(r["cfg"], world, _profile(h, x)).step_s for r in fit],
                dtype=torch.float64,
            )

        n = len(FREE)
        zero = pred([0] * n)
        basis = torch.stack([pred(u) - zero for u in torch.eye(n, dtype=torch.float64)], dim=1)
        err, x = _nnls(basis / meas[:, None], 1 - zero / meas)
        if best is None or err < best[0]:
            best = (err, _profile(h, x))
    return best[1]


MEASURED = ("step_s", "peak", "state", "data_s", "fwd_s", "step_median_s")


def measure_rows(iters: int, world: int, family: str = "video_dit", names=None) -> list:
    """``{name, step_s, peak, state, data_s, fwd_s, step_median_s}`` of the layouts ``names``
    (default: all) of ``LAYOUTS[world]``, each the max over the ranks."""
    from megatron_video.testing import WorkerPool
    from megatron_video.training.vae_stage import ensure_vae

    ensure_vae(_config(TMP, family, {}, world), progress=False)
    rows = []
    with WorkerPool(world, ranks_per_node=world, timeout=1200) as pool:
        for name, par in LAYOUTS[world]:
            if names is not None and name not in names:
                continue
            per_rank = pool.run(_measure, TMP, family, par, iters, world)
            rows.append(
                dict(name=name, **{k: max(r[i] for r in per_rank) for i, k in enumerate(MEASURED)})
            )
    return rows


def measured_table(saved: dict, world: int):
    """Fit the cpu profile on ``saved["video_dit"]`` (``measure_rows``), print predicted vs
    measured for it and, with the same profile, for ``saved[OTHER[0]]`` when there."""
    from megatron_video.planner import get_hardware

    pars = dict(LAYOUTS[world])
    fam_rows = {
        fam: [dict(r, cfg=_config(TMP, fam, pars[r["name"]], world)) for r in rows]
        for fam, rows in saved.items()
    }
    hw = _fit(fam_rows["video_dit"], get_hardware("cpu"), world)
    if OTHER[0] in fam_rows:
        hw = _fit_masked(fam_rows[OTHER[0]], hw, world)
    print(
        f"(a) 128 tokens, D 96, 2 layers, fp32, {world} gloo ranks on 2 cores; cpu profile fitted "
        f"on video_dit {', '.join(FIT[world])}: peak {hw.peak_flops:.3g} FLOP/s, layer overhead "
        f"{hw.layer_overhead_s * 1e3:.3g} ms (backward {hw.backward_overhead:.2f}x, recompute "
        f"{hw.recompute_cost:.2f}x a forward), per attention "
        f"call {hw.attn_call_overhead_s * 1e6:.3g} us, per-call latency {hw.nvlink_lat * 1e6:.3g} us, "
        f"per FSDP gather / reduction {hw.fsdp_call_overhead_s * 1e6:.3g} us; on {OTHER[0]} "
        f"{OTHER_FIT[world]}: attention mask {hw.mask_s_per_element * 1e9:.3g} ns per element"
    )
    for fam, rows in fam_rows.items():
        _print_rows(fam, rows, world, hw, FIT[world] if fam == "video_dit" else (OTHER_FIT[world],))


def _fit_masked(rows, hw, world):
    """``hw`` with the attention mask's cost per element that makes ``OTHER_FIT``'s predicted step
    time the measured one (the step time is linear in it; at least 0)."""
    row = next(r for r in rows if r["name"] == OTHER_FIT[world])
    at = [
        _predict(row["cfg"], world, dataclasses.replace(hw, mask_s_per_element=x)).step_s
        for x in (0.0, 1.0)
    ]
    x = max(0.0, (row["step_s"] - at[0]) / (at[1] - at[0]))
    return dataclasses.replace(hw, mask_s_per_element=x)


def _print_rows(family, rows, world, hw, fit):
    print(
        f"{family:<10}{'fit':>4}{'measured ms':>13}{'predicted ms':>14}{'error':>8}"
        f"{'mem meas. MiB':>15}{'mem pred. MiB':>15}{'error':>8}{'fwd ms':>8}{'data ms':>9}"
    )
    for r in rows:
        c = _predict(r["cfg"], world, hw)
        r["pred"] = c.step_s
        mem_meas = r["peak"] + r["state"]
        mp = c.mem_parts
        mem_pred = mp["weights"] + mp["grads"] + mp["activations"] + mp["transient"]
        print(
            f"{r['name']:<10}{'*' if r['name'] in fit else '':>4}{r['step_s'] * 1e3:>13.1f}"
            f"{c.step_s * 1e3:>14.1f}{c.step_s / r['step_s'] - 1:>8.0%}"
            f"{mem_meas / 2**20:>15.2f}{mem_pred / 2**20:>15.2f}{mem_pred / mem_meas - 1:>8.0%}"
            f"{r['fwd_s'] * 1e3:>8.1f}{r['data_s'] * 1e3:>9.1f}"
        )
    by_meas = [r["name"] for r in sorted(rows, key=lambda r: r["step_s"])]
    by_pred = [r["name"] for r in sorted(rows, key=lambda r: r["pred"])]
    print(f"measured ranking : {' < '.join(by_meas)}")
    print(f"predicted ranking: {' < '.join(by_pred)}  (equal: {by_meas == by_pred})")
    # a pair is resolved when its measured gap exceeds both rows' spread (median over min)
    resolved = wrong = 0
    for x, y in itertools.combinations(rows, 2):
        lo, hi = sorted((x, y), key=lambda r: r["step_s"])
        spread = sum(r["step_median_s"] / r["step_s"] - 1 for r in (lo, hi))
        if hi["step_s"] / lo["step_s"] - 1 > spread:
            resolved += 1
            wrong += lo["pred"] > hi["pred"]
    print(
        f"pairs measured apart by more than their spread: {resolved} of "
        f"{len(rows) * (len(rows) - 1) // 2}, predicted in the other order: {wrong}"
    )


PAPER = [  # (row, family, layers, hidden, heads, latent frames, tokens, published TFLOP/s/GPU,
    # the published degrees: All2All = 8 is Ulysses 8, "FSDP+" FSDP). Frames of 72 x 64 tokens
    # (1152 x 1024 pixels): 16 and 8 frames give the published token counts, and whole frames
    # per rank at All2All = 8 (18 or 9 frames of 64 x 64 would not)
    ("ST-DiT-7B 74k hybrid", "stdit", 28, 4096, 32, 16, 73728, 335.6, dict(ulysses=8)),
    ("ST-DiT-12B 74k hybrid", "stdit", 24, 5120, 40, 16, 73728, 381.1, dict(ulysses=8)),
    ("ST-DiT-12B 35k hybrid", "stdit", 24, 5120, 40, 8, 36864, 402.5, dict(ulysses=8, fsdp=True)),
]


def _paper_config(family, layers, hidden, heads, frames, lora=256, height=1024):
    from megatron_video.training.config import config_from_dict

    return config_from_dict(
        dict(
            model=dict(
                family=family,
                num_layers=layers,
                hidden_size=hidden,
                num_attention_heads=heads,
                lora_rank=lora,
                patch_size=[1, 2, 2],
                stdit_full_attention_layers=[],
            ),
            data=dict(
                source="shards",
                shards="none",
                text_embed_dim=1024,
                caption_len=512,
                num_frames=1 + 4 * (frames - 1),
                height=height,
                width=1024,
            ),
            train=dict(bf16=True, sample=False, micro_batch_size=1),
        )
    )


KERNEL_EFF = (0.62, 0.50)  # h100 matmul / attention fractions well-tuned kernels reach alone
FIT_ROW = "ST-DiT-12B 35k hybrid"  # the row with the most complete published layout


@contextlib.contextmanager
def _h100_scaled(scale: float):
    """The ``h100`` profile with ``scale`` x the kernel-level fractions, while inside."""
    from megatron_video.planner import hardware

    saved = hardware.PROFILES["h100"]
    m, a = (scale * x for x in KERNEL_EFF)
    hardware.PROFILES["h100"] = dataclasses.replace(saved, matmul_eff=m, attn_eff=a)
    try:
        yield
    finally:
        hardware.PROFILES["h100"] = saved


def _at_published(row, gpus):
    """The best fitting layout with the row's published degrees."""
    from megatron_video.training.planning import model_shape, plan_config

    name, fam, layers, hidden, heads, frames, tokens, _pub, degrees = row
    cfg = _paper_config(fam, layers, hidden, heads, frames, height=1152)
    assert model_shape(cfg).seq == tokens, (name, model_shape(cfg).seq)
    fitting = plan_config(cfg, gpus, 8, "h100").fitting
    at = next(c for c in fitting if all(getattr(c.layout, k) == v for k, v in degrees.items()))
    return at, fitting[0]


def fit_h100(gpus: int = 64) -> float:
    """The factor on ``KERNEL_EFF`` at which ``FIT_ROW``'s prediction at its published degrees
    equals the published TFLOP/s/GPU (bisection; step time is monotone in the fractions)."""
    row = next(r for r in PAPER if r[0] == FIT_ROW)
    lo, hi = 0.2, 1.5
    for _ in range(30):
        mid = (lo + hi) / 2
        with _h100_scaled(mid):
            lo, hi = (lo, mid) if _at_published(row, gpus)[0].tflops_per_gpu > row[7] else (mid, hi)
    return (lo + hi) / 2


def paper_table(gpus: int = 64):
    from megatron_video.planner import get_hardware
    from megatron_video.training.planning import plan_config

    print(
        f"\n(b) NeMo VFM paper vs planner, {gpus} H100 (8 per node), bf16, AdaLN-LoRA r 256, "
        f"patch 1x2x2 (ST-DiT frames of 72x64 tokens, DiT 64x64), 512 caption tokens, one "
        f"micro-batch per DP rank"
    )
    scale = fit_h100(gpus)
    h = get_hardware("h100")
    print(
        f"h100 fractions fitted on {FIT_ROW}: {scale:.3f} x kernel-level {KERNEL_EFF} = matmul "
        f"{scale * KERNEL_EFF[0]:.3f}, attention {scale * KERNEL_EFF[1]:.3f} (the profile holds "
        f"{h.matmul_eff:.3f}, {h.attn_eff:.3f}); the other rows held out"
    )
    print(
        f"{'row':<24}{'published':>11}{'predicted':>11}{'error':>8}  at the published degrees "
        f"(the best such layout); the planner's best"
    )
    for row in PAPER:
        at, best = _at_published(row, gpus)
        pub = row[7]
        print(
            f"{row[0]:<24}{pub:>11.1f}{at.tflops_per_gpu:>11.1f}{at.tflops_per_gpu / pub - 1:>8.0%}  "
            f"{at.layout.name()}; {best.layout.name()} ({best.tflops_per_gpu:.0f})"
        )
    findings = (  # Figure 10: the best layout, and FSDP alone's share of the best throughput
        (2, "FSDP alone near-optimal (FSDP alone 90-95 % of the best)"),
        (18, "TP + CP + FSDP (FSDP alone 55-60 % of the best)"),
    )
    for frames, finding in findings:
        cfg = _paper_config("video_dit", 28, 4096, 32, frames)
        fitting = plan_config(cfg, gpus, 8, "h100").fitting
        best, lay = fitting[0], fitting[0].layout
        alone = [c for c in fitting if c.layout.fsdp and c.layout.tp * c.layout.cp == 1]
        share = alone[0].tokens_per_s_per_gpu / best.tokens_per_s_per_gpu if alone else 0.0
        print(
            f"DiT-7B {frames * 4096 // 1000}k tokens: published best {finding}; planner: "
            f"{lay.name()} ({best.tflops_per_gpu:.0f} TFLOP/s/GPU), FSDP alone {share:.0%}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="show the known environment warnings (held back in one line by default)",
    )
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument(
        "--world", type=int, nargs="+", default=[2, 4], choices=sorted(LAYOUTS),
        help="gloo ranks (2: one per core, as the planner models; 4: two per core)",
    )  # fmt: skip
    ap.add_argument("--save", help="write the measured rows to this JSON file")
    ap.add_argument("--load", help="fit and print rows a --save wrote (no measuring)")
    a = ap.parse_args()
    if a.load:
        saved = json.loads(Path(a.load).read_text())
        for world, by_family in saved.items():
            measured_table(by_family, int(world))
    elif not a.skip_measure:
        saved = {}
        for world in a.world:
            saved[world] = {"video_dit": measure_rows(a.iters, world)}
            saved[world][OTHER[0]] = measure_rows(a.iters, world, OTHER[0], OTHER[1][world])
            measured_table(saved[world], world)
        if a.save:
            Path(a.save).write_text(json.dumps(saved, indent=1))
    paper_table()


if __name__ == "__main__":
    from megatron_video.training.console import quiet_script

    quiet_script()  # known environment warnings held back in one line; --verbose shows them
    main()
