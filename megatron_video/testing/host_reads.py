"""``count_host_reads``: counts the ``torch.Tensor`` methods that read device data on the host
(the "no host sync on the hot path" tests, docs/attention.md)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["count_host_reads", "HOST_READS"]

HOST_READS = ("cpu", "item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_reads():
    """``{method: calls}`` of :data:`HOST_READS` made inside the ``with`` block."""
    counts = {n: 0 for n in HOST_READS}
    saved = {n: getattr(torch.Tensor, n) for n in HOST_READS}

    def wrap(n):
        orig = saved[n]

        def f(self, *a, **k):
            counts[n] += 1
            return orig(self, *a, **k)

        return f

    for n in HOST_READS:
        setattr(torch.Tensor, n, wrap(n))
    try:
        yield counts
    finally:
        for n in HOST_READS:
            setattr(torch.Tensor, n, saved[n])
