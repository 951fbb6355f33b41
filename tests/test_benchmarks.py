"""Every benchmark script holds Megatron's / torch's known environment warnings back in one line,
as the command line does, and documents ``--verbose``, which shows them (``training.console``).
The scripts' smoke tests (``testing.scripts.run_script``) fail on any warning line they print."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

SCRIPTS = sorted(
    p
    for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")
    if not p.name.startswith("_")
)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_holds_known_warnings_back(path):
    tree = ast.parse(path.read_text())
    main = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert main, f"{path.name}: no __main__ block"
    first_call = next(s for s in main[0].body if isinstance(s, ast.Expr))
    assert ast.unparse(first_call) == "quiet_script()", (
        f"{path.name}: quiet_script() must run first"
    )
    flags = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and getattr(n.func, "attr", "") == "add_argument"
        and n.args
        and getattr(n.args[0], "value", None) == "--verbose"
    ]
    assert flags, f"{path.name}: its parser must document --verbose"
