"""Streaming AR generation with a KV cache (``generation.streaming``, ``attention.kv_cache``), float64.

Oracles, none of them the cache code: (1) the recompute sampler ``cp_sampling.sample_autoregressive``
(the whole ``[clean ; noisy]`` sequence at every step) for an unbounded window, with and without
CFG, for ``ar_dit`` and ``wan_ar``; a stale cache (noisy keys / values appended) must differ.
The text's cross-attention keys / values, memoised per prompt, equal the unmemoised run bitwise,
and the text is projected once per prompt (positive and negative rows apart under CFG).
(2) For sink + window and prompt switches, a no-cache recompute over exactly the frames the rule
keeps, with a dense mask written here from the rule and the same absolute RoPE frames. (3) Under CP
(U2xR2, U4, R4, TP2xCP2) the cached generator equals its CP = 1 run, and each rank holds 1/N of
the cache. Every case runs on the 4-rank pool (CP = 1 cases as replicas).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from megatron_video.testing.streaming_case import (
    C_IN,
    STEPS,
    TOL,
    B,
    _build,
    _conds,
    _err,
)

H = W = 2  # token grid per frame
S = H * W
NB, F = 2, 6  # frames per block, latent frames


# ---------------------------------------------------------------------------------------------
# models (the same full weights on every layout)
# ---------------------------------------------------------------------------------------------


def _noise(frames=F):
    g = torch.Generator().manual_seed(7)
    return torch.randn(B, frames * S, C_IN, generator=g, dtype=torch.float64)


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _stale():
    """A deliberately stale cache: the last noisy input's keys / values appended, not the clean."""
    from megatron_video.generation import streaming

    return _patched(streaming, "_appended", lambda last_input, clean: last_input)


def _text_uncached():
    """The cross-attention keys / values projected at every call (no memo)."""
    from megatron_video.attention.kv_cache import KVCache

    return _patched(KVCache, "text_kv", lambda self, key, context, project: project(context))


def _count_text_projections(model):
    """``(calls, rows, hooks)``: lists filled by every cross-attention ``linear_kv`` call."""
    calls, rows, hooks = [], [], []
    for name, mod in model.named_modules():
        if name.endswith("cross_attention.linear_kv"):

            def hook(mod, args, out):
                calls.append(1)
                rows.append(args[0].shape[0])

            hooks.append(mod.register_forward_hook(hook))
    return calls, rows, hooks


def _image():
    """The tokens of a conditioning first latent frame ``[B, S, C]`` (TI2V)."""
    g = torch.Generator().manual_seed(11)
    return torch.randn(B, S, C_IN, generator=g, dtype=torch.float64)


def _cached(model, family, groups=None, *, frames=F, w=1.0, rule=None, switches=(), image=False):
    """Every block of the cached generator concatenated ``[b, frames*S, C]``, and the cache's
    bytes on this rank after the last block (``image``: frame 0 conditioned on ``_image()``)."""
    from megatron_video.generation.ar_models import block_model
    from megatron_video.generation.streaming import stream_autoregressive

    cond, null = _conds(family)
    noise = _noise(frames)
    N, rank = (1, 0) if groups is None else (groups.cp_size, groups.cp_rank)
    out, nbytes = [], 0
    with torch.no_grad():
        for _, block, cache in stream_autoregressive(
            block_model(model, H, W, NB, rank, N),
            lambda j: noise[:, j * NB * S : (j + 1) * NB * S],
            frames // NB,
            NB,
            S,
            cond,
            groups=groups,
            null_cond=null if w != 1.0 else None,
            guidance_scale=w,
            num_steps=STEPS,
            rule=rule,
            switches=[(f, _conds(family, p)[0]) for f, p in switches],
            first_frame=_image() if image else None,
        ):
            out.append(block)
            nbytes = cache.nbytes()
    return torch.cat(out, dim=1), nbytes


def _recompute(model, family, w=1.0):
    from megatron_video.generation.ar_models import recompute_velocity
    from megatron_video.generation.cp_sampling import sample_autoregressive
    from megatron_video.layouts.balanced_sp import BalancedSPLayout

    cond, null = _conds(family)
    layout = BalancedSPLayout(F, S, NB, 1)
    with torch.no_grad():
        return sample_autoregressive(
            recompute_velocity(model, layout, 0, H, W),
            layout,
            0,
            _noise(),
            cond,
            null_cond=null if w != 1.0 else None,
            guidance_scale=w,
            num_steps=STEPS,
        )


