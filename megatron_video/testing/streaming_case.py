"""Tiny AR models and conditions of tests/test_generation.py, shared with tests/test_streaming_longlive.py."""

from __future__ import annotations

import zlib

import torch

TOL = 1e-10


B, C_IN, L = 1, 4, 5  # batch, latent channels (ar_dit patch 1), caption length


STEPS = 2


def _perturb(model):
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = list(p.shape)
            sharded = getattr(p, "tensor_model_parallel", False)
            if sharded:
                shape[p.partition_dim] *= tp
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
            full += 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(full.chunk(tp, dim=p.partition_dim)[r] if sharded else full)


def _tiny_wan_ar(tp, cp):
    from megatron_video.models.wan import WanModel, get_wan_layer_spec
    from megatron_video.models.wan.interop import wan_config
    from megatron_video.testing.wan import TINY_WAN

    cfg = wan_config({**TINY_WAN, "patch_size": (1, 1, 1)}, params_dtype=torch.float64)
    return WanModel(cfg, layer_spec=get_wan_layer_spec(cfg)).double()


def _tiny_ar_dit(tp, cp):
    from megatron_video.models.ar_dit import ARVideoDiT
    from megatron_video.models.video_dit import VideoDiTConfig

    cfg = VideoDiTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=64,
        lora_rank=4,
        in_channels=C_IN,
        patch_size=(1, 1, 1),
        text_max_len=L,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        qk_layernorm=True,
        add_bias_linear=True,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
    )
    return ARVideoDiT(cfg).double()


def _wan_ar_conds(g):
    text = torch.randn(B, L, 32, generator=g, dtype=torch.float64)
    return (text,), (torch.zeros_like(text),)


def _ar_dit_conds(g):
    ids = torch.randint(1, 8, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    return (ids, mask, torch.zeros(B, dtype=torch.bool)), (
        ids,
        mask,
        torch.ones(B, dtype=torch.bool),
    )


# the tiny float64 model and the (cond, null) conditions of each AR family the tests stream
_TINY = {"wan_ar": (_tiny_wan_ar, _wan_ar_conds), "ar_dit": (_tiny_ar_dit, _ar_dit_conds)}


def _build(family, tp=1, cp=1):
    torch.manual_seed(0)
    model = _TINY[family][0](tp, cp)
    _perturb(model)
    return model.eval()


def _conds(family, seed=0):
    """(cond, null) of the family for prompt ``seed``."""
    return _TINY[family][1](torch.Generator().manual_seed(100 + seed))


def _err(a, b):
    return float((a - b).abs().max())
