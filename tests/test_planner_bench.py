"""benchmarks/planner.py does not rot: ``--load`` refits the cpu profile on the measured rows
docs/benchmarks.md reports (``benchmarks/planner_measured.json``) and prints both tables (a rank
per core and two; video_dit fitted, ar_dit predicted), the rankings and the NeMo paper rows; the
fit reproduces the profile the ``cpu`` entry of ``planner.hardware`` holds (taken from this file)."""

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
