"""The README and docs/ name only things that exist: every repository path they cite (with the
test function after ``::``), every in-repo link and its ``#section``, every fully qualified
``megatron_video.`` name; every docs/ page is linked from the README, which stays a front door
(<= 150 lines)."""

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README] + PAGES
MAX_README_LINES = 150

# a path under one of these roots, optionally followed by ::test_name
PATH_RE = re.compile(
    r"(?<![\w./-])((?:docs|tests|benchmarks|examples|megatron_video|csrc|docker"
    r"|requirements|\.ci)"
    r"(?:/[\w.*-]+)*/?)(?:::(\w+))?"
)
LINK_RE = re.compile(r"\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.M)
NAME_RE = re.compile(r"(?<![\w./])megatron_video(?:\.\w+)+")
CODE_RE = re.compile(r"^```.*?^```", re.M | re.S)
SECTION_RE = re.compile(r"\b(README|(?:docs/)?\w+\.md)(?:'s)?,? \"([^\"]+)\"")  # README "Section"


def _ids(doc):
    return pytest.param(doc, id=str(doc.relative_to(ROOT)))


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _headings(page):
    text = CODE_RE.sub("", page.read_text())
    return [m.group(1) for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M)]


def _anchors(page):
    return {_slug(h) for h in _headings(page)}


def _test_names(path):
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_readme_is_a_front_door():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {
        Path(m.group(1) or m.group(2)).as_posix().split("#")[0]
        for m in LINK_RE.finditer(README.read_text())
    }
    missing = [
        p.relative_to(ROOT).as_posix()
        for p in PAGES
        if p.relative_to(ROOT).as_posix() not in linked
    ]
    assert PAGES and not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("doc", [_ids(d) for d in DOCS])
def test_named_paths_and_tests_exist(doc):
    bad = []
    for m in PATH_RE.finditer(doc.read_text()):
        rel, name = m.group(1).rstrip("."), m.group(2)
        target = ROOT / rel
        if not (list(ROOT.glob(rel)) if "*" in rel else target.exists()):
            bad.append(f"{rel}: no such file or directory")
        elif name and (target.suffix != ".py" or name not in _test_names(target)):
            bad.append(f"{rel}::{name}: no such test in that file")
    assert not bad, f"{doc.name} names what does not exist: {bad}"


@pytest.mark.parametrize("doc", [_ids(d) for d in DOCS])
def test_links_and_their_sections_exist(doc):
    bad = []
    for m in LINK_RE.finditer(CODE_RE.sub("", doc.read_text())):
        link = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", link):
            continue  # an external address
        rel, _, anchor = link.partition("#")
        target = (doc.parent / rel).resolve() if rel else doc
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"{link}: no section '#{anchor}' in {target.name}")
    for m in SECTION_RE.finditer(doc.read_text()):  # a section cited by name: README "Section"
        name = "README.md" if m.group(1) == "README" else m.group(1)
        page = ROOT / name if name.startswith(("README", "docs/")) else doc.parent / name
        if not page.exists() or not any(
            h.replace("`", "").startswith(m.group(2)) for h in _headings(page)
        ):
            bad.append(f"{m.group(0)}: no such section")
    assert not bad, f"{doc.name} links to what does not exist: {bad}"


@pytest.mark.parametrize("doc", [_ids(d) for d in DOCS])
def test_qualified_names_resolve(doc):
    bad = []
    for dotted in sorted(set(NAME_RE.findall(doc.read_text()))):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                bad.append(dotted)
                break
            obj = getattr(obj, attr)
    assert not bad, f"{doc.name} names what does not exist: {bad}"


@pytest.mark.parametrize("doc", [_ids(d) for d in DOCS])
def test_python_examples_parse_and_import_what_exists(doc):
    bad = []
    for code in re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.M | re.S):
        for node in ast.walk(ast.parse(code)):
            ours = isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "megatron_video"
            )
            if ours:
                module = importlib.import_module(node.module)
                bad += [
                    f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)
                ]
    assert not bad, f"{doc.name} examples import what does not exist: {bad}"
