"""Any length at any CP (DESIGN.md capability 11; training/batches/placed.py), float64.

Wan's standard clip: 81 raw frames = 21 latent frames (here 21 x 1 x 3 tokens, a micro-batch of
two clips: 126 tokens, padded to 128). One step of the family's own pieces (``make_batches``,
``make_objective``, the model) for ``wan`` (T2V), ``wan`` with I2V first-frame conditioning (TI2V)
and ``video_dit`` at U2xR2, U4, R4, TP2xCP2 (4 ranks) and U4xR2, U2xR4 (8 ranks), none of which
divides 21 frames: the loss and every parameter gradient equal CP = 1 (the contiguous fixed-shape
path) to 1e-10; a noise slice off by one token or a pad token with loss fails the comparison.
"""

import zlib

import pytest
import torch

pytest.importorskip("diffusers")

from megatron_video.testing.wan import (  # noqa: E402
    save_tiny_wan_transformer,
    tiny_wan_config,
    write_random_latent_shards,
)

LAYOUTS = {  # (TP, U, R, ranks per simulated node)
    "reference": (1, 1, 1, 4),
    "u2xr2": (1, 2, 2, 2),
    "u4": (1, 4, 1, 4),
    "r4": (1, 1, 4, 2),
    "tp2xcp2": (2, 1, 2, 2),
    "u4xr2": (1, 4, 2, 4),
    "u2xr4": (1, 2, 4, 2),
    "u2": (1, 2, 1, 2),
    "r2": (1, 1, 2, 2),
}
AR_LAYOUTS = ("u2", "r2", "u2xr2")  # LongLive's 21 latent frames in 7 blocks of 3
FOUR, EIGHT = ("u2xr2", "u4", "r4", "tp2xcp2"), ("u4xr2", "u2xr4")
KINDS = ("wan", "wan_ti2v", "video_dit")
GEOMETRY = dict(num_frames=81, height=16, width=48)  # latent 21 x 2 x 6 -> tokens 21 x 1 x 3


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("any_cp")
    cfg = _config("wan", root, "reference")
    write_random_latent_shards(cfg, root / "shards")
    save_tiny_wan_transformer(root / "transformer", cfg)
    return root


def _config(kind: str, root, layout: str):
    tp, U, R, rpn = LAYOUTS[layout]
    family = kind if kind in ("video_dit", "ar_dit") else kind.split("_ti2v")[0]
    cfg = tiny_wan_config(
        "wan",
        root,
        root / "shards",
        tensor_model_parallel_size=tp,
        context_parallel_size=U * R,
        ulysses_size=U,
        ring_size=R,
        ranks_per_node=rpn,
    )
    for k, v in GEOMETRY.items():
        setattr(cfg.data, k, v)
    cfg.train.seed = 7  # step 0: one clip CFG-dropped, one I2V (TI2V), the other not
    if kind.endswith("_ti2v"):
        cfg.data.i2v_probability = 0.5
    cfg.model.family = family
    if family in ("wan_ar", "ar_dit"):
        cfg.model.frames_per_block = 3
    if family.startswith("wan"):
        cfg.model.init_from = str(root / "transformer")
    else:
        cfg.diffusion.objective = "edm" if family == "video_dit" else "flow"
        cfg.model.rope_theta = 100.0
    return cfg


def _float64(mb):
    for k, v in vars(mb).items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            setattr(mb, k, v.double())
    return mb


