"""A stock Megatron job with the 2D-attention spec: parallel state set by Megatron alone, GPTModel
with RoPE and a causal mask, tokens cut like Megatron-LM's ``get_batch_on_this_cp_rank``, and no
call into megatron_video besides the spec (and ``ensure_cpu_mode()``, because this is a CPU).

Acceptance for U2xR2 (``a2a+p2p``), U4xR1 (``a2a``), U1xR4 (``p2p``) and TP2xCP2: loss and every
gradient equal the CP=1 run of Megatron's own local spec (``DotProductAttention``, explicit softmax)
at the same TP. The CP=1 reference is itself held to a float64 oracle in test_attention_megatron.py.
"""

import os

import pytest
import torch
import torch.distributed as dist

B, S, VOCAB, STEPS = 2, 16, 64, 2

# name -> (tensor_model_parallel_size, context_parallel_size, hierarchical sizes, cp_comm_type)
CASES = {
    "u2xr2": (1, 4, [2, 2], "a2a+p2p"),
    "u4xr1": (1, 4, None, "a2a"),
    "u1xr4": (1, 4, None, "p2p"),
    "tp2xcp2": (2, 2, None, "a2a"),
}
EXPECTED_UR = {
    "u2xr2": (2, 2, "ulysses_inner"),
    "u4xr1": (4, 1, "ulysses_inner"),
    "u1xr4": (1, 4, "ulysses_inner"),
    "tp2xcp2": (2, 1, "ulysses_inner"),
    "explicit_ring_inner": (2, 2, "ring_inner"),
}


def _cut_like_megatron_lm(x, cp_size, cp_rank):
    """Megatron-LM's get_batch_on_this_cp_rank, written out: 2*CP chunks, keep r and 2CP-1-r."""
    b, s = x.shape[:2]
    x = x.view(b, 2 * cp_size, s // (2 * cp_size), *x.shape[2:])
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1])
    return x.index_select(1, index).reshape(b, -1, *x.shape[3:])


def _job(tp, cp, hier, comm, use_2d=True, explicit_groups=None):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_video.compat import destroy_model_parallel, ensure_cpu_mode
    from megatron_video.models.specs import with_2d_attention

    ensure_cpu_mode()
    kw = dict(tensor_model_parallel_size=tp, context_parallel_size=cp)
    if hier is not None:
        kw["hierarchical_context_parallel_sizes"] = hier
    ps.initialize_model_parallel(**kw)
    try:
        model_parallel_cuda_manual_seed(123)
        torch.manual_seed(123)
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=64,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            cp_comm_type=comm,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
        )
        spec = get_gpt_layer_local_spec()
        if use_2d:
            params = {} if explicit_groups is None else {"groups": explicit_groups()}
            spec = with_2d_attention(spec, **params)
        model = GPTModel(
            config, spec, vocab_size=VOCAB, max_sequence_length=S, position_embedding_type="rope"
        )
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, VOCAB, (B, S + 1), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(S)[None].expand(B, S)
        cp_group, cp_rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
        if cp > 1:
            inputs, labels, pos = (
                _cut_like_megatron_lm(x, cp, cp_rank) for x in (inputs, labels, pos)
            )
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            per_token = model(inputs, pos, None, labels=labels)
            loss = per_token.sum() / (B * S)  # normalised by the global token count
            loss.backward()
            total = loss.detach().clone()
            if cp > 1:  # what Megatron's DDP does over the dp x cp group
                dist.all_reduce(total, group=cp_group)
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=cp_group)
            losses.append(float(total))
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
        core = model.decoder.layers[0].self_attention.core_attention
        if use_2d:  # the U x R the adapter derived from Megatron's groups
            vg = core.video_groups()
            losses.append((vg.ulysses_size, vg.ring_size, vg.placement) if vg else (1, 1, None))
        return ps.get_tensor_model_parallel_rank(), losses, grads
    finally:
        destroy_model_parallel()


def _explicit_ring_inner():
    from megatron_video.parallel import init_video_parallel

    return init_video_parallel(2, 2, placement="ring_inner", ranks_per_node=dist.get_world_size())


def _references():
    return {
        "ref_tp1": _job(1, 1, None, None, use_2d=False),
        "ref_tp2": _job(2, 1, None, None, use_2d=False),
    }


def _case(name):
    if name == "explicit_ring_inner":
        # explicit control still works: groups from init_video_parallel, placement ring_inner
        return _job(1, 4, None, None, explicit_groups=_explicit_ring_inner)
    return _job(*CASES[name])


@pytest.fixture(scope="module")
def references(pool8):
    """Per rank: the CP = 1 runs of Megatron's own local spec at TP 1 and TP 2."""
    return pool8.run(_references)


@pytest.mark.parametrize("name", list(CASES) + ["explicit_ring_inner"])
def test_stock_megatron_job_with_2d_spec_matches_cp1(pool8, references, name):
    per_rank = pool8.run(_case, name)
    for rank, (refs, got) in enumerate(zip(references, per_rank)):
        tp = CASES.get(name, (1,))[0]
        tp_rank, ref_losses, ref_grads = refs[f"ref_tp{tp}"]
        assert ref_losses[1] < ref_losses[0]  # it trains
        got_tp_rank, losses, grads = got
        assert got_tp_rank == tp_rank
        assert losses.pop() == EXPECTED_UR[name], (name, losses)
        err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        assert err < 1e-5, (rank, name, losses, ref_losses)
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():
            rel = float((g - ref_grads[n]).abs().max() / max(1e-3, float(ref_grads[n].abs().max())))
            assert rel < 1e-4, (rank, name, n, rel)


