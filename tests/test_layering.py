"""Layers import only downward (docs/architecture.md, "Layers of the code"): a module of layer L
imports megatron_video modules of layers above L only. Read from the source (AST), no imports."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "megatron_video"
ORDER = ["compat", "parallel", "ops", "layouts", "attention", "models", "mmsp", "diffusion", "data",
         "training"]
# Known upward imports still to be removed (the caption vocabulary lives in data.synthetic).
KNOWN = {("models/video_dit.py", "data"), ("models/embedders.py", "data")}


def _imported_layers(path: Path):
    rel = path.relative_to(ROOT).parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = list(rel[:-1])[: len(rel) - node.level]
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("megatron_video."):
                mod = node.module.split(".")[1:]
            else:
                continue
            yield mod[0] if mod else None, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("megatron_video."):
                    yield a.name.split(".")[1], node.lineno


def test_layers_import_only_downward():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 2 or rel[0] not in ORDER:
            continue
        me = ORDER.index(rel[0])
        for layer, line in _imported_layers(path):
            key = ("/".join(rel), layer)
            if layer in ORDER and ORDER.index(layer) > me and key not in KNOWN:
                bad.append(f"{'/'.join(rel)}:{line} imports {layer} (below {rel[0]})")
    assert not bad, "\n".join(bad)
    # the cycle this rule removed
    assert not any(layer == "models" for layer, _ in _imported_layers(ROOT / "layouts" / "stdit.py"))


def _family_branches(path: Path):
    """Comparisons of a ``family`` value with string literals (``family == "ar_dit"``, ``in (...)``)."""
    def is_family(n):
        return (isinstance(n, ast.Attribute) and n.attr == "family") or (isinstance(n, ast.Name)
                                                                          and n.id == "family")

    def is_literal(n):
        return (isinstance(n, ast.Constant) and isinstance(n.value, str)) or (
            isinstance(n, (ast.Tuple, ast.List, ast.Set)) and any(is_literal(e) for e in n.elts))

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_family(s) for s in sides) and any(is_literal(s) for s in sides):
                yield node.lineno


def test_family_choices_live_in_one_place():
    """Model-family choices are written once, in training/families.py (docs/architecture.md,
    "Model families"): no other module of the library or the examples branches on a family's name."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    bad = [f"{p}:{line}" for p in sorted([*ROOT.rglob("*.py"), *examples.rglob("*.py")])
           if p != ROOT / "training" / "families.py" for line in _family_branches(p)]
    assert not bad, "branches on model.family outside training/families.py:\n" + "\n".join(bad)
