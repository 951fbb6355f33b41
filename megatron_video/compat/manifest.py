"""The ``manifest.json`` of a checkpoint directory: every other file's size and SHA-256, written
last and checked on load (``training.checkpoint``, ``models.wan.convert``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import List

__all__ = ["MANIFEST_FILE", "sha256_file", "manifest_files", "file_manifest", "write_manifest"]

MANIFEST_FILE = "manifest.json"


def sha256_file(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_files(path: Path) -> List[str]:
    """The files below ``path`` (relative, sorted) that the manifest covers."""
    return sorted(
        str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST_FILE
    )


def file_manifest(path: Path) -> dict:
    """``{name: {"bytes", "sha256"}}`` of the files below ``path`` as they are now."""
    return {
        name: {"bytes": (path / name).stat().st_size, "sha256": sha256_file(path / name)}
        for name in manifest_files(path)
    }


def write_manifest(path: Path) -> None:
    (path / MANIFEST_FILE).write_text(
        json.dumps({"files": file_manifest(path)}, indent=1, sort_keys=True)
    )
