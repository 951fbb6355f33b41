"""The three model families on 4 gloo ranks: one training step equals the single-rank step.

For each family (VideoDiT, ST-DiT, causal AR DiT with Balanced SP teacher forcing) the trainer's
forward-backward on a global batch of 4 samples runs

* as the reference: TP = PP = CP = 1, four data-parallel ranks, one sample each (every sample's
  forward and backward on a single rank; DDP only averages the four);
* with CP = 4 as U x R = 2 x 2 (2 simulated nodes x 2), 4 micro-batches and activation
  recomputation;
* with TP = 2 x CP = 2 (TP inside a node, the CP ring across nodes) and 4 micro-batches;

with the same injected noise / timesteps / CFG drops (drawn per sample). Compared: the loss, every
parameter's gradient after Megatron's gradient reduction (TP shards gathered), the initial
weights (every layout starts from the same full weights), and a context-parallel sample
(guided Heun / Euler / block-autoregressive sampling from the same noise).

PP = 2 x CP = 2: the same step with the reference weights loaded per stage; the replicated
conditioning embedders have identical gradients on both stages, equal to the reference.
"""

import zlib

import pytest
import torch
from torch.testing import assert_close

from megatron_video.testing.configs import tiny_config
from megatron_video.training.families import family_names, get_family

# the video-generation families (VAE latents, diffusion objectives, CP sampling); the
# vision-language family video_llava has its own exactness tests (tests/test_mmsp.py)
FAMILIES = tuple(f for f in family_names() if get_family(f).needs_vae)


CASES = {
    "reference": dict(),
    # activation recomputation on: it re-runs the layers' collectives in backward
    "cp4_u2xr2": dict(
        context_parallel_size=4, ulysses_size=2, ring_size=2, ranks_per_node=2, recompute=True
    ),
    "tp2_cp2": dict(
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        ulysses_size=1,
        ring_size=2,
        ranks_per_node=2,
    ),
    # data x context parallel through Megatron's DDP: 2 data-parallel replicas of CP = 2
    "dp2_cp2": dict(context_parallel_size=2, ulysses_size=2, ring_size=1, ranks_per_node=2),
    # the other placement: ring groups inside the all-to-all stride (one node of 4)
    "cp4_ring_inner": dict(
        context_parallel_size=4,
        ulysses_size=2,
        ring_size=2,
        ranks_per_node=4,
        placement="ring_inner",
        ring_balance=False,
    ),
}


# ---------------------------------------------------------------------------------------------
# rank side
# ---------------------------------------------------------------------------------------------
def _global_name(trainer, name: str) -> str:
    """Parameter name with the pipeline stage's local layer index replaced by the global one."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = trainer.model.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
    return ".".join(parts)


def _full(trainer, what: str) -> dict:
    """``{global name: full tensor}`` of parameters or reduced gradients (TP shards gathered)."""
    from megatron.core import parallel_state as ps

    from megatron_video.parallel import comm

    out = {}
    for name, p in trainer.model.named_parameters():
        t = (p.main_grad if what == "grad" else p).detach().clone().float()
        if (
            getattr(p, "tensor_model_parallel", False)
            and ps.get_tensor_model_parallel_world_size() > 1
        ):
            t = comm.all_gather_cat(t, ps.get_tensor_model_parallel_group(), dim=p.partition_dim)
        out[_global_name(trainer, name)] = t
    return out


def _load_full(trainer, full: dict) -> None:
    """Copy full weights into this rank's parameters (its TP shard, its pipeline stage's layers)."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            value = full[_global_name(trainer, name)]
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                value = value.chunk(tp, dim=p.partition_dim)[rank]
            p.copy_(value)


def _perturbed(full: dict) -> dict:
    """Deterministic random weights: AdaLN-zero / zero-initialised outputs would leave most
    gradients exactly zero at initialisation, which would test nothing."""
    out = {}
    for name, value in sorted(full.items()):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = value + 0.2 * torch.randn(value.shape, generator=g)
    return out


def _run_cases(family: str, tmp: str, cases: dict) -> dict:
    """Per case: initial weights, then the step's loss and gradients at the common perturbed
    weights (each layout derives them from its own initial weights, checked equal)."""
    import warnings

    from megatron_video.training import generate
    from megatron_video.training.trainer import Trainer

    warnings.filterwarnings("ignore")
    out, ref_init = {}, None
    for label, parallel in cases.items():
        trainer = Trainer(tiny_config(family, tmp, **parallel), progress=False)
        try:
            init = _full(trainer, "param")
            if ref_init is None:
                ref_init = init
            # pipeline stages build different layer subsets from the RNG stream: use the reference's
            _load_full(
                trainer,
                _perturbed(ref_init if trainer.tcfg.pipeline_model_parallel_size > 1 else init),
            )
            loss = trainer.forward_backward(0)
            sample = (
                generate.sample_tokens(trainer, 1)
                if trainer.tcfg.pipeline_model_parallel_size == 1
                else None
            )
            out[label] = dict(
                loss=loss,
                params=init,
                grads=_full(trainer, "grad"),
                sample=sample,
                stage=int(trainer.first_stage) + 2 * int(trainer.last_stage),
                cp_rank=trainer.cp_rank,
            )
        finally:
            trainer.close()
    return out


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    """The tiny VAE of ``tiny_config``, trained once here so the ranks only load it."""
    from megatron_video.training.vae_stage import ensure_vae

    tmp = str(tmp_path_factory.mktemp("models_parallel"))
    ensure_vae(tiny_config("ar_dit", tmp), progress=False)
    return tmp