def _perturb(model, tp_rank: int, tp: int) -> None:
    """video_dit: deterministic random full weights, whatever the layout's initialisation drew
    (AdaLN-zero would leave most gradients 0); this rank's TP shard of them."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shape = list(p.shape)
            sharded = getattr(p, "tensor_model_parallel", False) and tp > 1
            if sharded:
                shape[p.partition_dim] *= tp
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
            if "norm" in name and name.endswith("weight"):
                full += 1.0
            if sharded:
                full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
            p.copy_(full)


def _full_grads(model, groups) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_video.parallel import comm

    out = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        if groups.cp_size > 1:
            comm.all_reduce(g, groups.cp_group, tag="test.grad")
        tp = ps.get_tensor_model_parallel_world_size() > 1
        if tp and getattr(p, "tensor_model_parallel", False) and p.partition_dim >= 0:
            g = comm.all_gather_cat(g, ps.get_tensor_model_parallel_group(), dim=p.partition_dim)
        elif tp and ("q_layernorm" in name or "k_layernorm" in name):  # as finalize_model_grads
            comm.all_reduce(g, ps.get_tensor_model_parallel_group(), tag="test.qk_norm")
        out[name] = g
    return out


def _build(kind, fam, cfg):
    from megatron.core import parallel_state as ps

    from megatron_video.training.families.wan import wan_transformer_config

    if kind.startswith("wan"):
        return fam.build_model(wan_transformer_config(cfg, params_dtype=torch.float64), config=cfg)
    model = fam.build_model(fam.transformer_config(cfg), config=cfg).double()
    tp = cfg.parallel.tensor_model_parallel_size
    _perturb(model, ps.get_tensor_model_parallel_rank() if tp > 1 else 0, tp)
    return model


def _step(kind: str, root, layout: str, break_it=None) -> dict:
    """Rank side: one float64 step of the family's pieces under ``layout``."""
    import torch.distributed as dist

    from megatron_video.parallel import comm
    from megatron_video.testing.parallel import video_parallel
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.config import validate
    from megatron_video.training.families import get_family

    cfg = _config(kind, root, layout)
    validate(cfg, dist.get_world_size())
    tp, U, R, rpn = LAYOUTS[layout]
    fam = get_family(cfg.model.family)
    with video_parallel(U, R, tp=tp, ranks_per_node=rpn, seed=0) as groups:
        model = _build(kind, fam, cfg)
        sample = fam.sample_layout(cfg, groups.cp_size)
        coords = RankCoords(cp_rank=groups.cp_rank, ulysses_size=U, ring_size=R)
        batches = fam.make_batches(
            cfg, coords=coords, vae=None, latent_scale=1.0, layout=sample.layout
        )
        objective = fam.make_objective(cfg, groups, sample)
        mb = _float64(next(batches.step_batches(0)))
        if break_it is not None:
            break_it(mb)
        args, kwargs = objective.model_call(mb, True)
        share = objective.loss(model(*args, **kwargs), mb)
        share.backward()
        loss = share.detach().clone()
        if groups.cp_size > 1:
            comm.all_reduce(loss, groups.cp_group, tag="test.loss")
        placed = type(batches).__name__ == "PlacedBatchMaker"
        i2v = getattr(mb, "i2v", None)
        out = dict(loss=float(loss), grads=_full_grads(model, groups), placed=placed)
        out["pads"] = mb.packed.clip_of(mb.local) < 0 if placed else None
        out.update(
            drop=mb.drop, i2v=i2v, sample=_sample(kind, cfg, fam, model, groups, batches, mb)
        )
        return out


def _sample(kind, cfg, fam, model, groups, batches, mb):
    """``train.sample``'s CP sampler (``generation.generator.Generator.t2v_tokens``): 2 guided
    steps from one noise on this layout's placement (T2V families)."""
    if fam.autoregressive:
        return None
    from megatron_video.generation.generator import Generator
    from megatron_video.training.batches.fixed import sample_generator
    from megatron_video.training.config import token_grid_of
    from megatron_video.training.generate import sample_spec
    from megatron_video.training.objectives import wan_text

    cfg.diffusion.sample_steps = 2
    T, Hp, Wp = token_grid_of(cfg)
    noise = torch.randn(1, T * Hp * Wp, 16, generator=sample_generator(9), dtype=torch.float64)
    if kind == "video_dit":
        emb, mask = mb.caption_ids[1:], mb.caption_mask[1:]
        cond, null = (emb, mask, torch.zeros(1, dtype=torch.bool)), (emb, mask, torch.ones(1) > 0)
    else:
        mb.drop = torch.zeros_like(mb.drop)
        cond = (wan_text(mb)[1:],)
        null = (torch.zeros_like(cond[0]),)
    placed = batches.placed(1) if hasattr(batches, "placed") else None
    geometry = fam.sample_layout(cfg, groups.cp_size).geometry
    gen = Generator(
        model, sample_spec(cfg, fam), groups, geometry, batches.token_ids, placed=placed
    )
    with torch.no_grad():
        return gen.t2v_tokens(cond, null, noise)


