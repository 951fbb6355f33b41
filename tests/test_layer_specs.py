"""One per-layer ``cp_comm_type`` rule (``compat.layer_cp_comm_type``, megatron-core 0.19's
``config.cp_comm_type[layer_number - 1]``) for every layer and core attention; the DiT layer specs
in ``models/dit_layer_specs.py``, the ST-DiT variant chosen by the spec alone; no import cycle and
no function-level import of megatron_video inside ``models/``.

With a full-length list-valued ``cp_comm_type`` (a different scheme on neighbouring layers) every
DiT layer, and every core attention inside it, must read its own entry on every layer including
the last; so must MM-SP's LLaVA language layers. One process (a one-rank gloo group): the layers
are only built, the config shows CP = 2 (the scheme is chosen at construction).
"""

import ast
import inspect
import socket
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_video.compat.cp_comm_type import (
    core_cp_comm_type,
    layer_cp_comm_type,
    megatron_cp_comm_type_index_base,
)

ROOT = Path(__file__).resolve().parents[1] / "megatron_video"
# neighbouring layers differ, so reading entry layer_number (or layer_number - 2) is caught
COMMS = ["a2a", "p2p", "a2a+p2p", "a2a"]


@pytest.fixture
def megatron_tp1():
    """One-process gloo group + Megatron parallel state (TP = CP = 1), torn down if created here."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_video.compat import ensure_cpu_mode, initialize_model_parallel

    ensure_cpu_mode()
    created_pg = not dist.is_initialized()
    if created_pg:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    created_ps = not ps.model_parallel_is_initialized()
    if created_ps:
        initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    yield
    if created_ps:
        ps.destroy_model_parallel()
    if created_pg:
        dist.destroy_process_group()


def test_layer_cp_comm_type_reads_entry_layer_number_minus_one():
    cfg = types.SimpleNamespace(cp_comm_type=list(COMMS))
    assert [layer_cp_comm_type(cfg, n) for n in range(1, 5)] == COMMS
    assert layer_cp_comm_type(types.SimpleNamespace(cp_comm_type="a2a"), 7) == "a2a"
    assert layer_cp_comm_type(types.SimpleNamespace(cp_comm_type=None), 1) is None
    assert layer_cp_comm_type(object(), 1) is None  # a config without the field
    for bad in (0, 5):
        with pytest.raises(ValueError, match=rf"layer_number \({bad}\) must be in \[1, 4\]"):
            layer_cp_comm_type(cfg, bad)
    # a core attention handed another entry than its layer's is refused, naming both
    assert core_cp_comm_type(cfg, 2, "p2p") == "p2p"
    assert core_cp_comm_type(cfg, 2, None) is None
    assert core_cp_comm_type(types.SimpleNamespace(cp_comm_type="a2a"), 2, "p2p") == "p2p"
    with pytest.raises(
        ValueError,
        match=r"cp_comm_type \('a2a\+p2p'\) handed to the core "
        r"attention of layer 2 must be .*\('p2p'\)",
    ):
        core_cp_comm_type(cfg, 2, "a2a+p2p")


def test_megatron_index_base_is_detected_from_the_installed_transformer_layer():
    """0 (megatron-core 0.19: ``[layer_number - 1]``) or 1 (0.16.1: ``[layer_number]``), found by
    running the installed ``TransformerLayer.__init__`` (feature detection, no version string)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    base = megatron_cp_comm_type_index_base()
    assert base in (0, 1)
    # what the stock layer hands its attention for the last layer of a full-length list
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=8,
        num_attention_heads=1,
        context_parallel_size=2,
        cp_comm_type=list(COMMS),
        use_cpu_initialization=True,
    )
    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self, *args, cp_comm_type=None, **kwargs):
            super().__init__()
            seen["cp_comm_type"] = cp_comm_type

    subs = TransformerLayerSubmodules(self_attention=Probe)
    groups = types.SimpleNamespace(tp=None, pp=None, cp=None)
    layer = TransformerLayer.__new__(TransformerLayer)
    if base == 1:  # one entry off, and the last layer reads past the end
        with pytest.raises(IndexError):
            TransformerLayer.__init__(layer, cfg, subs, layer_number=4, pg_collection=groups)
    else:
        try:
            TransformerLayer.__init__(layer, cfg, subs, layer_number=4, pg_collection=groups)
        except Exception:  # noqa: BLE001 -- later slots of the bare spec; the read came first
            pass
        assert seen["cp_comm_type"] == COMMS[3]


