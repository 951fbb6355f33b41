"""No function in megatron_video/ is over 80 lines (decorators and docstring included), read from
the source (AST), no imports."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "megatron_video"
MAX_LINES = 80


def _long_functions(root: Path, limit: int):
    """``(path relative to root, name, first line, line count)`` of each function over ``limit``."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - start + 1
                if lines > limit:
                    yield path.relative_to(root).as_posix(), node.name, start, lines


def test_no_function_over_80_lines():
    found = list(_long_functions(ROOT, MAX_LINES))
    assert not found, "\n".join(f"{p}:{n} {name} ({k} lines)" for p, name, n, k in found)


def test_size_check_counts_decorators_and_docstring(tmp_path):
    body = "\n".join(f"    x = {i}" for i in range(77))
    (tmp_path / "m.py").write_text(f'@staticmethod\ndef f():\n    """doc"""\n{body}\n')
    assert list(_long_functions(tmp_path, 80)) == []  # exactly 80 lines is allowed
    assert list(_long_functions(tmp_path, 79)) == [("m.py", "f", 1, 80)]
