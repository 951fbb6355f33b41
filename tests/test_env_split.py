"""The rule that sends a test to CI's first environment only (``one_env``, checked with
``--no-megatron``: ``megatron_video/testing/env_split.py``) fails a marked test that imports
Megatron, at any depth, even one that catches the error, or that starts a worker pool; it passes
a marked test that does not; files without the mark are not collected there. A bare pytest run
on files written here, with the plugin loaded as tests/conftest.py loads it."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.one_env

FILES = {
    "test_direct.py": """
        import pytest
        pytestmark = pytest.mark.one_env

        def test_imports_megatron():
            import megatron.core  # noqa: F401
    """,
    "test_caught.py": """
        import pytest
        pytestmark = pytest.mark.one_env

        def helper():
            try:
                from megatron.core import parallel_state  # noqa: F401
                return "megatron"
            except ImportError:
                return "fallback"

        def test_catches_the_error():
            assert helper() == "fallback"
    """,
    "test_pool.py": """
        import pytest
        from megatron_video.testing import WorkerPool

        @pytest.mark.one_env
        def test_starts_a_pool():
            with WorkerPool(2) as pool:
                pool.run(print)
    """,
    "test_pure.py": """
        import pytest
        pytestmark = pytest.mark.one_env

        def test_pure():
            import json
            assert json.loads("1") == 1
    """,
    "test_unmarked.py": """
        import megatron.core  # noqa: F401

        def test_not_collected_there():
            pass
    """,
}


def _run(tmp_path, *args):
    for name, text in FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    cmd = [sys.executable, "-m", "pytest", "-p", "megatron_video.testing.env_split", *args]
    cmd += ["-p", "no:cacheprovider", "-q", "-rA", "--rootdir", str(tmp_path), str(tmp_path)]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_marked_tests_that_import_megatron_fail_without_it(tmp_path):
    out = _run(tmp_path, "--no-megatron")
    assert "PASSED test_pure.py::test_pure" in out, out
    for test in (
        "test_direct.py::test_imports_megatron",
        "test_caught.py::test_catches_the_error",
        "test_pool.py::test_starts_a_pool",
    ):
        assert f"ERROR {test}" in out or f"FAILED {test}" in out, out
    assert "remove the mark" in out, out
    assert "test_unmarked" not in out, out  # not even imported


def test_ci_split_names_existing_tests_and_one_environment_each():
    """``.ci/one_env_split.txt``: each line ``env1|env2 NODE`` names a test function that exists,
    once (a stale name would silently run a test in both environments, or in neither)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    lines = (root / ".ci" / "one_env_split.txt").read_text().splitlines()
    entries = [ln.split() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert entries and all(len(e) == 2 and e[0] in ("env1", "env2") for e in entries), entries
    nodes = [node for _, node in entries]
    assert len(nodes) == len(set(nodes)), nodes
    for node in nodes:
        path, name = node.split("::")
        tree = ast.parse((root / path).read_text())
        names = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
        assert name in names, f"{node}: no such test"