def _dit_config(**kw):
    from megatron_video.models.video_dit import VideoDiTConfig

    return VideoDiTConfig(
        num_layers=4,
        hidden_size=16,
        num_attention_heads=2,
        kv_channels=8,
        ffn_hidden_size=32,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        attention_dropout=0.0,
        context_parallel_size=2,
        cp_comm_type=list(COMMS),
        lora_rank=4,
        **kw,
    )


def _cores(module):
    from megatron_video.attention.megatron import DistAttention2D

    return [m for m in module.modules() if isinstance(m, DistAttention2D)]


def _spec(family):
    from megatron_video.models import dit_layer_specs as S

    if family == "video_dit":
        return S.get_video_dit_layer_spec(4)
    if family == "ar_dit":
        return S.get_ar_dit_layer_spec(4)
    variant = family.split(":")[1]
    return S.get_stdit_layer_spec(variant, full_attention_layers=(1, 2, 3, 4), lora_rank=4)


@pytest.mark.parametrize(
    "family",
    ["video_dit", "ar_dit", "stdit:hybrid", "stdit:cp_everywhere", "stdit:ulysses_everywhere"],
)
def test_dit_layer_and_core_attention_agree_on_every_layer(megatron_tp1, family):
    from megatron_video.models.dit_layer import VideoTransformerBlock

    cfg = _dit_config()
    block = VideoTransformerBlock(cfg, _spec(family), pre_process=True, post_process=False)
    assert cfg.cp_comm_type == COMMS and type(cfg.cp_comm_type) is list  # restored as given
    assert len(block.layers) == 4
    for layer in block.layers:
        want = COMMS[layer.layer_number - 1]
        assert layer._cp_comm_type() == want, (family, layer.layer_number)
        cores = _cores(layer)
        assert cores, family
        for core in cores:
            assert core.layer_number == layer.layer_number
            assert core.cp_comm_type == want, (family, layer.layer_number, type(core).__name__)


def test_mmsp_language_core_attention_reads_entry_layer_number_minus_one(megatron_tp1):
    from megatron_video.mmsp.factory import VideoLLaVASizes, video_llava_model

    model = video_llava_model(VideoLLaVASizes(num_layers=4), cp=2, cp_comm_type=list(COMMS))
    cores = _cores(model.language_model)
    assert sorted(c.layer_number for c in cores) == [1, 2, 3, 4]
    for core in cores:
        assert core.cp_comm_type == COMMS[core.layer_number - 1], core.layer_number


# ----------------------------------------------------------------------------------------------
# where the specs live
# ----------------------------------------------------------------------------------------------
def test_stdit_variant_is_chosen_by_the_spec_alone():
    from megatron_video.models import dit_layer_specs as S
    from megatron_video.models.stdit import STDiTLayer

    for variant in S.VARIANTS:
        assert "variant" not in S.get_stdit_layer_spec(variant).params
    src = (ROOT / "models" / "stdit.py").read_text()
    assert "variant ==" not in src and "self.variant" not in src
    assert "variant" not in inspect.signature(STDiTLayer.__init__).parameters


def _megatron_video_imports(tree, module_parts):
    """(imported megatron_video module, at module level?) of a parsed module."""
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(module_parts[:-1])[: len(module_parts) - node.level]
                name = ".".join(["megatron_video", *base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            names = [f"{name}.{a.name}" for a in node.names] + [name]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            if n.startswith("megatron_video."):
                yield n, id(node) in top


def test_models_have_no_import_cycle_and_no_function_level_imports():
    files = {p.stem: p for p in (ROOT / "models").glob("*.py") if p.stem != "__init__"}
    graph, inner = {}, []
    for stem, path in files.items():
        tree = ast.parse(path.read_text())
        deps = set()
        for name, at_top in _megatron_video_imports(tree, ("models", path.name)):
            if not at_top:
                inner.append(f"models/{path.name}: {name}")
            parts = name.split(".")
            if len(parts) >= 3 and parts[1] == "models" and parts[2] in files:
                deps.add(parts[2])
        graph[stem] = deps - {stem}
    assert not inner, "function-level megatron_video imports in models/:\n" + "\n".join(inner)

    state = {}

    def visit(n, path):
        state[n] = "open"
        for d in sorted(graph[n]):
            if state.get(d) == "open":
                raise AssertionError("import cycle in models/: " + " -> ".join(path + [n, d]))
            if d not in state:
                visit(d, path + [n])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    assert not (ROOT / "models" / "stdit_transitions.py").exists()
