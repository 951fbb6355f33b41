"""LongLive's prompt-switch KV re-cache (``stream_autoregressive(recache="longlive")``), float64.

Oracle: LongLive v1.0's ``_recache_after_switch`` with ``global_sink: true`` and the kv-cache
branch of its ``CausalWanSelfAttention.forward``, transcribed here with the cache primitives
(``KVCache``, ``CacheStep``) and the plain model call (``ar_models.sequence_velocity``), at CP 1.
Its ``local_attn_size`` is ``L = SINK + WINDOW + NB``. At a switch at frame ``f0`` it re-runs frames
``[f0 - min(L, f0), f0)`` in one pass at timestep 0 (``context_noise``) with no mask among them;
when that pass starts after frame 0 (``is_recompute``) the sink slots are protected
(``write_start_index = max(local_start_index, sink_tokens)``): the sink keeps its old-prompt keys /
values and only the last ``L - SINK`` frames are written (the others are attended by nobody);
from frame 0 every frame is re-encoded. Here: the switch at frame 6 re-encodes ``[0, 6)`` (sink
too), the one at 12 keeps the sink (written under prompt 1) and re-encodes ``[6, 12)``.
Blocks of 9 tokens (3 frames of 1x3), so U2xR2 pads blocks and the re-cached span (18 -> 20).
"""

from __future__ import annotations

import pytest
import torch

from megatron_video.testing.streaming_case import C_IN, STEPS, TOL, B, _build, _conds, _err

H, W = 1, 3
S = H * W
NB, F = 3, 15  # frames per block, latent frames: 5 blocks
SINK, WINDOW = 3, 3  # WindowRule(NB, SINK, WINDOW) <-> LongLive local_attn_size = 9, sink_size = 3
SWITCHES = ((6, 1), (12, 2))  # (frame, prompt seed)
GUIDE = 3.0  # classifier-free guidance scale (positive and negative caches)


def _noise():
    g = torch.Generator().manual_seed(7)
    return torch.randn(B, F * S, C_IN, generator=g, dtype=torch.float64)


def _stream(model, family, groups=None, recache="longlive"):
    from megatron_video.generation.ar_models import block_model
    from megatron_video.generation.streaming import WindowRule, stream_autoregressive

    cond, null = _conds(family)
    noise = _noise()
    N, rank = (1, 0) if groups is None else (groups.cp_size, groups.cp_rank)
    with torch.no_grad():
        blocks = stream_autoregressive(
            block_model(model, H, W, NB, rank, N),
            lambda j: noise[:, j * NB * S : (j + 1) * NB * S],
            F // NB,
            NB,
            S,
            cond,
            groups=groups,
            null_cond=null,
            guidance_scale=GUIDE,
            num_steps=STEPS,
            rule=WindowRule(NB, SINK, WINDOW),
            switches=[(f, _conds(family, p)[0]) for f, p in SWITCHES],
            recache=recache,
        )
        return torch.cat([b for _, b, _ in blocks], dim=1)


def _velocity(model, frames, step, cond, null):
    """``v(x, t)``: the guided velocity of tokens at absolute latent ``frames`` (one call)."""
    from megatron_video.diffusion.cfg import guided_denoise
    from megatron_video.generation.ar_models import sequence_velocity

    fn = sequence_velocity(model, frames, torch.arange(frames.numel()) % S, H, W, step)

    def v(x, t):
        return guided_denoise(fn, x, torch.full(x.shape[:2], t).to(x), cond, null, GUIDE)

    return v


def _recache_frames(cache, f0, sink_rule):
    """LongLive's ``_recache_after_switch`` at ``f0``: the frames whose keys / values it writes,
    the cache trimmed to what that pass attends besides them. ``sink_rule=False`` breaks the
    global sink on purpose (the sink re-encoded under the new prompt with the window)."""
    L = SINK + WINDOW + NB  # local_attn_size
    start = f0 - min(L, f0)  # recache_start_frame
    if start == 0:  # not is_recompute (current_start 0): every slot written, the sink too
        cache.clear()
        return list(range(f0))
    if sink_rule:  # write_start_index = max(local_start_index, sink_tokens): sink slots kept
        cache.keep(lambda tags: tags < SINK)
        return list(range(start + SINK, f0))
    cache.clear()
    return list(range(SINK)) + list(range(start + SINK, f0))


