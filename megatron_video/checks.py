"""Ground-floor validators every layer may import (it imports nothing of megatron_video): one home
for each small rule, raising ``ValueError`` that names the parameter, its value and the rule."""

from __future__ import annotations

from numbers import Integral

__all__ = ["check_int", "check_positive_int", "check_nonneg_int", "check_rank", "check_dim"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int) -> int:
    """``value`` if it is an int (not a bool) ``>= minimum``, else ``ValueError`` naming it."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} ({value!r}) must be an integer >= {minimum}")
    return value


def check_positive_int(name: str, value) -> int:
    """``check_int(name, value, 1)``, worded "a positive integer"."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")
    return value


def check_nonneg_int(name: str, value) -> int:
    """``check_int(name, value, 0)``, worded "a non-negative integer"."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} ({value!r}) must be a non-negative integer")
    return value


def check_rank(name: str, value, size: int, size_name: str) -> int:
    """``value`` if it is an int (not a bool) in ``[0, size)``; the message names ``size_name``."""
    if not _is_int(value) or not 0 <= value < size:
        raise ValueError(f"{name} ({value!r}) must be an integer in [0, {size_name} ({size}))")
    return value


def check_dim(name: str, dim: int, x) -> int:
    """``dim`` normalised to ``[0, x.dim())``; ``ValueError`` outside ``[-x.dim(), x.dim())``."""
    nd = x.dim()
    if isinstance(dim, bool) or not isinstance(dim, Integral) or not -nd <= dim < nd:
        raise ValueError(
            f"{name} ({dim!r}) must be an integer in [-{nd}, {nd}) for a {nd}-D tensor "
            f"{tuple(x.shape)}"
        )
    return int(dim) % nd
