"""Megatron's torch_dist checkpoint writer, for synchronous saves.

``FileSystemWriterAsync`` (used by every ``torch_dist`` save, synchronous or not) collects its
results through the queue of a multiprocessing ``Manager`` it starts with "spawn" on a process's
first save: one more Python process per rank that re-imports the entry script (torch, Megatron:
seconds of CPU per rank) and lingers when its rank is killed. A synchronous save writes and
collects in the saving process, so a thread queue carries the same results.
"""

import importlib
import queue

__all__ = ["use_thread_results_queue"]

_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def use_thread_results_queue() -> bool:
    """Give the writer a thread queue if it has not made its Manager queue yet; True if it now
    holds one. For synchronous saves only (an async save writes from another process)."""
    writer = importlib.import_module(_WRITER)
    if getattr(writer, "_results_queue", ()) is None:  # the module global it fills lazily
        writer._results_queue = queue.Queue()
    return isinstance(getattr(writer, "_results_queue", None), queue.Queue)
