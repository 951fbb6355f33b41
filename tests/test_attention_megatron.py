"""The Megatron drop-in: spec surgery, the adapter's checks and layout, apply_query_key_layer_scaling
and the inputs refused under CP. A whole stock Megatron job with the spec: test_megatron_stock_job.py."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_video.attention.megatron import DistAttention2D
from megatron_video.models import specs
from megatron_video.testing.oracles import softmax_attention
from megatron_video.testing.parallel import model_parallel


# ------------------------------------------------------------------------------------------
# Spec surgery (no processes)
# ------------------------------------------------------------------------------------------
def _core_attentions(obj, path=""):
    """(path, core_attention spec) pairs anywhere below obj."""
    if isinstance(obj, ModuleSpec):
        return _core_attentions(obj.submodules, path)
    if isinstance(obj, (list, tuple)):
        return [x for i, o in enumerate(obj) for x in _core_attentions(o, f"{path}[{i}]")]
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return []
    out = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name == "core_attention":
            out.append((f"{path}.{f.name}", v))
        else:
            out.extend(_core_attentions(v, f"{path}.{f.name}"))
    return out


def test_with_2d_attention_swaps_local_te_and_block_specs():
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    local = get_gpt_layer_local_spec()
    swapped = specs.with_2d_attention(local, scheme="contiguous")
    ((path, core),) = _core_attentions(swapped)
    assert core.module is DistAttention2D and core.params == {"scheme": "contiguous"}
    # the original spec is untouched and everything else is shared structure
    assert _core_attentions(local)[0][1] is not DistAttention2D
    sub = lambda spec: spec.submodules.self_attention.submodules  # noqa: E731
    assert sub(swapped).linear_qkv == sub(local).linear_qkv
    # a TE-style spec (module given by import path, not imported here) and a block of such layers
    te_like = ModuleSpec(
        module=("megatron.core.transformer.attention", "SelfAttention"),
        submodules=SelfAttentionSubmodules(
            linear_qkv=("transformer_engine.pytorch", "LayerNormLinear"),
            core_attention=ModuleSpec(
                module=("megatron.core.extensions.transformer_engine", "TEDotProductAttention")
            ),
            linear_proj=("transformer_engine.pytorch", "Linear"),
        ),
    )
    block = TransformerBlockSubmodules(layer_specs=[local, te_like])
    got = specs.with_2d_attention(block)
    assert [c.module for _, c in _core_attentions(got)] == [DistAttention2D, DistAttention2D]
    assert sub(specs.gpt_layer_local_2d_spec).core_attention.module is DistAttention2D
    assert sub(specs.gpt_layer_local_2d_qknorm_spec).core_attention.module is DistAttention2D
    with pytest.raises(ValueError, match="no self-attention core_attention"):
        specs.with_2d_attention(ModuleSpec(module=torch.nn.Linear))


class _Cfg:  # the TransformerConfig fields the adapter reads
    attention_dropout, softmax_type, window_size = 0.0, "vanilla", None
    kv_channels, apply_query_key_layer_scaling, context_parallel_size = 16, False, 1


@pytest.mark.parametrize(
    "change,kwargs,frag",
    [
        (dict(attention_dropout=0.1), {}, "attention_dropout (0.1) must be 0"),
        ({}, dict(attention_dropout=0.2), "attention_dropout (0.2) must be 0"),
        (dict(softmax_type="off-by-one"), {}, "softmax_type ('off-by-one')"),
        (dict(window_size=(8, 0)), {}, "window_size ((8, 0)) is not supported"),
        ({}, dict(attention_type="cross"), "attention_type ('cross') must be 'self'"),
        ({}, dict(mask="causal"), "mask ('causal') must be None or a megatron_video AttentionMask"),
    ],
)
def test_adapter_rejects_unsupported_config(change, kwargs, frag):
    from megatron.core.transformer.enums import AttnMaskType

    cfg = _Cfg()
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError) as e:
        DistAttention2D(cfg, 1, AttnMaskType.causal, **{"attention_type": "self", **kwargs})
    assert frag in str(e.value)


def test_adapter_single_process_matches_megatron_layout():
    """CP = 1 without groups: [s, b, h, d] in, [s, b, h*d] out, equal to explicit float64 causal
    attention (GQA, custom softmax scale), and THD packed documents likewise."""
    from megatron.core.transformer.enums import AttnMaskType

    m = DistAttention2D(_Cfg(), 3, AttnMaskType.causal, "self", softmax_scale=0.2)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4, 16, generator=g)
    k, v = torch.randn(6, 2, 2, 16, generator=g), torch.randn(6, 2, 2, 16, generator=g)
    out = m(q, k, v, None)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert out.shape == (6, 2, 64)
    for b in range(2):
        ref = softmax_attention(q[None, :, b], k[None, :, b], v[None, :, b], causal, 0.2)[0]
        torch.testing.assert_close(out[:, b].double(), ref.reshape(6, 64), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention_bias .* is not supported"):
        m(q, k, v, None, attention_bias=torch.zeros(1))
    # packed THD input: [t, h, d], documents from cu_seqlens, causal inside each
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out = m(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=thd)
    doc = torch.tensor([0, 0, 1, 1, 1, 1])
    allow = (doc[:, None] == doc[None, :]) & causal
    ref = softmax_attention(q[None, :, 0], k[None, :, 0], v[None, :, 0], allow, 0.2)[0]
    assert out.shape == (6, 64)
    torch.testing.assert_close(out.double(), ref.reshape(6, 64), rtol=1e-5, atol=1e-5)


def test_apply_query_key_layer_scaling_is_exact_like_megatron():
    """Megatron divides the scores by layer_number and multiplies it back in its softmax: with the
    flag on, our adapter equals plain 1/sqrt(d) attention (float64 oracle), and so does Megatron's
    own softmax given the divided scores."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from megatron_video.compat import ensure_cpu_mode

    ensure_cpu_mode()
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=0.0,
        apply_query_key_layer_scaling=True,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    g = torch.Generator().manual_seed(1)
    q = torch.randn(8, 2, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(8, 2, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(8, 2, 2, 16, generator=g, requires_grad=True)
    allow = torch.ones(8, 8, dtype=torch.bool).tril()
    ref = softmax_attention(q, k, v, allow, 16**-0.5, layout="sbhd")
    ours = DistAttention2D(cfg, 3, AttnMaskType.causal, "self")
    out = ours(q, k, v, None)
    assert (out.double() - ref).abs().max() < 1e-5
    # Megatron's own softmax (what DotProductAttention runs) multiplies the 1/layer_number back
    softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=3,
    )
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k.double().repeat_interleave(2, 2))
    probs = softmax(scores * (16**-0.5 / 3), None)
    assert torch.allclose(
        probs, torch.softmax((scores * 16**-0.5).masked_fill(~allow, float("-inf")), -1)
    )
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        assert (a.double() - b).abs().max() < 1e-5