def _bad_setups():
    """Each wrong setting raises ValueError on every rank (no rank goes on into a collective)."""
    out = {}
    for name, (args, env) in {
        # the Ulysses (all-to-all) group must lie in one node: 4 ranks over 2-rank nodes
        "a2a_spans_nodes": ((1, 4, None, "a2a"), "2"),
        # a2a+p2p without hierarchical groups from Megatron
        "a2a_p2p_without_hcp": ((1, 4, None, "a2a+p2p"), None),
        "all_gather": ((1, 4, None, "all_gather"), None),
    }.items():
        old = os.environ.get("LOCAL_WORLD_SIZE")
        if env is not None:
            os.environ["LOCAL_WORLD_SIZE"] = env
        try:
            _job(*args)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
        finally:
            if old is not None:
                os.environ["LOCAL_WORLD_SIZE"] = old
    return out


def test_stock_job_bad_cp_settings_raise_on_every_rank(pool8):
    for res in pool8.run(_bad_setups):
        assert (
            "the all-to-all group" in res["a2a_spans_nodes"]
            and "spans nodes" in res["a2a_spans_nodes"]
        )
        assert "cp_comm_type ('a2a+p2p') needs two levels" in res["a2a_p2p_without_hcp"]
        assert "cp_comm_type ('all_gather') is not supported" in res["all_gather"]


def _adapter_with_pg_collection():
    """The adapter takes its groups from the pg_collection it is given (here: hierarchical groups
    that Megatron's parallel state does not have), checked against a float64 oracle."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_video.attention.megatron import DistAttention2D
    from megatron_video.compat import destroy_model_parallel, ensure_cpu_mode

    ensure_cpu_mode()
    ps.initialize_model_parallel(context_parallel_size=4)  # no hierarchical groups in Megatron
    me, owned = dist.get_rank(), []
    try:
        cp_ranks = dist.get_process_group_ranks(ps.get_context_parallel_group())
        ug = rg = None
        for base in (0, 4):  # every rank creates every group, in the same order
            for ranks in (
                [base, base + 1],
                [base + 2, base + 3],
                [base, base + 2],
                [base + 1, base + 3],
            ):
                g = dist.new_group(ranks)
                owned.append(g)
                if me in ranks:
                    if ranks[1] - ranks[0] == 1:
                        ug = g
                    else:
                        rg = g
        pgc = ProcessGroupCollection(
            cp=ps.get_context_parallel_group(),
            tp=ps.get_tensor_model_parallel_group(),
            hcp=[ug, rg],
        )
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            context_parallel_size=4,
            attention_dropout=0.0,
            use_cpu_initialization=True,
        )
        core = DistAttention2D(
            cfg, 1, AttnMaskType.causal, "self", cp_comm_type="a2a+p2p", pg_collection=pgc
        )
        g = torch.Generator().manual_seed(3)
        S, b = 16, 2
        q = torch.randn(S, b, 4, 8, generator=g, dtype=torch.float64)
        k = torch.randn(S, b, 2, 8, generator=g, dtype=torch.float64)
        v = torch.randn(S, b, 2, 8, generator=g, dtype=torch.float64)
        w = torch.randn(S, b, 32, generator=g, dtype=torch.float64)
        cp_rank = cp_ranks.index(me)
        cut = lambda x: _cut_like_megatron_lm(x.transpose(0, 1), 4, cp_rank).transpose(0, 1)  # noqa: E731
        lq, lk, lv = (cut(x).clone().requires_grad_() for x in (q, k, v))
        out = core(lq, lk, lv, None)
        (out * cut(w)).sum().backward()
        # oracle: explicit causal softmax on the whole sequence (float64, one process)
        fq, fk, fv = (x.clone().requires_grad_() for x in (q, k, v))
        scores = torch.einsum("sbhd,tbhd->bhst", fq, fk.repeat_interleave(2, 2)) * 8**-0.5
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
        ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), fv.repeat_interleave(2, 2))
        ref = ref.reshape(S, b, 32)
        (ref * w).sum().backward()
        errs = [float((out - cut(ref)).abs().max())]
        errs += [
            float((a.grad - cut(f.grad)).abs().max()) for a, f in ((lq, fq), (lk, fk), (lv, fv))
        ]
        vg = core.video_groups()
        return (vg.ulysses_size, vg.ring_size, vg.ulysses_group is ug, vg.ring_group is rg), errs
    finally:
        for grp in owned:
            dist.destroy_process_group(grp)
        destroy_model_parallel()


def test_adapter_uses_the_given_pg_collection(pool8):
    for sizes, errs in pool8.run(_adapter_with_pg_collection):
        assert sizes == (2, 2, True, True)
        assert max(errs) < 1e-10, errs
