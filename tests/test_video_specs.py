"""The video-DiT layer specs as ModuleSpec trees: Megatron ``TransformerLayer`` subclasses with
declared submodules (norms, self-attention with a ``core_attention`` slot, cross-attention without
CP, MLP, AdaLN-LoRA modulation), local and TE variants, and ``with_2d_attention`` on them.

No process group is needed: specs are plain data. The TE variant is only constructed as a tree
(TransformerEngine is not installed here); building modules from it is refused on CPU.
"""

import subprocess
import sys

import pytest
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_video.attention.megatron import (
    DistAttention2D,
    LocalDotProductAttention,
    UlyssesAttention,
)
from megatron_video.models.ar_dit import ARDiTLayer, get_ar_dit_layer_spec
from megatron_video.models.dit_blocks import (
    AdaLNLoRAModulation,
    AdaLNNorm,
    DiTCrossAttention,
    DiTSelfAttention,
)
from megatron_video.models.dit_layer_specs import get_stdit_layer_spec
from megatron_video.models.specs import with_2d_attention
from megatron_video.models.stdit import STDiTLayer
from megatron_video.models.video_dit import (
    VideoDiTConfig,
    VideoDiTLayer,
    get_video_dit_layer_spec,
    layer_spec_for,
)


def _specs(backend="local"):
    return {
        "video_dit": get_video_dit_layer_spec(8, backend=backend),
        "stdit": get_stdit_layer_spec("hybrid", (1,), 8, backend=backend),
        "ar_dit": get_ar_dit_layer_spec(8, backend=backend),
    }


def _attentions(name, spec):
    """(sequence-wide self-attention slots, local-row self-attention slots) of a layer spec."""
    sm = spec.submodules
    if name == "stdit":
        return [sm.full_attention], [sm.spatial_attention, sm.temporal_attention]
    return [sm.self_attention], []


def _mlp_linears(mlp):
    """(linear_fc1, linear_fc2) of the mlp slot in either form megatron-core builds it."""
    from megatron.core.transformer.mlp import MLP

    if isinstance(mlp, ModuleSpec):
        assert mlp.module is MLP
        sub = mlp.submodules
    else:  # functools.partial(MLP.as_mlp_submodule, submodules=...) (megatron-core >= 0.19)
        assert mlp.func.__self__ is MLP
        sub = mlp.keywords["submodules"]
    return sub.linear_fc1, sub.linear_fc2


@pytest.mark.parametrize("backend", ["local", "te"])
def test_layer_specs_declare_megatron_submodules(backend):
    if backend == "local":
        from megatron.core.tensor_parallel import ColumnParallelLinear as col
        from megatron.core.tensor_parallel import RowParallelLinear as row

        norm = AdaLNNorm
    else:  # the classes, looked up only when a TE spec is asked for
        from megatron.core.extensions import transformer_engine as te

        col, row, norm = te.TEColumnParallelLinear, te.TERowParallelLinear, te.TENorm
    layers = {"video_dit": VideoDiTLayer, "stdit": STDiTLayer, "ar_dit": ARDiTLayer}
    for name, spec in _specs(backend).items():
        assert spec.module is layers[name] and issubclass(spec.module, TransformerLayer)
        sm = spec.submodules
        assert sm.modulation is AdaLNLoRAModulation
        assert sm.input_layernorm is norm and sm.pre_cross_attn_layernorm is norm
        assert sm.pre_mlp_layernorm is norm
        assert _mlp_linears(sm.mlp) == (col, row)
        assert sm.cross_attention.module is DiTCrossAttention
        cross = sm.cross_attention.submodules
        assert (cross.linear_q, cross.linear_kv, cross.linear_proj) == (col, col, row)
        full, local = _attentions(name, spec)
        for attn in full + local:
            assert attn.module is DiTSelfAttention
            assert (attn.submodules.linear_qkv, attn.submodules.linear_proj) == (col, row)
        for attn in full:  # sequence-wide: 2D attention on the contiguous CP split
            assert attn.submodules.core_attention.module is DistAttention2D
            assert attn.submodules.core_attention.params == {"scheme": "contiguous"}
        for attn in local:  # rows of one frame / one position, cut by the layer: no CP
            assert attn.submodules.core_attention.module is LocalDotProductAttention
        if name == "stdit":
            assert sm.pre_spatial_attn_layernorm is norm and sm.pre_temporal_attn_layernorm is norm


