"""Layers import only downward (docs/architecture.md, "Layers of the code"): a module of layer L
imports megatron_video modules of layers above L only; and no import cycle, inside a package or
between packages. Read from the source (AST), no imports."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_env  # no Megatron: CI's first environment only

ROOT = Path(__file__).resolve().parents[1] / "megatron_video"
ORDER = [
    "checks",  # megatron_video/checks.py: the ground floor (imports nothing of megatron_video)
    "compat",
    "parallel",
    "ops",
    "layouts",
    "attention",
    "models",
    "diffusion",
    "data",
    "planner",
    "generation",  # the CP samplers, streaming AR generation: rl and training call it
    "rl",  # GRPO's shared parts and the diffusion RL: mmsp's GRPO imports them
    "mmsp",
    "training",
]
# Known upward imports still to be removed (none): entries are ("path under megatron_video/", layer).
KNOWN: set = set()


def _imported_layers(path: Path, root: Path = ROOT):
    rel = path.relative_to(root).parts
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


def _layer_of(rel) -> str:
    """A package's name, or a root module's (``checks.py`` -> ``checks``)."""
    return rel[0] if len(rel) > 1 else Path(rel[0]).stem


def _upward_imports(root: Path, known=frozenset()):
    """``path:line imports layer (below mine)`` for every import of a lower layer under ``root``."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        mine = _layer_of(rel)
        if mine not in ORDER:
            continue
        me = ORDER.index(mine)
        for layer, line in _imported_layers(path, root):
            key = ("/".join(rel), layer)
            if layer in ORDER and ORDER.index(layer) > me and key not in known:
                bad.append(f"{'/'.join(rel)}:{line} imports {layer} (below {mine})")
    return bad


def test_layers_import_only_downward():
    bad = _upward_imports(ROOT, KNOWN)
    assert not bad, "\n".join(bad)
    # the cycle this rule removed
    assert not any(
        layer == "models" for layer, _ in _imported_layers(ROOT / "layouts" / "stdit.py")
    )


def _family_branches(path: Path):
    """Comparisons of a ``family`` value with string literals (``family == "ar_dit"``, ``in (...)``)."""

    def is_family(n):
        return (isinstance(n, ast.Attribute) and n.attr == "family") or (
            isinstance(n, ast.Name) and n.id == "family"
        )

    def is_literal(n):
        return (isinstance(n, ast.Constant) and isinstance(n.value, str)) or (
            isinstance(n, (ast.Tuple, ast.List, ast.Set)) and any(is_literal(e) for e in n.elts)
        )

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_family(s) for s in sides) and any(is_literal(s) for s in sides):
                yield node.lineno


def test_family_choices_live_in_one_place():
    """Model-family choices are written once, in training/families/ (docs/architecture.md,
    "Model families"): no other module of the library or the examples branches on a family's name."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    families = ROOT / "training" / "families"
    bad = [
        f"{p}:{line}"
        for p in sorted([*ROOT.rglob("*.py"), *examples.rglob("*.py")])
        if families not in p.parents
        for line in _family_branches(p)
    ]
    assert not bad, "branches on model.family outside training/families/:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------------------------
# Import cycles: every import counts (module level, in functions, under TYPE_CHECKING), resolved
# from the AST to the module it loads: `from . import x` -> the package's submodule x (its
# __init__ where x is a name), `from .x import y` -> x.y where y is a submodule, else x.
# ----------------------------------------------------------------------------------------------
# Cycles still to be removed. Each entry must be an existing cycle (its modules, as paths under
# megatron_video/), so an entry cannot outlive its cycle.
KNOWN_CYCLES: set = set()  # cycles still to be removed (none); the test fails if one goes stale


def _modules(root: Path):
    """``{dotted name: path}`` of every module of the package at ``root``."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _import_edges(name: str, path: Path, mods):
    """``(imported module, line)`` for every import of ``path`` (module ``name``) inside the tree."""
    top = next(iter(mods)).split(".")[0]

    def known(mod: str) -> str:  # the module that is loaded: the longest existing prefix
        while mod not in mods and "." in mod:
            mod = mod.rsplit(".", 1)[0]
        return mod

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == top:
                    yield known(a.name), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base + (node.module.split(".") if node.module else []))
            elif node.module and node.module.split(".")[0] == top:
                base = node.module
            else:
                continue
            base = known(base)
            for a in node.names:
                sub = f"{base}.{a.name}"
                yield (sub if sub in mods else base), node.lineno


def _graph(root: Path):
    """``{module: {imported module: first line}}`` over the package at ``root``."""
    mods = _modules(root)
    graph = {}
    for name, path in mods.items():
        edges = graph.setdefault(name, {})
        for target, line in _import_edges(name, path, mods):
            if target != name:
                edges.setdefault(target, line)
    return graph


