"""The Megatron drop-in without processes: spec surgery and the adapter's input checks.

The GPTModel check (TP=2 x CP=2 and CP=4 train exactly like CP=1) is multi-rank and lives in
``test_attention_dist.py`` so that it shares that module's worker pool."""
import dataclasses

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_video.attention.megatron import DistAttention2D
from megatron_video.models import specs


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
    (path, core), = _core_attentions(swapped)
    assert core.module is DistAttention2D and core.params == {"scheme": "contiguous"}
    # the original spec is untouched and everything else is shared structure
    assert _core_attentions(local)[0][1] is not DistAttention2D
    sub = lambda spec: spec.submodules.self_attention.submodules  # noqa: E731
    assert sub(swapped).linear_qkv == sub(local).linear_qkv
    # a TE-style spec (module given by import path, not imported here) and a block of such layers
    te_like = ModuleSpec(module=("megatron.core.transformer.attention", "SelfAttention"),
                         submodules=SelfAttentionSubmodules(
                             linear_qkv=("transformer_engine.pytorch", "LayerNormLinear"),
                             core_attention=ModuleSpec(module=("megatron.core.extensions.transformer_engine",
                                                               "TEDotProductAttention"))))
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


@pytest.mark.parametrize("change,kwargs,frag", [
    (dict(attention_dropout=0.1), {}, "attention_dropout (0.1) must be 0"),
    ({}, dict(attention_dropout=0.2), "attention_dropout (0.2) must be 0"),
    (dict(softmax_type="off-by-one"), {}, "softmax_type ('off-by-one')"),
    (dict(window_size=(8, 0)), {}, "window_size ((8, 0)) is not supported"),
    ({}, dict(attention_type="cross"), "attention_type ('cross') must be 'self'"),
    ({}, dict(mask="causal"), "mask ('causal') must be None or a megatron_video AttentionMask"),
])
def test_adapter_rejects_unsupported_config(change, kwargs, frag):
    from megatron.core.transformer.enums import AttnMaskType

    cfg = _Cfg()
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError) as e:
        DistAttention2D(cfg, 1, AttnMaskType.causal, **{"attention_type": "self", **kwargs})
    assert frag in str(e.value)


def test_adapter_single_process_matches_megatron_layout():
    """CP = 1 without groups: [s, b, h, d] in, [s, b, h*d] out, equal to local causal attention."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_video.attention import local_attention

    m = DistAttention2D(_Cfg(), 3, AttnMaskType.causal, "self", softmax_scale=0.2)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4, 16, generator=g)
    k, v = torch.randn(6, 2, 2, 16, generator=g), torch.randn(6, 2, 2, 16, generator=g)
    out = m(q, k, v, None)
    ref, _ = local_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                             torch.ones(6, 6, dtype=torch.bool).tril(), 0.2)
    assert out.shape == (6, 2, 64)
    assert torch.allclose(out, ref.transpose(0, 1).reshape(6, 2, 64), atol=1e-6)
    with pytest.raises(ValueError, match="attention_bias is not supported"):
        m(q, k, v, None, attention_bias=torch.zeros(1))