def test_stdit_baseline_variants_differ_only_in_core_attention():
    cp = get_stdit_layer_spec("cp_everywhere").submodules
    uly = get_stdit_layer_spec("ulysses_everywhere").submodules
    for slot in ("full_attention", "spatial_attention", "temporal_attention"):
        assert getattr(cp, slot).submodules.core_attention.module is DistAttention2D
        assert getattr(uly, slot).submodules.core_attention.module is UlyssesAttention


@pytest.mark.parametrize("backend", ["local", "te"])
def test_with_2d_attention_swaps_only_the_sequence_wide_core(backend):
    for name, spec in _specs(backend).items():
        swapped = with_2d_attention(spec, backend="math")
        full, local = _attentions(name, swapped)
        for attn in full:  # the spec's own parameters (the DiT token layout) are kept
            core = attn.submodules.core_attention
            assert core.module is DistAttention2D
            assert core.params == {"scheme": "contiguous", "backend": "math"}
        for attn, before in zip(local, _attentions(name, spec)[1]):
            assert attn.submodules.core_attention.module is LocalDotProductAttention
            assert attn.submodules.core_attention is not before.submodules.core_attention  # a copy
        # the original is untouched; an explicit parameter overrides the spec's
        assert _attentions(name, spec)[0][0].submodules.core_attention.params == {
            "scheme": "contiguous"
        }
        zig = with_2d_attention(spec, scheme="zigzag")
        assert _attentions(name, zig)[0][0].submodules.core_attention.params == {"scheme": "zigzag"}
        # cross-attention is never touched
        assert swapped.submodules.cross_attention.module is DiTCrossAttention


def test_te_spec_is_not_reachable_on_cpu_by_default():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    cfg = VideoDiTConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True
    )
    assert cfg.layer_backend == "local"
    assert layer_spec_for(cfg).submodules.input_layernorm is AdaLNNorm
    cfg.layer_backend = "te"
    if not HAVE_TE:
        with pytest.raises(ValueError, match=r"layer_backend \('te'\) needs TransformerEngine"):
            layer_spec_for(cfg)
    cfg.layer_backend = "fp8"
    with pytest.raises(ValueError, match=r"layer_backend \('fp8'\) must be one of"):
        layer_spec_for(cfg)
    with pytest.raises(ValueError, match=r"backend \('tex'\) must be one of"):
        get_video_dit_layer_spec(backend="tex")


def test_model_modules_do_not_import_transformer_engine_classes():
    """Importing the model modules and building local specs touches no TE class (a fresh process:
    megatron-core's own TE extension module may be imported, but none of its TE* classes is
    looked up by megatron_video until a TE spec is asked for)."""
    code = (
        "import sys, megatron.core.extensions.transformer_engine as te\n"
        "looked = []\n"
        "class Spy(type(te)):\n"
        "    def __getattribute__(self, name):\n"
        "        caller = sys._getframe(1).f_globals.get('__name__', '')\n"
        "        if name.startswith('TE') and caller.startswith('megatron_video'):\n"
        "            looked.append(name)\n"
        "        return super().__getattribute__(name)\n"
        "te.__class__ = Spy\n"
        "import megatron_video.models.video_dit as v\n"
        "import megatron_video.models.dit_layer_specs as s\n"
        "import megatron_video.models.ar_dit as a\n"
        "v.get_video_dit_layer_spec(); s.get_stdit_layer_spec(); a.get_ar_dit_layer_spec()\n"
        "assert not looked, looked\n"
        "v.get_video_dit_layer_spec(backend='te')\n"
        "assert 'TEColumnParallelLinear' in looked, looked\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
