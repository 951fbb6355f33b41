"""Named breakages and the tests that must catch them (``tests/test_mutations.py``).

Each breakage switches one guarded feature off. ``MEGATRON_VIDEO_MUTATIONS=1`` turns a pytest run
into the mutation check (the pytest plugin ``testing.mutation_plugin``): every test listed in
``GUARDS`` runs with its breakage applied (in the test process and, per task, in the worker pool's
ranks, which read ``MEGATRON_VIDEO_MUTATION``), and must fail. A new resume, loading or caching
feature adds its breakage and its guards here. ``MEGATRON_VIDEO_MUTATIONS=1
MEGATRON_VIDEO_MUTATION=NAME pytest ...`` runs any tests under one breakage. Imports neither pytest
nor Megatron (the breakages import what they patch when applied).
"""

import contextlib
from typing import Callable, Dict, Iterator, List

__all__ = ["BREAKAGES", "GUARDS", "ENV", "MODE_ENV", "broken", "breakage_of"]

ENV = "MEGATRON_VIDEO_MUTATION"  # the breakage of the running test (read by the pool's ranks)
MODE_ENV = "MEGATRON_VIDEO_MUTATIONS"  # "1": run the guards with their breakages


def _resume_from_scratch():
    from megatron_video.training.trainer import Trainer

    return Trainer, "maybe_resume", lambda self: 0


def _init_from_ignored():
    from megatron_video.training import checkpoint

    return checkpoint, "load_model_weights", lambda directory, model, step=None: 0


def _optimizer_state_dropped():
    """Silently: the state loads, then Adam's moments are zeroed (its step count and the rest
    kept, so the next step runs and only its values tell)."""
    import torch

    from megatron_video.training import checkpoint

    load = checkpoint.load_optimizer_state

    def dropped(optimizer, state):
        load(optimizer, state)
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            for moments in opt.optimizer.state.values():
                for v in moments.values():
                    if isinstance(v, torch.Tensor) and v.dim():
                        v.zero_()

    return checkpoint, "load_optimizer_state", dropped


def _stale_cache():
    from megatron_video.generation import streaming

    return streaming, "_appended", lambda last_input, clean: last_input


def _ledger_replays_a_clip():
    from megatron_video.data.ledger import StepSampler

    start = StepSampler._start_queue

    def replaying(self):  # the first clip the epoch consumed comes back
        start(self)
        done = sorted(self.ledger.consumed(), key=str)
        if done:
            self.queue.insert(0, done[0])

    return StepSampler, "_start_queue", replaying


BREAKAGES: Dict[str, Callable] = {
    "resume_from_scratch": _resume_from_scratch,
    "init_from_ignored": _init_from_ignored,
    "optimizer_state_dropped": _optimizer_state_dropped,
    "stale_cache": _stale_cache,
    "ledger_replays_a_clip": _ledger_replays_a_clip,
}

# breakage -> the tests (node ids) that must fail under it: the cheapest that guard it
GUARDS: Dict[str, List[str]] = {
    "resume_from_scratch": [
        "tests/test_reliability.py::test_resume_under_another_layout",
        "tests/test_train_mixed.py::test_short_run_then_resume_at_another_dp_size",
        "tests/test_wan_raw_train.py::test_train_from_raw_clips_and_resume",
    ],
    "init_from_ignored": ["tests/test_grpo_train.py::test_train_encoder_and_init_from"],
    "optimizer_state_dropped": ["tests/test_fsdp.py::test_checkpoint_moves_between_fsdp_and_ddp"],
    "stale_cache": [
        "tests/test_generation.py::test_cached_generator_equals_no_cache_oracles[ar_dit]",
    ],
    "ledger_replays_a_clip": [
        "tests/test_balance.py::test_every_clip_exactly_once_across_an_interruption",
    ],
}


@contextlib.contextmanager
def broken(name) -> Iterator[None]:
    """Apply breakage ``name`` (none when ``name`` is falsy) for the duration."""
    if not name:
        yield
        return
    if name not in BREAKAGES:
        raise ValueError(f"{ENV} ({name!r}) must be one of {sorted(BREAKAGES)}")
    owner, attr, replacement = BREAKAGES[name]()
    saved = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    setattr(owner, attr, replacement)
    try:
        yield
    finally:
        setattr(owner, attr, saved)


def breakage_of(nodeid: str):
    """The breakage test ``nodeid`` guards (a parametrized id counts for its function), or None."""
    base = nodeid.split("[")[0]
    names = [name for name, ids in GUARDS.items() if nodeid in ids or base in ids]
    if len(names) > 1:  # pragma: no cover - checked by tests/test_mutations.py
        raise ValueError(f"{nodeid} guards {names}: one breakage per test")
    return names[0] if names else None
