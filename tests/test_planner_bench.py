"""benchmarks/planner.py does not rot: ``--load`` refits the cpu profile on the measured rows
docs/benchmarks.md reports (``benchmarks/planner_measured.json``) and prints both tables (a rank
per core and two; video_dit fitted, ar_dit fitted on one row and predicted on the others), the
rankings and the NeMo paper rows; the fit reproduces the profile the ``cpu`` entry of
``planner.hardware`` holds (taken from this file): its compute rate, FSDP cost per gather /
reduction and (on the AR DiT) mask cost per element; the ``h100`` fractions fitted on one
paper row are the ones its profile holds; and the recorded rows keep the bounds
docs/benchmarks.md ("Planner", "What this shows") claims for them (the whole-percent errors the
tables print, as the docs quote them)."""

import re

import pytest

from megatron_video.testing.scripts import run_script

# name, fitted, measured ms, predicted ms, error %, memory measured, predicted, error %
ROW = re.compile(r"^(\S.*?)\s+(\*?)\s+[\d.]+\s+[\d.]+\s+(-?\d+)%\s+[\d.]+\s+[\d.]+\s+(-?\d+)%")


def _tables(out):
    """``{(ranks, family): {row: (fitted, step time error %, memory error %)}}`` of the printed
    (a) tables, and ``{(ranks, family): (rankings equal, pairs predicted in the other order)}``."""
    rows, rank_lines, key, ranks = {}, {}, None, None
    for line in out.splitlines():
        m = re.match(r"\(a\) .*?, (\d) gloo ranks on", line)
        if m:
            ranks = int(m[1])
        m = re.match(r"(\w+) +fit +measured ms", line)
        if m:
            key = (ranks, m[1])
            rows[key] = {}
        elif line.startswith("predicted ranking:"):
            equal = line.endswith("(equal: True)")
        elif line.startswith("pairs measured apart") and key:
            rank_lines[key] = (equal, int(line.rsplit(":", 1)[1]))
            key = None
        elif key and ROW.match(line):
            name, star, t, mem = ROW.match(line).groups()
            rows[key][name] = (star == "*", int(t), int(mem))
    return rows, rank_lines


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
    _check_documented_bounds(out)


def _check_documented_bounds(out):
    rows, ranking = _tables(out)
    assert set(rows) == {(w, f) for w in (2, 4) for f in ("video_dit", "ar_dit")}, rows
    # a rank per core: every DDP video_dit row within 5 % in time, the ones not fitted within 3 %;
    # memory within 8 % at every layout; the predicted ranking the measured one
    for name, (fit, t, mem) in rows[(2, "video_dit")].items():
        if "fsdp" not in name:
            assert abs(t) <= (5 if fit else 3), (name, t)
        assert abs(mem) <= 8, (name, mem)
    assert ranking[(2, "video_dit")] == (True, 0), ranking
    # the AR DiT (video_dit profile + the mask constant): the other rows within 4-9 % in time,
    # 4-12 % in memory, ranking the measured one
    for name, (fit, t, mem) in rows[(2, "ar_dit")].items():
        assert fit or (abs(t) <= 9 and abs(mem) <= 12), (name, t, mem)
    assert ranking[(2, "ar_dit")] == (True, 0), ranking
    # two ranks per core: the video_dit error at most 15 %; no resolved pair predicted reversed
    assert all(abs(t) <= 15 for _, t, _ in rows[(4, "video_dit")].values()), rows
    assert all(ranking[(4, f)][1] == 0 for f in ("video_dit", "ar_dit")), ranking
    # (b) the NeMo paper: the fitted row exact, the held-out rows at +18 % and -5 %
    paper = dict(re.findall(r"^(ST-DiT-\S+ \S+ hybrid) +[\d.]+ +[\d.]+ +(-?\d+)%", out, re.M))
    want = {"ST-DiT-7B 74k hybrid": "18", "ST-DiT-12B 74k hybrid": "-5"}
    assert paper == dict(want, **{"ST-DiT-12B 35k hybrid": "0"}), paper