# The per-head QK-norm weights (head_dim = 12 elements) sum their gradient over every token, head
# and micro-batch: in fp32 a layout that sums in another order lands up to ~6e-5 of the tensor's
# largest element off on its near-zero elements (measured after the one data path changed the
# clips a step draws); every other parameter keeps 2e-5.
_NORM_ATOL = 2e-4


def _check_close(got: dict, ref: dict, what: str, label: str):
    assert set(got) == set(ref), (label, sorted(set(got) ^ set(ref)))
    for name, value in ref.items():
        scale = float(value.abs().max()) + 1e-8
        norm = what == "gradient" and "_layernorm." in name
        assert_close(
            got[name],
            value,
            rtol=2e-4,
            atol=(_NORM_ATOL if norm else 2e-5) * scale,
            msg=lambda m: f"{label} {what} {name}: {m}",
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_step_matches_single_rank(pool4, vae_dir, family):
    per_rank = pool4.run(_run_cases, family, vae_dir, CASES)
    ref = per_rank[0]["reference"]
    assert ref["loss"] is not None and ref["loss"] > 0
    nonzero = [n for n, g in ref["grads"].items() if float(g.abs().max()) > 0]
    assert len(nonzero) > 0.9 * len(ref["grads"]), "most parameters must receive a gradient"
    for rank, res in enumerate(per_rank):
        assert res["reference"]["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        for label in ("cp4_u2xr2", "tp2_cp2", "dp2_cp2", "cp4_ring_inner"):
            got = res[label]
            # measured on the three families, four layouts, every rank: loss within 1.0e-7
            # relative, initial weights bit-equal, sample within 6.7e-6 (|sample| <= 6.5)
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), (family, label, rank)
            assert set(got["params"]) == set(ref["params"]), (family, label)
            for name, value in ref["params"].items():
                assert torch.equal(got["params"][name], value), (family, label, rank, name)
            _check_close(got["grads"], ref["grads"], "gradient", f"{family}/{label}/rank{rank}")
            # context-parallel sampling (partition, denoise in parallel, gather) == one rank
            assert_close(
                got["sample"],
                ref["sample"],
                rtol=0,
                atol=5e-5,
                msg=lambda m: f"{family}/{label} sample: {m}",
            )
    assert sorted(r["cp4_u2xr2"]["cp_rank"] for r in per_rank) == [0, 1, 2, 3]
    assert sorted(r["dp2_cp2"]["cp_rank"] for r in per_rank) == [0, 0, 1, 1]
    assert sorted(r["cp4_ring_inner"]["cp_rank"] for r in per_rank) == [0, 1, 2, 3]


@pytest.mark.parametrize("family", ["video_dit", "ar_dit"])
def test_pipeline_parallel_embedders(pool4, vae_dir, family):
    cases = {
        "reference": {},
        "pp2_cp2": dict(
            pipeline_model_parallel_size=2,
            context_parallel_size=2,
            ulysses_size=2,
            ring_size=1,
            ranks_per_node=4,
        ),
    }
    per_rank = pool4.run(_run_cases, family, vae_dir, cases)
    ref = per_rank[0]["reference"]
    embedder_grads = {}
    for rank, res in enumerate(per_rank):
        got = res["pp2_cp2"]
        first, last = bool(got["stage"] & 1), bool(got["stage"] & 2)
        assert first != last, "PP = 2: every rank is exactly one of the two stages"
        if last:
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        else:
            assert got["loss"] is None
        # every parameter this stage holds: the single-rank gradient (initial weights differ by
        # stage, so the common weights are the reference's)
        _check_close(
            got["grads"],
            {n: ref["grads"][n] for n in got["grads"]},
            "gradient",
            f"{family}/pp2/rank{rank}",
        )
        emb = {
            n: g for n, g in got["grads"].items() if n.startswith(("t_embedder.", "text_embedder."))
        }
        assert emb and all(float(g.abs().max()) > 0 for n, g in emb.items() if "t_embedder" in n)
        embedder_grads.setdefault("first" if first else "last", []).append(emb)
    # identical (not merely close) replicated-embedder gradients on the two stages
    for a in embedder_grads["first"]:
        for b in embedder_grads["last"]:
            assert a.keys() == b.keys()
            for n in a:
                assert torch.equal(a[n], b[n]), n
