"""benchmarks/wan.py does not rot: its functions at tiny sizes (seconds): the layer pair agrees
(same weights), the timing / memory rows and the per-rank memory table come out, and the
benchmark's Wan 2.1 configs have the parameter counts of their names (counted on the meta
device)."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "wan.py"
TINY = dict(hidden=64, heads=4, ffn=128, text_dim=32, text_len=8, layers=2)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_wan", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_rows_and_table_at_tiny_sizes(bench, capsys):
    from megatron_video.models.wan.convert import _one_process

    with _one_process():
        pair = bench.LayerPair(TINY)
        assert bench.check_same_output(pair, 64) <= 1e-5
        rows = bench.layer_rows(pair, [32, 64])
        ratios = bench.print_layer_rows(rows, TINY, torch.float32)
        per_token, const = bench.activation_coefficients(pair, 32, 64)
    assert len(rows) == 4 and all(r["cpu_s"] > 0 for r in rows) and set(ratios) == {32, 64}
    assert per_token > 10 * TINY["hidden"] and const >= 0  # at least ~10 activations per token
    psi, table = bench.memory_table(TINY, 1024, 16, per_token, const)
    bench.print_memory_table(psi, table, 1024)
    names = [r[0] for r in table]
    assert len(table) == 4 and "no CP" in names[-1]
    cp16, no_cp = table[0], table[-1]
    assert no_cp[4] == pytest.approx(TINY["layers"] * (per_token * 1024 + const))
    assert cp16[4] < no_cp[4] / 8  # activations sharded over the 16 ranks
    assert "per rank, GiB" in capsys.readouterr().out


@pytest.mark.parametrize("name,lo,hi", [("WAN_1_3B", 1.2e9, 1.5e9), ("WAN_14B", 13e9, 15e9)])
def test_configs_have_their_parameter_counts(bench, name, lo, hi):
    dims = getattr(bench, name)
    dims = dict(dims, layers=dims.get("layers", 30))
    assert lo < bench.count_params(dims) < hi
