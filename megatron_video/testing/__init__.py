"""Test and benchmark support, importable without pytest: a pool of gloo worker processes
(``pool.WorkerPool``), float64 attention oracles (``oracles``), mask oracles (``masks``), Megatron
set-up context managers (``parallel``) and tiny model configs (``configs``). Nothing in
``megatron_video`` outside this package imports it."""

from .pool import RankError, WorkerPool

__all__ = ["RankError", "WorkerPool"]
