"""Exact resume at any data-parallel size: ``SampleLedger`` records the clip ids each optimizer step
consumed (JSON, never pickle); ``StepSampler`` forms each step's global batch from a seeded
per-epoch permutation of the clip ids minus the ledger's, balanced over DP ranks x micro-batches
(``data.balance``). Pure; guide: docs/data.md, "Mixed lengths and shapes".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from numbers import Integral
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..checks import check_int
from .balance import Assignment, balance_clips

__all__ = ["SampleLedger", "StepBatch", "StepSampler"]

ClipId = Union[int, str]
FORMAT = "megatron_video.sample_ledger/1"


@dataclass
class SampleLedger:
    """``steps``: ``[step, [clip ids]]`` of each step of the current ``epoch`` (in step order);
    earlier epochs are complete and only counted (``steps_before``)."""

    seed: int = 0
    epoch: int = 0
    steps: List[Tuple[int, List[ClipId]]] = field(default_factory=list)
    steps_before: int = 0
    _seen: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._seen = {c for _, ids in self.steps for c in ids}

    @property
    def next_step(self) -> int:
        """The step after the last recorded one (0 for an empty ledger)."""
        return self.steps[-1][0] + 1 if self.steps else self.steps_before

    def consumed(self) -> set:
        """Clip ids the current epoch has consumed."""
        return set(self._seen)

    def record(self, step: int, clip_ids: Sequence[ClipId]) -> None:
        if step != self.next_step:
            raise ValueError(f"step ({step}) must be the ledger's next step ({self.next_step})")
        again = [c for c in clip_ids if c in self._seen]
        if again or len(set(clip_ids)) != len(clip_ids):
            raise ValueError(
                f"step {step}: clip ids {again[:5] or list(clip_ids)[:5]} must not repeat within "
                f"epoch {self.epoch}"
            )
        self.steps.append((step, list(clip_ids)))
        self._seen.update(clip_ids)

    def next_epoch(self) -> None:
        self.steps_before = self.next_step
        self.steps, self.epoch, self._seen = [], self.epoch + 1, set()

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "seed": self.seed,
                "epoch": self.epoch,
                "steps_before": self.steps_before,
                "steps": [[s, ids] for s, ids in self.steps],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "SampleLedger":
        try:
            blob = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"sample ledger is not JSON: {e}") from None
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise ValueError(f"sample ledger must be a {FORMAT} JSON document")
        try:
            steps = [(int(s), list(ids)) for s, ids in blob["steps"]]
            return cls(int(blob["seed"]), int(blob["epoch"]), steps, int(blob["steps_before"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"sample ledger is malformed ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step: ``bins[d][m]`` are the clip ids of micro-batch ``m`` of DP rank ``d``;
    ``assignment`` indexes ``clip_ids`` (the step's clips in permutation order)."""

    step: int
    epoch: int
    clip_ids: Tuple[ClipId, ...]
    bins: Tuple[Tuple[Tuple[ClipId, ...], ...], ...]
    assignment: Assignment


