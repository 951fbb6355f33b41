"""The suite's rule for CI's two environments (a pytest plugin, loaded by ``tests/conftest.py``).

A test marked ``one_env`` runs in CI's first environment only: its outcome cannot depend on the
Megatron-Core version (the only thing the second environment changes besides Python 3.11 ->
3.12; torch is 2.13.0 in both). The mark is checked, not trusted: ``make test`` runs the
``one_env`` tests in a process of their own with ``--no-megatron``, where importing ``megatron``
fails, and a test that tried it fails even where the code caught the ``ImportError`` (the
worker pools ask for it before they start: their ranks import Megatron). Everything else runs
in both environments, except ``process_launch`` (CI's first only; see ``.ci/run``).
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from pathlib import Path
from typing import List

import pytest

MARK = "one_env"
OPTION = "--no-megatron"


class _Blocker(MetaPathFinder):
    """Refuses ``megatron`` and ``megatron.*`` (not ``megatron_video``) and remembers who asked."""

    def __init__(self):
        self.attempts: List[str] = []

    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            self.attempts.append(name)
            raise ImportError(
                f"{name}: a test marked {MARK} imported Megatron, so its outcome can depend on "
                f"the Megatron-Core version; remove the mark (it must run in both CI "
                f"environments)"
            )
        return None


_blocker = _Blocker()


def blocking(config) -> bool:
    """Whether this pytest process runs the ``one_env`` tests with Megatron blocked."""
    return bool(config.getoption("no_megatron", default=False))


def pytest_addoption(parser):
    parser.addoption(
        OPTION,
        action="store_true",
        dest="no_megatron",
        help=f"run only the tests marked {MARK}, with Megatron's import refused (make test)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MARK}: cannot depend on the Megatron-Core version; CI's first environment only "
        f"(checked with {OPTION}: megatron_video/testing/env_split.py)",
    )
    if not blocking(config):
        return
    loaded = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
    if loaded:
        raise pytest.UsageError(f"{OPTION}: Megatron was imported before the tests: {loaded[:3]}")
    sys.meta_path.insert(0, _blocker)


def pytest_ignore_collect(collection_path: Path, config):
    """With ``--no-megatron``, test files without the mark are not even imported."""
    if blocking(config) and collection_path.suffix == ".py":
        if collection_path.name.startswith("test_") and MARK not in collection_path.read_text():
            return True
    return None


def pytest_collection_modifyitems(config, items):
    if not blocking(config):
        return
    keep = [item for item in items if item.get_closest_marker(MARK)]
    dropped = [item for item in items if not item.get_closest_marker(MARK)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


@pytest.fixture(autouse=True)
def _megatron_stays_out(request):
    """A ``one_env`` test that tried to import Megatron fails, even if the code caught the error."""
    before = len(_blocker.attempts)
    yield
    tried = _blocker.attempts[before:]
    if tried and blocking(request.config):
        pytest.fail(
            f"imported Megatron ({', '.join(dict.fromkeys(tried))}) under the {MARK} mark: "
            f"its outcome can depend on the Megatron-Core version; remove the mark",
            pytrace=False,
        )
