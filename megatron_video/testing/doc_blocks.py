"""The documented commands that tests run: the fenced ``bash`` block after each
``<!-- launch:NAME -->`` marker of a docs page (docs/launch.md, docs/wan.md)."""

from __future__ import annotations

import re
import shlex

__all__ = ["launch_blocks", "launch_lines"]


def launch_blocks(text: str) -> dict:
    """``{name: tokens}`` of the fenced block after each ``<!-- launch:NAME -->`` marker."""
    blocks = {}
    for m in re.finditer(r"<!-- launch:(\S+) -->\s*```bash\n(.*?)```", text, re.S):
        blocks[m.group(1)] = shlex.split(m.group(2).replace("\\\n", " "))
    return blocks


def launch_lines(text: str) -> dict:
    """``{name: [tokens, ...]}``: each command line of the block after each
    ``<!-- launch:NAME -->`` marker (continuations joined, ``#`` comments dropped)."""
    blocks = {}
    for m in re.finditer(r"<!-- launch:(\S+) -->\s*```bash\n(.*?)```", text, re.S):
        lines = m.group(2).replace("\\\n", " ").splitlines()
        blocks[m.group(1)] = [t for t in (shlex.split(ln, comments=True) for ln in lines) if t]
    return blocks