def _compare(ref, per_rank, label) -> float:
    worst = 0.0
    # a gradient at the rounding floor (e.g. ~1e-19 where the reference is numerically 0) is
    # compared against the largest gradient of the model, not against itself
    floor = 1e-6 * max(float(g.abs().max()) for g in ref["grads"].values())
    for rank, got in enumerate(per_rank):
        assert got["placed"], (label, "token placement must be in use")
        assert abs(got["loss"] - ref["loss"]) <= 1e-10 * ref["loss"], (label, rank, got["loss"])
        assert got["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            err = float((got["grads"][name] - g).abs().max()) / max(float(g.abs().max()), floor)
            assert err <= 1e-10, (label, rank, name, err)
            worst = max(worst, err)
        if ref["sample"] is not None:
            err = float((got["sample"] - ref["sample"]).abs().max() / ref["sample"].abs().max())
            assert err <= 1e-10, (label, rank, "sample", err)
    return worst


_REFERENCE = {}


def _reference(pool4, kind, root) -> dict:
    if kind not in _REFERENCE:
        ref = pool4.run(_step, kind, root, "reference")[0]
        assert not ref["placed"] and ref["loss"] > 0
        nonzero = [n for n, g in ref["grads"].items() if float(g.abs().max()) > 0]
        assert len(nonzero) > 0.9 * len(ref["grads"]), "most parameters must receive a gradient"
        _REFERENCE[kind] = ref
    return _REFERENCE[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_21_frames_on_4_ranks_match_cp1(pool4, root, kind):
    ref = _reference(pool4, kind, root)
    assert ref["drop"].tolist() == [True, False]  # the text path gets gradients
    if kind == "wan_ti2v":  # the micro-batch holds one I2V and one T2V clip
        assert ref["i2v"].tolist() == [False, True]
    for layout in FOUR:
        per_rank = pool4.run(_step, kind, root, layout, ranks_per_node=LAYOUTS[layout][3])
        worst = _compare(ref, per_rank, f"{kind}/{layout}")
        if kind == "wan_ti2v":
            assert per_rank[0]["i2v"].tolist() == ref["i2v"].tolist()
        print(f"{kind}/{layout}: max grad rel diff {worst:.1e}")


@pytest.mark.parametrize("kind", KINDS)
def test_21_frames_on_8_ranks_match_cp1(pool4, pool8, root, kind):
    ref = _reference(pool4, kind, root)
    for layout in EIGHT:
        per_rank = pool8.run(_step, kind, root, layout, ranks_per_node=LAYOUTS[layout][3])
        print(f"{kind}/{layout}: max grad rel diff {_compare(ref, per_rank, kind + layout):.1e}")


@pytest.mark.parametrize("kind", ["wan_ar", "wan_ar_ti2v", "ar_dit"])
def test_ar_7_blocks_at_cp2_and_cp4_match_cp1(pool4, root, kind):
    """Teacher forcing at LongLive's shape (21 latent frames, blocks of 3): at U2, R2 and U2xR2
    (Balanced SP needs frames a multiple of CP x 3) the clean + noisy copies are placed by token
    (a frame's pair of copies on one rank); loss and gradients equal CP = 1 (Balanced SP)."""
    ref = _reference(pool4, kind, root)
    if kind.endswith("_ti2v"):
        assert ref["i2v"].tolist() == [False, True]
    for layout in AR_LAYOUTS:
        per_rank = pool4.run(_step, kind, root, layout, ranks_per_node=LAYOUTS[layout][3])
        print(f"{kind}/{layout}: max grad rel diff {_compare(ref, per_rank, kind + layout):.1e}")


def _noise_off_by_one(mb):
    """A slice off by one token: each token's noise taken from its neighbour."""
    mb.noise = torch.roll(mb.noise, 1, dims=1)


def _pad_with_loss(mb):
    """A pad token that carries loss."""
    mb.loss_mask = mb.loss_mask | (mb.packed.clip_of(mb.local) < 0)[None]


@pytest.mark.parametrize("break_it", [_noise_off_by_one, _pad_with_loss])
def test_a_broken_placement_fails_the_comparison(pool4, root, break_it):
    """The comparison above catches a placement broken on purpose (``wan`` at U2xR2)."""
    ref = _reference(pool4, "wan", root)
    per_rank = pool4.run(_step, "wan", root, "u2xr2", break_it, ranks_per_node=2)
    if break_it is _pad_with_loss:  # the 2 pad tokens of the 128 lie on some rank
        assert any(bool((r["pads"]).any()) for r in per_rank)
    with pytest.raises(AssertionError):
        _compare(ref, per_rank, "broken on purpose")


def _trainer_step(root, parallel: dict) -> dict:
    """Rank side: the trainer's forward-backward of step 0, fp32."""
    import warnings

    from megatron_video.models.wan.interop import global_param_name
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    cfg = _config("wan", root, "reference")
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    # the step's 4 clips: reference DP 4 x 1 clip; PP2 x CP2 (DP 1): 2 micro-batches of 2 clips
    cfg.train.global_batch_size = 4
    cfg.train.micro_batch_size = 2 if parallel else 1
    trainer = Trainer(cfg, progress=False)
    try:
        loss = trainer.forward_backward(0)
        grads = {
            global_param_name(trainer.model, n): p.main_grad.detach().clone()
            for n, p in trainer.model.named_parameters()
        }
        return dict(loss=loss, grads=grads, placed=type(trainer.batches).__name__)
    finally:
        trainer.close()


def test_trainer_pp2xcp2_at_21_frames(pool4, root):
    """Through ``Trainer`` (Megatron's schedule, DDP): PP 2 x CP 2 at 21 frames (placed by token;
    the stages exchange the packed shape) equals the single rank (fp32)."""
    from torch.testing import assert_close

    ref = pool4.run(_trainer_step, root, {})[0]
    pp = dict(
        pipeline_model_parallel_size=2, context_parallel_size=2, ulysses_size=2, ranks_per_node=4
    )
    per_rank = pool4.run(_trainer_step, root, pp, ranks_per_node=4)
    stages = set()
    for rank, got in enumerate(per_rank):
        assert got["placed"] == "PlacedBatchMaker", got["placed"]
        assert ref["placed"] == "FixedBatchMaker"
        # measured: loss within 1.0e-7 relative, gradients within 2.1e-6 of their largest entry
        if got["loss"] is not None:
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), rank
        stages.add(frozenset(got["grads"]))
        for name, g in got["grads"].items():
            scale = float(ref["grads"][name].abs().max()) + 1e-8
            assert_close(g, ref["grads"][name], rtol=0, atol=2e-5 * scale, msg=name)
    assert len(stages) == 2 and set().union(*stages) == set(ref["grads"])


class _RecordingSource:
    """A clip source that encodes only the latent frames asked for (as a raw source decodes and
    encodes only their halo windows) and records what each rank asked for."""

    def __init__(self, grid, text_dim: int, text_len: int):
        self.ids, self.grid, self.asked = ["a", "b", "c", "d"], grid, []
        self.full = {
            k: torch.randn(4, *grid, generator=torch.Generator().manual_seed(i))
            for i, k in enumerate(self.ids)
        }
        self.emb = (torch.zeros(text_len, text_dim), torch.ones(text_len, dtype=torch.bool))

    def latent_grid(self, key):
        return self.grid

    def text(self, key):
        return self.emb

    def caption(self, key):
        return key

    def encode(self, keys, ranges):
        self.asked += [(k, f) for k in keys for a, b in ranges for f in range(a, b)]
        out = torch.zeros(len(keys), 4, *self.grid)
        for a, b in ranges:
            out[:, :, a:b] = torch.stack([self.full[k][:, a:b] for k in keys])
        return out


def test_each_rank_reads_only_the_frames_of_its_tokens(tmp_path):
    """CP 4 (U2xR2) at 21 latent frames, 2 clips: each rank asks its source (raw video: decode
    and encode with the halo) only for the (clip, frame)s its placed tokens lie on -- at most
    32 / 3 + 2 frames for its 32 tokens, a frame cut between ranks read by both -- and its tokens
    equal the full clips' at their global ids."""
    from megatron_video.models.embedders import patchify
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.batches.placed import PlacedBatchMaker

    cfg = _config("wan", tmp_path, "u2xr2")
    counts = {}
    for rank in range(4):
        src = _RecordingSource((21, 2, 6), cfg.data.text_embed_dim, cfg.data.caption_len)
        coords = RankCoords(cp_rank=rank, ulysses_size=2, ring_size=2)
        lines = []
        maker = PlacedBatchMaker(cfg, coords, latent_scale=1.0, source=src, log=lines.append)
        mb = next(maker.step_batches(0))
        asked = list(src.asked)
        maker.step_batches(1)
        assert len(lines) == 1 and "placed by token" in lines[0], lines  # start-up, once
        assert "attention pairs max/mean" in lines[0] and "(2 padding)" in lines[0], lines
        real = mb.packed.clip_of(mb.local)
        thw = mb.packed.token_thw(mb.local)
        mine = {(mb.clip_ids[c], f) for c, f in zip(real.tolist(), thw[:, 0].tolist()) if c >= 0}
        assert set(asked) == mine and len(asked) == len(mine) <= 12, (rank, asked)
        full = mb.packed.pack([patchify(src.full[k][None], (1, 2, 2))[0] for k in mb.clip_ids])
        assert torch.equal(mb.x[0], full[mb.local]), rank
        for key in mine:
            counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 42 and sum(counts.values()) <= 42 + 4, counts  # 2 clips x 21 frames


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2), (2, 2)])
def test_ar_start_up_line_reports_the_imbalance(tmp_path, ulysses, ring):
    """``wan_ar`` at 7 blocks of 3 latent frames (2 clips): the start-up line says why the
    teacher-forcing clips are placed by token and reports the plan's attention balance, the one
    the planner's cost counts (``planner.cost.placement_overhead``)."""
    from megatron_video.planner.cost import Layout, placement_overhead
    from megatron_video.training.batches import RankCoords
    from megatron_video.training.batches.placed import PlacedBatchMaker
    from megatron_video.training.planning import model_shape

    layout = {(2, 1): "u2", (1, 2): "r2", (2, 2): "u2xr2"}[(ulysses, ring)]
    cfg = _config("wan_ar", tmp_path, layout)
    src = _RecordingSource((21, 2, 6), cfg.data.text_embed_dim, cfg.data.caption_len)
    coords = RankCoords(cp_rank=0, ulysses_size=ulysses, ring_size=ring)
    lines = []
    maker = PlacedBatchMaker(
        cfg, coords, "teacher_forcing", latent_scale=1.0, source=src, log=lines.append
    )
    mb = next(maker.step_batches(0))
    assert len(lines) == 1 and "21 token frames (blocks of latent frames)" in lines[0], lines
    balance = mb.plan.balance()
    assert f"attention pairs max/mean {balance:.3f}" in lines[0], lines
    lay = Layout(ulysses=ulysses, ring=ring, micro_batch_size=len(mb.clip_ids))
    pad, planned = placement_overhead(model_shape(cfg), lay)
    assert planned == pytest.approx(balance, abs=1e-12)
    assert pad == mb.packed.seq_len / (len(mb.clip_ids) * 2 * 21 * 3)
