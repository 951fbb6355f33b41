"""What every batch maker is (``BatchSource``, the one interface both entries call) and where a
rank sits (``RankCoords``, built once per rank and passed instead of loose sizes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Protocol, runtime_checkable

from megatron_video.checks import check_positive_int, check_rank
from megatron_video.data.ledger import SampleLedger

__all__ = ["RankCoords", "BatchSource", "LedgerSteps", "checked_step_batches"]


@dataclass(frozen=True)
class RankCoords:
    """One rank's place in the job: data-parallel rank / size, context-parallel rank in its
    ``U x R`` group, and whether its pipeline stage is the first / last (those read clips)."""

    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    ulysses_size: int = 1
    ring_size: int = 1
    first_stage: bool = True
    last_stage: bool = True

    def __post_init__(self):
        for name in ("dp_size", "ulysses_size", "ring_size"):
            check_positive_int(f"RankCoords.{name}", getattr(self, name))
        check_rank("RankCoords.dp_rank", self.dp_rank, self.dp_size, "dp_size")
        check_rank("RankCoords.cp_rank", self.cp_rank, self.cp_size, "cp_size")

    @property
    def cp_size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def need_latents(self) -> bool:
        """Whether this stage reads clips (the first and the last)."""
        return self.first_stage or self.last_stage


@runtime_checkable
class BatchSource(Protocol):
    """A rank's micro-batches: ``step_batches(step)`` (the steps in order from the data state);
    ``data_state(step)`` JSON of the position as of ``step`` (the sample ledger; None:
    stateless) and ``restore_data_state``; ``held_out()`` the evaluation draws;
    ``replay_to(step)`` advances without reading data; ``restart()`` back to step 0."""

    num_microbatches: int

    def step_batches(self, step: int) -> Iterator: ...

    def data_state(self, step: Optional[int] = None) -> Optional[str]: ...

    def restore_data_state(self, text: Optional[str]) -> None: ...

    def held_out(self) -> "BatchSource": ...

    def replay_to(self, step: int) -> None: ...

    def restart(self) -> None: ...


class LedgerSteps:
    """The sample-ledger half every batch maker shares: its data state, resume, replay and the
    step order. A subclass builds its ``StepSampler`` in ``_sampler(ledger)`` (None: a new one)
    and draws each step's clips through ``_draw(step)``."""

    sampler = None
    _before: Optional[str] = None

    def _sampler(self, ledger):  # pragma: no cover - every maker defines it
        raise NotImplementedError

    def data_state(self, step: Optional[int] = None) -> str:
        """The ledger as of the start of ``step`` (default: after the last drawn step)."""
        ledger = self.sampler.ledger
        if step is None or step == ledger.next_step:
            return ledger.to_json()
        if step == ledger.next_step - 1 and self._before is not None:
            return self._before
        raise ValueError(
            f"step ({step}) must be the ledger's next step ({ledger.next_step}) or the one before"
        )

    def restore_data_state(self, text: Optional[str]) -> None:
        if text is None:
            raise ValueError("checkpoint holds no sample ledger; the data order cannot be resumed")
        self.sampler = self._sampler(SampleLedger.from_json(text))

    def replay_to(self, step: int) -> None:
        """Advance the ledger to the start of ``step`` by drawing the steps before it (no data is
        read): a resume at the same global batch, any DP size, without a saved ledger (Megatron-LM's
        ``pretrain()`` checkpoints only its iteration). ``ValueError`` if ``step`` is behind."""
        if step < self.sampler.ledger.next_step:
            raise ValueError(
                f"step ({step}) must not be before the sample ledger's next step "
                f"({self.sampler.ledger.next_step})"
            )
        while self.sampler.ledger.next_step < step:
            self.sampler.next_step()

    def restart(self) -> None:
        """Back to an empty ledger (step 0): e.g. every evaluation draws the same micro-batches."""
        self.sampler, self._before = self._sampler(None), None

    def _draw(self, step: int):
        """The clips of ``step``, which must be the ledger's next step (its state kept before)."""
        nxt = self.sampler.ledger.next_step
        if step != nxt:
            raise ValueError(f"step ({step}) must be the sample ledger's next step ({nxt})")
        self._before = self.sampler.ledger.to_json()
        return self.sampler.next_step()


def checked_step_batches(source: BatchSource, step: int, group=None) -> Iterator:
    """``source.step_batches(step)``, as every entry calls it: a clip is read while the batches
    are built; a clip that fails raises ``ValueError`` on every rank of ``group`` (one status
    all-reduce before the step's first model collective; default: the world), the failing rank's
    naming the clip. Call it where every rank of ``group`` calls it at once: the trainer before
    the schedule (world); Megatron-LM's ``forward_step``, inside the schedule, with its pipeline
    stage's ranks."""
    import torch
    import torch.distributed as dist

    from megatron_video.parallel import comm

    group = dist.group.WORLD if group is None else group
    failed, error, batches = torch.zeros(1), None, []
    try:
        batches = list(source.step_batches(step))
    except ValueError as e:  # re-raised below, after every rank knows
        failed[0], error = 1, e
    comm.all_reduce(failed, group, tag="data.status")
    if error is not None:
        raise error
    if failed.item():
        raise ValueError(
            f"step {step}: a clip failed to load on {int(failed.item())} other rank(s) (its "
            f"ValueError names the clip)"
        )
    return iter(batches)
