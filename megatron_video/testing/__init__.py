"""Test and benchmark support: a pool of gloo worker processes (see ``pool.WorkerPool``)."""
from .pool import RankError, WorkerPool

__all__ = ["RankError", "WorkerPool"]