def _longlive(model, family, sink_rule=True):
    """LongLive's streaming with ``global_sink: true`` at CP 1 (module docstring)."""
    from megatron_video.attention.kv_cache import CacheStep, KVCache
    from megatron_video.diffusion.samplers import flow_timesteps

    cond, null = _conds(family)
    prompts = {f: _conds(family, p)[0] for f, p in SWITCHES}
    noise, ts = _noise(), [float(t) for t in flow_timesteps(STEPS, 1.0)]
    cache, clean = KVCache(), {}
    with torch.no_grad():
        for f0 in range(0, F, NB):
            if f0 in prompts:
                cond = prompts[f0]
                frames = _recache_frames(cache, f0, sink_rule)
                fr = torch.tensor(frames).repeat_interleave(S)
                step = CacheStep(cache, fr, append=True)  # no mask: all among themselves
                _velocity(model, fr, step, cond, null)(torch.cat([clean[f] for f in frames], 1), 0)
            # the rolling cache: the sink slots and the last L - SINK - NB frames before the block
            cache.keep(lambda tags: (tags < SINK) | (tags >= f0 - WINDOW))
            fr = f0 + torch.arange(NB * S) // S
            x = noise[:, f0 * S : (f0 + NB) * S]
            v = _velocity(model, fr, CacheStep(cache, fr), cond, null)
            for i in range(STEPS):
                x = x + (ts[i + 1] - ts[i]) * v(x, ts[i])
            _velocity(model, fr, CacheStep(cache, fr, append=True), cond, null)(x, 0)
            clean.update({f0 + f: x[:, f * S : (f + 1) * S] for f in range(NB)})
    return torch.cat([clean[f] for f in range(F)], dim=1)


def _cp1_cases(family):
    import torch.distributed as dist

    from megatron_video.testing.parallel import model_parallel

    with model_parallel(seed=0):
        if dist.get_rank():
            return None  # CP 1 on one rank (no collectives in the model at CP 1)
        model = _build(family)
        got = _stream(model, family)
        ours = _stream(model, family, recache="block_causal")
        equal = {
            "longlive == transcription": _err(got, _longlive(model, family)),
            "same as ours before the first switch": _err(got[:, : 6 * S], ours[:, : 6 * S]),
        }
        differ = {  # stored as they are: an exact zero difference must fail (not -0.0 <= TOL)
            "differs from ours": _err(got, ours),
            "sink recomputed": _err(got, _longlive(model, family, sink_rule=False)),
        }
    return got, equal, differ


def _cp_case(family, ref):
    from megatron_video.testing.parallel import video_parallel

    with video_parallel(2, 2, seed=0) as groups:
        got = _stream(_build(family, cp=4), family, groups)
    return _err(got, ref)


@pytest.fixture(scope="module")
def cp1(pool4):
    return {family: pool4.run(_cp1_cases, family)[0] for family in ("ar_dit", "wan_ar")}


@pytest.mark.parametrize("family", ["ar_dit", "wan_ar"])
def test_longlive_recache_equals_transcription(cp1, family):
    _, equal, differ = cp1[family]
    for name, err in equal.items():  # float64: 0.0 measured on both families
        assert err <= TOL, (name, err)
    for name, diff in differ.items():  # the option must do something; a recomputed sink caught
        assert diff > 1e-6, (name, diff)  # measured 0.19 to 1.7


@pytest.mark.parametrize("family", ["ar_dit", "wan_ar"])
def test_longlive_recache_u2xr2_equals_cp1(pool4, cp1, family):
    errs = pool4.run(_cp_case, family, cp1[family][0], ranks_per_node=4)
    assert max(errs) <= TOL, errs


def test_recache_options_are_checked():
    from megatron_video.generation.streaming import stream_autoregressive

    def run(**kw):
        next(stream_autoregressive(None, None, 2, 1, 1, None, **kw))

    with pytest.raises(ValueError, match=r"recache \('bidirectional'\) must be one of"):
        run(recache="bidirectional")
    with pytest.raises(ValueError, match=r"global_sink \(False\) must be True"):
        run(recache="longlive", global_sink=False)


def test_generate_recache_flag_reaches_the_stream(tmp_path, monkeypatch):
    """``megatron-video generate --recache longlive`` -> ``generate(recache=)`` ->
    ``Generator.ar_blocks`` -> ``stream_autoregressive(recache=)``; default ours; a bad value
    is a ValueError naming ``--recache`` before the model is built."""
    from megatron_video.generation import streaming
    from megatron_video.generation.generator import Generator
    from megatron_video.testing.wan import tiny_wan_config
    from megatron_video.training import generate, trainer
    from megatron_video.training.cli import main
    from megatron_video.training.families import get_family

    seen = []
    monkeypatch.setattr(trainer, "init_distributed", lambda: False)
    monkeypatch.setattr(generate, "generate", lambda *a, **k: seen.append(k["recache"]) or {})
    argv = ["generate", "--checkpoint", "x", "--prompt", "p", "--frames", "9"]
    assert main(argv + ["--recache", "longlive"]) == 0 and main(argv) == 0
    assert seen == ["longlive", "block_causal"]

    cfg = tiny_wan_config("wan_ar", tmp_path, tmp_path / "shards")
    monkeypatch.setattr(streaming, "stream_autoregressive", lambda *a, **k: k["recache"])
    gen = Generator(None, generate.sample_spec(cfg, get_family("wan_ar")), None)
    assert gen.ar_blocks(None, None, None, 2, recache="longlive") == "longlive"
    assert gen.ar_blocks(None, None, None, 2) == "block_causal"

    monkeypatch.undo()
    monkeypatch.setattr(generate, "read_checkpoint_config", lambda c: (cfg, tmp_path, 1))
    monkeypatch.setattr(generate, "_load_model", lambda *a: pytest.fail("checked too late"))
    with pytest.raises(ValueError, match=r"--recache \('lolive'\) must be one of"):
        generate.generate(tmp_path, "a prompt", 9, recache="lolive")
