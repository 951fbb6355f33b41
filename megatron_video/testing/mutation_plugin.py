"""The pytest plugin of the mutation check (``tests/conftest.py``): with
``MEGATRON_VIDEO_MUTATIONS=1`` each guard of ``testing.mutations.GUARDS`` runs under its breakage
(or every test under ``MEGATRON_VIDEO_MUTATION``, when that is given)."""

import os
from typing import List

import pytest

from .mutations import ENV, MODE_ENV, breakage_of, broken

_FORCED: List[str] = []  # MEGATRON_VIDEO_MUTATION given to the run: that breakage for all


def pytest_configure(config):
    if os.environ.get(MODE_ENV) == "1" and os.environ.get(ENV):
        _FORCED[:] = [os.environ[ENV]]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    name = None
    if os.environ.get(MODE_ENV) == "1":
        name = _FORCED[0] if _FORCED else breakage_of(item.nodeid)
    if name is None:
        yield
        return
    os.environ[ENV] = name  # the pool sends it with each task
    try:
        with broken(name):
            yield
    finally:
        os.environ.pop(ENV, None)