def test_adapter_cp_only_inputs_raise_clear_errors():
    """Dense attention_bias, packed thd under CP, padding masks and all_gather are refused with
    the parameter, its value and the rule in the message."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_video.parallel import VideoParallelGroups

    m = DistAttention2D(_Cfg(), 1, AttnMaskType.causal, "self")
    q = torch.randn(4, 1, 2, 16)
    with pytest.raises(
        ValueError, match=r"attention_bias \(Tensor \(1, 2, 4, 4\)\) is not supported"
    ):
        m(q, q, q, None, attention_bias=torch.zeros(1, 2, 4, 4))
    pad = DistAttention2D(_Cfg(), 1, AttnMaskType.padding, "self")
    with pytest.raises(ValueError, match="attn_mask_type .* needs a dense attention_mask"):
        pad(q, q, q, torch.zeros(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"cp_comm_type \('all_gather'\) is not supported"):
        DistAttention2D(_Cfg(), 1, AttnMaskType.causal, "self", cp_comm_type="all_gather")
    with pytest.raises(ValueError, match=r"cp_comm_type \('ring'\) must be one of"):
        DistAttention2D(_Cfg(), 1, AttnMaskType.causal, "self", cp_comm_type="ring")
    with pytest.raises(ValueError, match=r"scheme \('striped'\) must be one of"):
        DistAttention2D(_Cfg(), 1, AttnMaskType.causal, "self", scheme="striped")
    # thd under CP = 2 (explicit groups of a 2-rank CP group; the check runs before any collective)
    cfg = _Cfg()
    cfg.context_parallel_size = 2
    fake = VideoParallelGroups(
        cp_group=None,
        ulysses_group=None,
        ring_group=None,
        tp_group=None,
        dp_group=None,
        dp_cp_group=None,
        cp_ranks=[0, 1],
        ulysses_ranks=[0],
        ring_ranks=[0, 1],
        ulysses_size=1,
        ring_size=2,
        cp_rank=0,
        ulysses_rank=0,
        ring_rank=0,
    )
    m2 = DistAttention2D(cfg, 1, AttnMaskType.causal, "self", groups=fake)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(
        ValueError, match=r"packed_seq_params \(qkv_format 'thd', context_parallel_size 2\)"
    ):
        m2(q[:, 0], q[:, 0], q[:, 0], None, packed_seq_params=thd)
    # config and Megatron's CP group disagree: named, before any collective
    with pytest.raises(ValueError, match=r"config.context_parallel_size \(2\) must equal"):
        DistAttention2D(cfg, 1, AttnMaskType.causal, "self")(q, q, q, None)


# ------------------------------------------------------------------------------------------
# GPTModel: TP=2 x CP=2 / CP=4 (2D attention) == TP=2 x CP=1 (Megatron's DotProductAttention)
# ------------------------------------------------------------------------------------------
B, S, VOCAB, STEPS = 2, 16, 64, 2


def _gpt_run(cp, ulysses_size, spec_name):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_video.compat.megatron_api import cpu_transformer_config_kwargs
    from megatron_video.layouts import global_token_ids, shard_sequence
    from megatron_video.parallel import all_reduce, init_video_parallel

    with model_parallel(tp=2, cp=cp):
        groups = (
            init_video_parallel(ulysses_size, ranks_per_node=dist.get_world_size())
            if cp > 1
            else None
        )
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
            tensor_model_parallel_size=2,
            context_parallel_size=cp,
            **cpu_transformer_config_kwargs(),
        )
        spec = getattr(specs, spec_name) if spec_name else get_gpt_layer_local_spec()
        model = GPTModel(
            config,
            spec,
            vocab_size=VOCAB,
            max_sequence_length=S,
            position_embedding_type="learned_absolute",
        )
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, VOCAB, (B, S + 1), generator=g)
        inputs, labels, pos = tokens[:, :-1], tokens[:, 1:], torch.arange(S)[None].expand(B, S)
        if groups is not None:  # Megatron's zigzag CP layout (get_batch_on_this_cp_rank)
            inputs, labels, pos = (
                shard_sequence(x, groups, dim=1, scheme="zigzag") for x in (inputs, labels, pos)
            )
            assert torch.equal(pos[0], global_token_ids(groups, S, "zigzag"))
        # Megatron's DDP reduces the gradients over the data x context parallel group (averaging);
        # the loss is scaled by the CP size as Megatron's schedule does, so the average is the sum
        # over CP ranks of gradients of a loss normalised by the GLOBAL token count.
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            per_token = ddp(inputs, pos, None, labels=labels)
            loss = per_token.sum() / (B * S)  # normalised by the GLOBAL token count
            (loss * cp).backward()
            ddp.finish_grad_sync()
            total = loss.detach().clone()
            if groups is not None:
                all_reduce(total, groups.cp_group)
            losses.append(float(total))
            grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
            for p in model.parameters():
                p.grad = p.main_grad.clone()
            opt.step()
        return ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_world_size(), losses, grads


def _gpt_cases():
    return {
        name: _gpt_run(*args)
        for name, args in {
            "reference": (1, 1, None),
            "ulysses_u2": (2, 2, "gpt_layer_local_2d_spec"),
            "ring_r2": (2, 1, "gpt_layer_local_2d_spec"),
            "2d_u2_r2": (4, 2, "gpt_layer_local_2d_spec"),
        }.items()
    }


def test_megatron_gpt_tp2_cp2_and_cp4_match_cp1(pool8):
    """Megatron's GPTModel with with_2d_attention trains on CPU at TP=2 x CP=2 x DP=2 (pure Ulysses,
    pure ring) and TP=2 x CP=4 (2x2) exactly like its own local spec at TP=2 x CP=1 x DP=4, with
    gradients reduced by Megatron's DDP (no hand-written reduction)."""
    per_rank = pool8.run(_gpt_cases)
    for rank, res in enumerate(per_rank):
        tp_rank, dp_ref, ref_losses, ref_grads = res["reference"]
        assert dp_ref == 4 and ref_losses[1] < ref_losses[0]  # it trains
        for name, dp_want in (("ulysses_u2", 2), ("ring_r2", 2), ("2d_u2_r2", 1)):
            tp2, dp, losses, grads = res[name]
            assert tp2 == tp_rank and dp == dp_want
            err = max(abs(a - b) for a, b in zip(losses, ref_losses))
            assert err < 1e-5, (rank, name, losses, ref_losses)
            assert grads.keys() == ref_grads.keys()
            for n, g in grads.items():
                err = float(
                    (g - ref_grads[n]).abs().max() / max(1e-3, float(ref_grads[n].abs().max()))
                )
                assert err < 1e-4, (rank, name, n, err)