class StepSampler:
    """Global batches of clips for ``dp_size`` ranks x ``num_microbatches`` micro-batches.

    Epoch ``e`` visits the clip ids (sorted) in the permutation seeded by ``(seed, e)``, skipping
    those the ledger's epoch already consumed. A step takes the next clips in that order while
    their tokens fit ``dp_size * num_microbatches * tokens_per_microbatch`` (and at most
    ``max_clips``), then ``balance_clips`` them by cost; a clip that does not fit goes first into
    the next step. The last step of an epoch takes what is left (micro-batches may stay empty
    when it has fewer clips than ``dp_size * num_microbatches``). Every step is recorded in
    ``ledger``: a resume with the saved ledger, at any DP size, consumes each clip exactly once
    per epoch.
    """

    def __init__(
        self,
        clip_ids: Sequence[ClipId],
        tokens: Sequence[int],
        costs: Sequence[float],
        *,
        dp_size: int,
        num_microbatches: int,
        tokens_per_microbatch: int,
        seed: int = 0,
        max_clips: Optional[int] = None,
        ledger: Optional[SampleLedger] = None,
    ):
        self.ids = _check_ids(clip_ids, tokens, costs)
        order = sorted(range(len(self.ids)), key=lambda i: self.ids[i])
        self.ids = [self.ids[i] for i in order]
        self.tokens = [int(tokens[i]) for i in order]
        self.costs = [float(costs[i]) for i in order]
        self.index: Dict[ClipId, int] = {c: i for i, c in enumerate(self.ids)}
        self.dp_size = check_int("dp_size", dp_size, 1)
        self.num_microbatches = check_int("num_microbatches", num_microbatches, 1)
        self.budget = check_int("tokens_per_microbatch", tokens_per_microbatch, 1)
        self.max_clips = max_clips if max_clips is None else check_int("max_clips", max_clips, 1)
        check_int("seed", seed, 0)
        over = [c for c, t in zip(self.ids, self.tokens) if not 1 <= t <= self.budget]
        if over:
            raise ValueError(
                f"clip {over[0]!r}: tokens ({self.tokens[self.index[over[0]]]}) must be in "
                f"[1, tokens_per_microbatch={self.budget}]"
            )
        self.ledger = ledger if ledger is not None else SampleLedger(seed=seed)
        if self.ledger.seed != seed:
            raise ValueError(f"seed ({seed}) must equal the ledger's seed ({self.ledger.seed})")
        unknown = [c for c in self.ledger.consumed() if c not in self.index]
        if unknown:
            raise ValueError(f"the ledger names clip ids {sorted(unknown)[:5]} not in clip_ids")
        self._start_queue()

    def permutation(self, epoch: int) -> List[ClipId]:
        """The clip ids in epoch ``epoch``'s order."""
        rng = np.random.default_rng([self.ledger.seed, epoch])
        return [self.ids[i] for i in rng.permutation(len(self.ids))]

    def _start_queue(self) -> None:
        done = self.ledger.consumed()
        self.queue = [c for c in self.permutation(self.ledger.epoch) if c not in done]
        self.cursor = 0

    def next_step(self) -> StepBatch:
        """The next step's batch (recorded in the ledger)."""
        if self.cursor == len(self.queue):
            self.ledger.next_epoch()
            self._start_queue()
        take = self._take()
        while True:
            idx = [self.index[c] for c in take]
            try:
                a = balance_clips(
                    [self.costs[i] for i in idx],
                    [self.tokens[i] for i in idx],
                    self.dp_size,
                    self.num_microbatches,
                    self.budget,
                )
                break
            except ValueError:
                if len(take) == 1:
                    raise
                take = take[:-1]  # packing failed: the last clip waits for the next step
        step = self.ledger.next_step
        self.ledger.record(step, take)
        self.cursor += len(take)
        bins = tuple(tuple(tuple(take[i] for i in b) for b in rank) for rank in a.bins)
        return StepBatch(step, self.ledger.epoch, tuple(take), bins, a)

    def _take(self) -> List[ClipId]:
        cap = self.dp_size * self.num_microbatches * self.budget
        take, total = [], 0
        for j in range(self.cursor, len(self.queue)):
            c = self.queue[j]
            t = self.tokens[self.index[c]]
            if (take and total + t > cap) or len(take) == (self.max_clips or -1):
                break
            take.append(c)
            total += t
        return take


def _check_ids(clip_ids, tokens, costs) -> List[ClipId]:
    ids = list(clip_ids)
    if not ids or len(tokens) != len(ids) or len(costs) != len(ids):
        raise ValueError(
            f"clip_ids ({len(ids)}), tokens ({len(tokens)}) and costs ({len(costs)}) must be "
            f"non-empty and of equal length"
        )
    if not (all(isinstance(c, str) for c in ids) or all(_is_int(c) for c in ids)):
        raise ValueError("clip_ids must be all strings or all integers (JSON-serialisable keys)")
    if len(set(ids)) != len(ids):
        dup = sorted({c for c in ids if ids.count(c) > 1})[:5]
        raise ValueError(f"clip_ids must be unique; repeated: {dup}")
    return [int(c) if _is_int(c) else c for c in ids]


def _is_int(c) -> bool:
    return isinstance(c, Integral) and not isinstance(c, bool)
