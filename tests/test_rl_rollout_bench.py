"""benchmarks/rl_rollout.py does not rot: its smallest case (4 blocks of 1 latent frame of 2 x 2
tokens, 1 step) on the 4-rank pool at CP 1 and 4 (U2 x R2) times every block of both rollouts on
every rank, both give the same video, the recompute rollout holds more tensor bytes at its peak
than the streaming one, a CP 4 rank's streaming peak is below a CP 1 rank's, and the side-by-side
table prints."""

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "rl_rollout.py"


def _bench():
    spec = importlib.util.spec_from_file_location("benchmark_rl_rollout", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(U, R):
    return _bench().rank_case(4, 1, 2, 1, U, R)


def test_smallest_case(pool4):
    results = {(U, R): pool4.run(_rank, U, R) for U, R in ((1, 1), (2, 2))}
    for ranks in results.values():
        for out in ranks:
            for name in ("streaming", "recompute"):
                assert len(out[name]["cpu"]) == 4 and min(out[name]["cpu"]) >= 0, out
            assert out["recompute"]["peak"] > out["streaming"]["peak"] > 0, out
            assert out["max_diff"] < 1e-4, out  # the same video both ways (float32)
    peak = {k: max(r["streaming"]["peak"] for r in v) for k, v in results.items()}
    assert peak[(2, 2)] < peak[(1, 1)], peak
    lines = _bench().table(results, 4).splitlines()
    assert [ln.split()[0] for ln in lines[1:]] == ["1", "4"], lines
