"""``LiveTensors``: the peak bytes of tensor storages alive at once inside a ``with`` block, and
what held them at that moment (deterministic: counted per storage, no allocator or RSS noise).
Used by ``tests/test_attention_memory.py`` and ``benchmarks/attention_memory.py --breakdown``."""

from __future__ import annotations

import os
import traceback
from typing import Dict, List, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveTensors"]


def _where() -> str:
    """The innermost ``megatron_video`` frames of the current stack (``file:line:function``)."""
    frames = [f for f in traceback.extract_stack(limit=40) if "megatron_video" in f.filename]
    frames = [f for f in frames if not f.filename.endswith("live_memory.py")]
    return " < ".join(
        f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[::-1][:3]
    )


class LiveTensors(TorchDispatchMode):
    """Tracks every storage an aten op returns inside the block (storages that existed before,
    e.g. the inputs, are not counted): ``peak`` bytes alive at once, ``held`` = ``[(bytes, label)]``
    at the peak (label: the op and the innermost ``megatron_video`` frames that allocated it)."""

    def __init__(self, exclude: Tuple[torch.Tensor, ...] = (), resized: bool = False):
        super().__init__()
        self.resized = resized  # storages may be freed / re-allocated in place: exact peaks
        self.live: Dict[int, tuple] = {}  # keyed by the storage itself (``_cdata``), not its data
        # pointer: a storage resized in place gets a new pointer, and a new storage may take the
        # freed address of one resized to 0
        self.current = 0
        self.peak = 0
        self.held: List[Tuple[int, str]] = []
        for t in exclude:  # pre-existing storages: seen, never counted
            st = t.untyped_storage()
            self.live[st._cdata] = (StorageWeakRef(st), 0, "")

    def _sweep(self) -> None:
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if not st.data_ptr():
                continue
            if key not in self.live:
                self.live[key] = (StorageWeakRef(st), st.nbytes(), f"{func.__name__} @ {_where()}")
                self.current += st.nbytes()
            elif st.nbytes() > self.live[key][1] and self.live[key][2]:  # grown in place
                ref, n, label = self.live[key]
                self.live[key] = (ref, st.nbytes(), label)
                self.current += st.nbytes() - n
        if self.current > self.peak:
            if self.resized:  # ``current`` may overcount (``_exact``): the exact bytes then
                exact, held = self._exact()
                if exact > self.peak:
                    self.peak, self.held = exact, held
            else:
                self.peak = self.current
                self.held = sorted(
                    ((n, label) for ref, n, label in self.live.values() if n and not ref.expired()),
                    reverse=True,
                )
        return out

    def _exact(self) -> Tuple[int, List[Tuple[int, str]]]:
        """Bytes of the live storages at their current sizes (``resized``: a storage freed and
        re-allocated in place, ``resize_`` as FSDP does with gathered weights, which no op
        reports, keeps its entry). O(live storages)."""
        held = []
        for ref, n, label in self.live.values():
            if n and not ref.expired():
                now = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                if now:
                    held.append((now, label))
        held.sort(reverse=True)
        return sum(n for n, _ in held), held
