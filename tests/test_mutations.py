"""The mutation check: each named breakage of ``megatron_video/testing/mutations.py`` (resume
restarts from scratch, ``model.init_from`` ignored, Adam's moments zeroed as the optimizer's state
loads, the stale-cache hook on, the ledger replaying a clip) makes every test guarding it fail.
The guards pass on the unbroken code in the suite itself; here one pytest process runs them all
broken."""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from megatron_video.testing import mutations

ROOT = Path(__file__).resolve().parents[1]


def test_each_breakage_has_guards_and_each_guard_one_breakage():
    ids = [i for ids in mutations.GUARDS.values() for i in ids]
    assert set(mutations.GUARDS) == set(mutations.BREAKAGES) and all(mutations.GUARDS.values())
    assert len(ids) == len(set(ids)), "a test guards one breakage (it runs once, broken)"
    for name, guards in mutations.GUARDS.items():
        assert all(mutations.breakage_of(i) == name for i in guards)
    with pytest.raises(ValueError, match=r"MEGATRON_VIDEO_MUTATION \('nope'\) must be one of"):
        with mutations.broken("nope"):
            pass


@pytest.mark.parametrize("name", sorted(mutations.BREAKAGES))
def test_breakage_applies_and_restores(name):
    owner, attr, replacement = mutations.BREAKAGES[name]()
    before = getattr(owner, attr)
    with mutations.broken(name):
        assert getattr(owner, attr) is replacement or getattr(owner, attr) != before
    assert getattr(owner, attr) == before


def _why(failure) -> str:
    """A failure's message; for a pool task's ``RankError``, the first rank's own error line."""
    message = (failure.get("message") or "").splitlines()[:1] or [""]
    if "RankError" in message[0]:
        lines = (failure.text or "").splitlines()
        errors = [
            re.sub(r"^E\s+", "", ln).strip()
            for ln in lines
            if "Error" in ln and "RankError" not in ln
        ]
        message += errors[:1]
    return " / ".join(message)[:400]


@pytest.mark.process_launch
def test_every_breakage_is_caught(tmp_path):
    """All guards in one pytest process (one worker pool), each under its breakage: each fails."""
    ids = [i for ids in mutations.GUARDS.values() for i in ids]
    report = tmp_path / "report.xml"
    env = dict(os.environ, **{mutations.MODE_ENV: "1"})
    env.pop(mutations.ENV, None)
    cmd = [sys.executable, "-m", "pytest", *ids, "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        cmd + [f"--junitxml={report}"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    out = proc.stdout[-4000:] + proc.stderr[-2000:]
    cases = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname").replace(".", "/") + ".py"
        outcome = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        cases[f"{module}::{case.get('name')}"] = outcome
        for c in case.iter("failure"):  # what each guard reported (pytest -s shows it)
            print(f"{module}::{case.get('name')}: {_why(c)}")
    for name, guards in mutations.GUARDS.items():
        for guard in guards:
            got = {k: v for k, v in cases.items() if k == guard or k.split("[")[0] == guard}
            assert got, f"guard {guard} of {name!r} did not run:\n{out}"
            unnoticed = [k for k, v in got.items() if v != ["failure"]]
            assert not unnoticed, f"breakage {name!r} went unnoticed by {unnoticed}:\n{out}"
    assert proc.returncode == 1, out
