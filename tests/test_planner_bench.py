"""benchmarks/planner.py does not rot: ``--load`` refits the cpu profile on the measured rows
docs/benchmarks.md reports (``benchmarks/planner_measured.json``) and prints both tables (a rank
per core and two; video_dit fitted, ar_dit fitted on one row and predicted on the others), the
rankings and the NeMo paper rows; the fit reproduces the profile the ``cpu`` entry of
``planner.hardware`` holds (taken from this file): its compute rate, FSDP cost per gather /
reduction and (on the AR DiT) mask cost per element; and the ``h100`` fractions fitted on one
paper row are the ones its profile holds."""

import re

import pytest

from megatron_video.testing.scripts import run_script


@pytest.mark.process_launch
def test_planner_benchmark_refits_the_recorded_rows():
    out = run_script("benchmarks/planner.py", "--load", "benchmarks/planner_measured.json")
    for world in (2, 4):
        assert f"{world} gloo ranks on 2 cores" in out, out
    assert out.count("pairs measured apart by more than their spread") == 4  # 2 families x 2
    assert out.count("ar_dit     fit") == 2  # the other family, with the video_dit profile
    assert "ST-DiT-12B 35k hybrid" in out and "DiT-7B 73k tokens" in out
    fitted = re.search(
        r"2 gloo ranks on 2 cores; cpu profile fitted on .*?: peak ([\d.e+]+) FLOP/s", out
    )
    from megatron_video.planner import get_hardware

    assert fitted and float(fitted[1]) == pytest.approx(get_hardware("cpu").peak_flops, rel=0.01)
    fsdp = re.search(r"2 gloo ranks on 2 cores;.*?per FSDP gather / reduction ([\d.e+]+) us", out)
    cpu_fsdp = get_hardware("cpu").fsdp_call_overhead_s * 1e6
    assert fsdp and float(fsdp[1]) == pytest.approx(cpu_fsdp, rel=0.01)
    mask = re.search(r"2 gloo ranks on 2 cores;.*?attention mask ([\d.e+]+) ns per element", out)
    cpu_mask = get_hardware("cpu").mask_s_per_element * 1e9
    assert mask and float(mask[1]) == pytest.approx(cpu_mask, rel=0.01)
    h100 = re.search(r"= matmul ([\d.]+), attention ([\d.]+) \(the profile holds", out)
    fitted_h100 = (float(h100[1]), float(h100[2])) if h100 else None
    h = get_hardware("h100")
    assert fitted_h100 == pytest.approx((h.matmul_eff, h.attn_eff), abs=1e-3), out