def _cycles(graph):
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _path_through(graph, comp):
    """One import loop through ``comp``: ``a:12 -> b:40 -> a`` (module:line of the import)."""
    start, members = comp[0], set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:  # breadth first: the shortest way back to start
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    hops, u = [(v, graph[v][w])], v
                    while prev[u] is not None:
                        hops.append((prev[u], graph[prev[u]][u]))
                        u = prev[u]
                    return " -> ".join(f"{m}:{line}" for m, line in reversed(hops)) + f" -> {start}"
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(comp)


def _rel(module: str) -> str:
    path = _modules(ROOT)[module]
    return path.relative_to(ROOT).as_posix()


def test_no_import_cycles_between_modules():
    """No module reaches itself through imports, inside a package or across packages."""
    graph = _graph(ROOT)
    found = {tuple(sorted(_rel(m) for m in comp)): comp for comp in _cycles(graph)}
    new = [
        f"{' <-> '.join(k)}: {_path_through(graph, c)}"
        for k, c in found.items()
        if k not in KNOWN_CYCLES
    ]
    assert not new, "import cycles:\n" + "\n".join(new)
    stale = sorted(KNOWN_CYCLES - set(found))
    assert not stale, f"KNOWN_CYCLES entries that are no longer cycles (delete them): {stale}"


def test_no_import_cycles_between_packages():
    """The packages of megatron_video import each other without a loop (every import counts,
    the known upward ones of test_layers_import_only_downward included)."""
    graph = _graph(ROOT)
    top = ROOT.name

    def package(m):
        parts = m.split(".")
        return parts[1] if len(parts) > 1 and (ROOT / parts[1]).is_dir() else top

    packages = {}
    for m, edges in graph.items():
        for t in edges:
            if package(t) != package(m):
                packages.setdefault(package(m), {}).setdefault(package(t), f"{m} imports {t}")
    loops = _cycles(packages)
    assert not loops, "package import cycles:\n" + "\n".join(
        f"{loop}: "
        + "; ".join(packages[a][b] for a in loop for b in loop if b in packages.get(a, {}))
        for loop in loops
    )


def test_training_config_imports_no_family():
    """The config is below the families: it looks them up by name in training/family_spec.py."""
    graph = _graph(ROOT)
    config = "megatron_video.training.config"
    assert not [t for t in graph[config] if t.startswith("megatron_video.training.families")]
    reach, todo = set(), [config]
    while todo:
        for t in graph[todo.pop()]:
            if t not in reach:
                reach.add(t)
                todo.append(t)
    assert not [t for t in reach if t.startswith("megatron_video.training.families")], sorted(reach)


def _tree(tmp_path: Path, files: dict) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_layering_check_flags_an_upward_import(tmp_path):
    """The checker itself: a models module importing data (absolute or relative), or the
    ground-floor checks module importing anything, is reported; downward imports are not."""
    root = _tree(
        tmp_path,
        {
            "checks.py": "from .compat import x\n",  # the ground floor imports nothing
            "models/a.py": "from megatron_video.data.synthetic import VOCAB\n",
            "models/b.py": "def f():\n    from ..data import thing\n",
            "data/c.py": "from ..models.a import y\nfrom megatron_video.checks import check_int\n",
        },
    )
    assert _upward_imports(root) == [
        "checks.py:1 imports compat (below checks)",
        "models/a.py:1 imports data (below models)",
        "models/b.py:2 imports data (below models)",
    ]
    assert _upward_imports(root, {("models/a.py", "data"), ("models/b.py", "data")}) == [
        "checks.py:1 imports compat (below checks)"
    ]


def test_cycle_check_resolves_relative_and_function_level_imports(tmp_path):
    """The checker itself: `from . import x`, `from .x import y`, `from ..a import b` and imports
    inside functions are edges to the modules they load; a name imported from a package is an
    edge to its __init__."""
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a/__init__.py": "from .impl import thing\n",  # a -> a.impl
            "a/impl.py": "def f():\n    from ..b import helper\n",  # a.impl -> b.helper (in a function)
            "b/__init__.py": "",
            "b/helper.py": "from pkg.a import thing\n",  # b.helper -> a (a name of a)
            "c/__init__.py": "from . import x, y\n",  # c -> c.x, c.y
            "c/x.py": "X = 1\n",
            "c/y.py": "from .x import X\n",  # c.y -> c.x
        },
    )
    graph = _graph(root)
    assert set(graph["pkg.a"]) == {"pkg.a.impl"} and set(graph["pkg.a.impl"]) == {"pkg.b.helper"}
    assert set(graph["pkg.b.helper"]) == {"pkg.a"}
    assert set(graph["pkg.c"]) == {"pkg.c.x", "pkg.c.y"} and set(graph["pkg.c.y"]) == {"pkg.c.x"}
    assert _cycles(graph) == [("pkg.a", "pkg.a.impl", "pkg.b.helper")]
    assert (
        _path_through(graph, ("pkg.a", "pkg.a.impl", "pkg.b.helper"))
        == "pkg.a:1 -> pkg.a.impl:2 -> pkg.b.helper:1 -> pkg.a"
    )