# ---------------------------------------------------------------------------------------------
# the no-cache oracle of the window rule and of prompt switches (written from the rule)
# ---------------------------------------------------------------------------------------------
def _kept_by_rule(kf, first, sink, window):
    """Frame ``kf`` is attended by the block starting at ``first`` (the documented rule)."""
    return kf < first and (kf < sink or kf >= first - window)


def _oracle(
    model, family, frames, gen_blocks, prefilled, allowed, cond, null, w, total, image=None
):
    """No-cache generation of ``gen_blocks`` (block indices) over the tokens of ``frames`` (each
    frame's clean and noisy copy, absolute RoPE frames); ``allowed(q_side, q_frame, k_side,
    k_frame)`` is the attention rule (side 0 clean, 1 noisy); ``prefilled``: frame -> clean tokens.
    ``image [B, S, C]``: frame 0's noisy copy is the image at timestep 0, never updated (TI2V)."""
    from megatron_video.attention import masks
    from megatron_video.diffusion.cfg import guided_denoise
    from megatron_video.diffusion.samplers import flow_timesteps
    from megatron_video.generation.ar_models import sequence_velocity

    n = len(frames)
    fr = torch.tensor(frames).repeat_interleave(S)
    side = torch.cat([torch.zeros(n * S, dtype=torch.long), torch.ones(n * S, dtype=torch.long)])
    tok_frame = torch.cat([fr, fr])
    table = torch.tensor(
        [
            [
                allowed(int(side[q]), int(tok_frame[q]), int(side[k]), int(tok_frame[k]))
                for k in range(2 * n * S)
            ]
            for q in range(2 * n * S)
        ]
    )
    v = sequence_velocity(
        model, tok_frame, torch.arange(2 * n * S) % S, H, W, masks.from_dense(table)
    )
    fn = v if w == 1.0 else (lambda x, t, c: guided_denoise(v, x, t, c, null, w))
    noise = _noise(total)
    clean = torch.zeros(B, n * S, C_IN, dtype=torch.float64)
    noisy = torch.cat([noise[:, f * S : (f + 1) * S] for f in frames], dim=1)
    for i, f in enumerate(frames):
        if f in prefilled:
            clean[:, i * S : (i + 1) * S] = prefilled[f]
    held = torch.zeros(n * S, dtype=torch.bool)
    if image is not None and 0 in frames:
        held = fr == 0
        noisy[:, held] = image
    ts = [float(x) for x in flow_timesteps(STEPS, 1.0)]
    for j in gen_blocks:
        mine = ((fr // NB) == j) & ~held
        for i in range(STEPS):
            tn = torch.where(mine, ts[i], 1.0).to(torch.float64)
            tn = torch.where(held, 0.0, tn).to(torch.float64).expand(B, -1)
            t = torch.cat([torch.zeros_like(tn), tn], dim=1)
            vel = fn(torch.cat([clean, noisy], dim=1), t, cond)[:, n * S :]
            noisy = torch.where(mine[None, :, None], noisy + (ts[i + 1] - ts[i]) * vel, noisy)
        clean = torch.where((mine | (held & (j == 0)))[None, :, None], noisy, clean)
    return {f: clean[:, i * S : (i + 1) * S] for i, f in enumerate(frames)}


def _window_oracle(model, family, sink, window, w, frames=F, image=None):
    cond, null = _conds(family)

    def allowed(qs, qf, ks, kf):
        qb, kb = qf // NB, kf // NB
        if ks == 1:
            return qs == 1 and kb == qb
        return (qs == 0 and kb == qb) or _kept_by_rule(kf, qb * NB, sink, window)

    frame_ids, blocks = list(range(frames)), range(frames // NB)
    got = _oracle(model, family, frame_ids, blocks, {}, allowed, cond, null, w, frames, image)
    return torch.cat([got[f] for f in range(frames)], dim=1)


def _switch_oracle(model, family, sink, window, switch, w, frames=F):
    """Before ``switch``: the window oracle (old prompt). At it: the kept frames re-encoded under
    the new prompt, block-causally among themselves; then the rule."""
    before = _window_oracle(model, family, sink, window, w, frames)
    kept = [f for f in range(switch) if _kept_by_rule(f, switch, sink, window)]
    seq = kept + list(range(switch, frames))
    cond, null = _conds(family, 1)[0], _conds(family)[1]

    def allowed(qs, qf, ks, kf):
        qb, kb = qf // NB, kf // NB
        if ks == 1:
            return qs == 1 and kb == qb
        if qf < switch:  # a re-encoded frame: block-causal among the kept frames
            return qs == 0 and kb <= qb
        return (qs == 0 and kb == qb) or _kept_by_rule(kf, qb * NB, sink, window)

    pre = {f: before[:, f * S : (f + 1) * S] for f in kept}
    got = _oracle(
        model, family, seq, range(switch // NB, frames // NB), pre, allowed, cond, null, w, frames
    )
    return torch.cat([before[:, : switch * S]] + [got[f] for f in range(switch, frames)], dim=1)


# ---------------------------------------------------------------------------------------------
# cases (run on every rank of the pool)
# ---------------------------------------------------------------------------------------------


def _cp1_cases(family):
    from megatron_video.generation.streaming import WindowRule
    from megatron_video.testing.parallel import model_parallel

    out, differ = {}, {}  # errors (<= TOL); differences that must be far above rounding
    with model_parallel(seed=0):
        model = _build(family)
        for w in (1.0, 3.0):
            ref = _recompute(model, family, w)
            out[f"unbounded w={w}"] = _err(_cached(model, family, w=w)[0], ref)
            with _stale():
                differ[f"stale w={w}"] = _err(_cached(model, family, w=w)[0], ref)
        rule = WindowRule(NB, sink=2, window=2)  # block 3 drops frames 2, 3
        windowed = _cached(model, family, frames=8, w=3.0, rule=rule)[0]
        out["sink2 window2"] = _err(windowed, _window_oracle(model, family, 2, 2, 3.0, frames=8))
        differ["window drops frames"] = _err(windowed, _cached(model, family, frames=8, w=3.0)[0])
        rule = WindowRule(NB, sink=0, window=2)
        switched = _cached(model, family, rule=rule, switches=[(4, 1)])[0]
        out["sink0 window2 switch@4"] = _err(switched, _switch_oracle(model, family, 0, 2, 4, 1.0))
        differ["switch changes frames"] = _err(switched, _cached(model, family, rule=rule)[0])
        out["unbounded switch@2"] = _err(
            _cached(model, family, w=3.0, switches=[(2, 1)])[0],
            _switch_oracle(model, family, 0, F, 2, 3.0),
        )
        out.update(_text_cache_cases(model, family))
        img = _cached(model, family, w=3.0, image=True)[0]
        out["image w=3.0"] = _err(img, _window_oracle(model, family, 0, F, 3.0, image=_image()))
        out["image is frame 0"] = float(not torch.equal(img[:, :S], _image()))
        differ["image matters"] = _err(img[:, S:], _cached(model, family, w=3.0)[0][:, S:])
    return out, differ


def _text_cache_cases(model, family):
    """Memoised text keys / values equal the unmemoised run: bitwise when every projection sees
    the same rows (CFG; a prompt switch without CFG), to rounding (<= TOL) when a CFG switch
    projects only the positive rows (a smaller matmul may sum in another order). Each layer
    projects the text once per prompt: all 2B rows for the first, only the B positive rows at
    the switch (the negative rows kept)."""
    from megatron_video.generation.streaming import WindowRule

    rule = WindowRule(NB, sink=0, window=2)
    runs = {
        "CFG": dict(w=3.0),
        "switch": dict(rule=rule, switches=[(4, 1)]),
        "CFG + switch": dict(w=3.0, rule=rule, switches=[(4, 1)]),
    }
    out, layers = {}, sum(n.endswith("cross_attention") for n, _ in model.named_modules())
    for name, run in runs.items():
        with _text_uncached():
            plain = _cached(model, family, **run)[0]
        calls, rows, hooks = _count_text_projections(model)
        memo = _cached(model, family, **run)[0]
        for h in hooks:
            h.remove()
        exact = name != "CFG + switch"
        out[f"text memo == no memo, {name}"] = (
            float(not torch.equal(memo, plain)) if exact else _err(memo, plain)
        )
        prompts = 1 + len(run.get("switches", ()))
        out[f"text projections, {name}"] = abs(len(calls) - prompts * layers)
        b = 2 * B if "w" in run else B  # the first prompt: all rows; a switch: the positive ones
        out[f"text rows, {name}"] = abs(sum(rows) - (b + B * (prompts - 1)) * layers)
    return out


@pytest.mark.parametrize("family", ["ar_dit", "wan_ar"])
def test_cached_generator_equals_no_cache_oracles(pool4, family):
    # TOL (1e-10) is ~2,500x the measured error (<= 4e-14): the oracles sum in other orders
    # (dense masks, other matmul shapes); a float64 rounding bound shared by the streaming tests,
    # far below what a wrong cache, window or switch does (>= 0.6, measured below)
    for rank, (errors, differ) in enumerate(pool4.run(_cp1_cases, family)):
        for name, err in errors.items():
            assert err <= TOL, (rank, name, err)
        # a stale cache must be caught; the window, the switch and the image must matter
        # (measured: each >= 0.8; 1e-6 is far above float64 rounding, far below the effect)
        for name, diff in differ.items():
            assert diff > 1e-6, (rank, name, diff)


# ---------------------------------------------------------------------------------------------
# under context parallelism: equal to CP = 1, 1/N of the cache per rank
# ---------------------------------------------------------------------------------------------
DEGREES = [(2, 2, 1), (4, 1, 1), (1, 4, 1), (2, 1, 2)]  # (U, R, TP)


# CFG, sink 2 + window 2, a prompt switch, a conditioning first frame (TI2V)
CP_RUN = dict(frames=8, w=3.0, switches=[(4, 1)], image=True)


@functools.lru_cache(maxsize=None)  # per worker process: once per family for every degree
def _cp1_reference(family):
    from megatron_video.generation.streaming import WindowRule
    from megatron_video.testing.parallel import model_parallel

    with model_parallel(seed=0):
        return _cached(_build(family), family, rule=WindowRule(NB, 2, 2), **CP_RUN)


def _cp_cases(family, U, R, tp):
    from megatron_video.attention.ulysses import kv_heads_for_a2a
    from megatron_video.generation.streaming import WindowRule
    from megatron_video.testing.parallel import video_parallel

    ref, ref_bytes = _cp1_reference(family)
    with video_parallel(U, R, tp=tp, seed=0) as groups:
        model = _build(family, tp=tp, cp=U * R)
        got, nbytes = _cached(model, family, groups, rule=WindowRule(NB, 2, 2), **CP_RUN)
    hk = (2 if family == "ar_dit" else 4) // tp  # kv heads per TP rank
    replicas = kv_heads_for_a2a(hk, U) // hk  # Ulysses repeats kv heads when U does not divide them
    return {
        "output": _err(got, ref),
        "cache bytes x N / replicas": abs(nbytes * U * R * tp / replicas - ref_bytes),
    }


@pytest.mark.parametrize("family", ["ar_dit", "wan_ar"])
@pytest.mark.parametrize("degree", DEGREES, ids=lambda d: f"U{d[0]}xR{d[1]}xTP{d[2]}")
def test_cp_layouts_equal_cp1(pool4, family, degree):
    for rank, res in enumerate(pool4.run(_cp_cases, family, *degree, ranks_per_node=4)):
        for name, err in res.items():
            assert err <= TOL, (rank, name, err)


# ---------------------------------------------------------------------------------------------
# train.sample for the Wan families (the shared generation module)
# ---------------------------------------------------------------------------------------------
def _wan_train_sample(family, tmp, vae=None):
    import warnings

    from megatron_video.testing.wan import tiny_wan_config
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    # wan_ar: a block is one latent frame of 6 tokens, so CP 2 (DP 2)
    cp = dict(context_parallel_size=4, ulysses_size=2, ring_size=2)
    if family == "wan_ar":
        cp = dict(context_parallel_size=2, ulysses_size=2)
    cfg = tiny_wan_config(family, tmp, f"{tmp}/shards", **cp)
    cfg.train.steps, cfg.train.sample, cfg.train.save, cfg.train.sample_batch = 1, True, False, 1
    cfg.diffusion.sample_steps, cfg.diffusion.guidance_scale = 2, 2.0
    cfg.vae.diffusers = vae  # wan: decoded into sample.gif
    t = Trainer(cfg, progress=False)
    try:
        metrics = t.run()
    finally:
        t.close()
    return metrics.get("sample")


@pytest.mark.parametrize("family", ["wan", "wan_ar"])
def test_train_sample_works_for_wan(pool4, tmp_path, family):
    from megatron_video.testing.wan import tiny_wan_config, write_random_latent_shards

    cfg = tiny_wan_config(family, tmp_path, tmp_path / "shards")
    write_random_latent_shards(cfg, tmp_path / "shards")
    vae = None
    if family == "wan":
        from megatron_video.testing.wan import save_tiny_wan_vae

        vae = str(save_tiny_wan_vae(tmp_path / "vae"))
    sample = pool4.run(_wan_train_sample, family, str(tmp_path), vae, ranks_per_node=2)[0]
    latents = torch.load(sample["latents"])
    assert tuple(latents.shape) == (1, 4, 4, 4, 6) and torch.isfinite(latents).all()
    assert ("gif" in sample) == (family == "wan")  # wan_ar's config names no VAE here
    if family == "wan":
        from PIL import Image

        with Image.open(sample["gif"]) as im:
            assert im.n_frames == 13  # 1 + 4 (F - 1) raw frames of the 4 latent frames


# ---------------------------------------------------------------------------------------------
# any CP size: a block's tokens the CP size does not divide (padded, docs/generation.md)
# ---------------------------------------------------------------------------------------------
UH, UW, UNB, UF = 1, 3, 3, 12  # a block of 3 latent frames x 3 tokens = 9 tokens; 4 blocks
UNEVEN = [(2, 2, 1), (4, 1, 1), (1, 4, 1), (1, 2, 1)]  # (U, R, TP): 9 tokens -> 12 or 10


def _uneven_cached(model, family, groups=None):
    """CFG, sink 3 + window 3 (block 3 drops frames 3-5), a prompt switch at frame 6 and a
    conditioning first frame, on blocks of 9 tokens (``UH x UW`` per frame)."""
    from megatron_video.generation.ar_models import block_model
    from megatron_video.generation.streaming import WindowRule, stream_autoregressive

    S3 = UH * UW
    cond, null = _conds(family)
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(B, UF * S3, C_IN, generator=g, dtype=torch.float64)
    image = torch.randn(B, S3, C_IN, generator=torch.Generator().manual_seed(11)).double()
    N, rank = (1, 0) if groups is None else (groups.cp_size, groups.cp_rank)
    with torch.no_grad():
        blocks = stream_autoregressive(
            block_model(model, UH, UW, UNB, rank, N),
            lambda j: noise[:, j * UNB * S3 : (j + 1) * UNB * S3],
            UF // UNB,
            UNB,
            S3,
            cond,
            groups=groups,
            null_cond=null,
            guidance_scale=3.0,
            num_steps=STEPS,
            rule=WindowRule(UNB, sink=3, window=3),
            switches=[(6, _conds(family, 1)[0])],
            first_frame=image,
        )
        return torch.cat([b for _, b, _ in blocks], dim=1)


@functools.lru_cache(maxsize=None)
def _uneven_reference(family):
    from megatron_video.testing.parallel import model_parallel

    with model_parallel(seed=0):
        return _uneven_cached(_build(family), family)


def _uneven_cases(family, U, R, tp):
    import types

    from megatron_video.attention import masks
    from megatron_video.generation import streaming
    from megatron_video.testing.parallel import video_parallel

    ref = _uneven_reference(family)
    with video_parallel(U, R, tp=tp, seed=0) as groups:
        model = _build(family, tp=tp, cp=U * R)
        got = _uneven_cached(model, family, groups)
        # a deliberately unmasked pad token (real tokens attend the padding) must be caught
        leaky = types.SimpleNamespace(packed=lambda cu: masks.full())
        with _patched(streaming, "masks", leaky):
            leak = _uneven_cached(model, family, groups)
    return {"output": _err(got, ref), "unmasked padding": _err(leak, ref)}


@pytest.mark.parametrize("family", ["ar_dit", "wan_ar"])
@pytest.mark.parametrize("degree", UNEVEN, ids=lambda d: f"U{d[0]}xR{d[1]}xTP{d[2]}")
def test_cp_size_not_dividing_a_block_equals_cp1(pool4, family, degree):
    for rank, res in enumerate(pool4.run(_uneven_cases, family, *degree, ranks_per_node=4)):
        assert res["output"] <= TOL, (rank, res)  # measured <= 4e-14 (TOL: see above)
        assert res["unmasked padding"] > 1e-6, (rank, res)  # measured: >= 0.6


def test_cp_size_above_a_block_is_refused_before_collectives():
    from megatron_video.generation.streaming import stream_autoregressive

    groups = type("G", (), {"cp_size": 16, "cp_rank": 0})()
    with pytest.raises(ValueError, match=r"CP size \(16\) must be at most the tokens of a block"):
        next(stream_autoregressive(None, None, 2, 3, 3, None, groups=groups))
