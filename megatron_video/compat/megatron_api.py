"""Feature detection for Megatron-Core API differences (0.16 -> 0.19); no version comparisons."""
from __future__ import annotations

import inspect


def initialize_model_parallel(**kwargs):
    """Call ``parallel_state.initialize_model_parallel`` with the kwargs this version accepts.

    Keyword arguments the installed Megatron does not know are dropped only when they are at their
    neutral value; a non-default unknown argument raises ``ValueError`` (never silently ignored).
    """
    from megatron.core import parallel_state as ps

    params = inspect.signature(ps.initialize_model_parallel).parameters
    accepted = {k: v for k, v in kwargs.items() if k in params}
    dropped = {k: v for k, v in kwargs.items() if k not in params}
    bad = {k: v for k, v in dropped.items() if v not in (None, False, 1)}
    if bad:
        raise ValueError(f"initialize_model_parallel: this megatron-core does not support {sorted(bad)} "
                         f"(values {bad})")
    return ps.initialize_model_parallel(**accepted)
