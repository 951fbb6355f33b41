"""Batch building, the one room both entries (the trainer and the Megatron-LM entry) take their
micro-batches from: every maker is a ``protocol.BatchSource`` (``step_batches``, ``data_state``,
``restore_data_state``, ``held_out``) built for one ``protocol.RankCoords``. Fixed shapes
(``fixed.FixedBatchMaker``, a grid of one bucket) and mixed shapes (``packed.PackedBatchMaker``,
``data.buckets``) draw their clips from the same ``clips.ClipSource`` and sample ledger."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..config import Config
from ..family_spec import FamilySpec
from .protocol import BatchSource, RankCoords, checked_step_batches

__all__ = ["RankData", "rank_data", "BatchSource", "RankCoords", "checked_step_batches"]


@dataclass
class RankData:
    batches: BatchSource
    objective: object
    seq_length: int  # tokens per micro-batch the schedule is told (packed: the token budget)
    layout: Optional[object] = None  # fixed shape: the sample's layout and token geometry
    geometry: Optional[object] = None


def rank_data(
    config: Config,
    family: FamilySpec,
    groups,
    coords: RankCoords,
    *,
    vae,
    latent_scale: float,
    log: Optional[Callable[[str], None]] = None,
) -> RankData:
    """This rank's batches and objective; ``log``: where the packed plan is printed (the console
    rank)."""
    if config.data.buckets is not None:
        from .packed import PackedBatchMaker

        maker = PackedBatchMaker(
            config, coords, kind=family.packed_kind, latent_scale=latent_scale, log=log, vae=vae
        )
        # the schedule's nominal length; with PP the stages exchange each micro-batch's shape
        # (Megatron's variable_seq_lengths: packed micro-batches vary in length)
        return RankData(maker, family.make_packed_objective(config), maker.budget)
    sample = family.sample_layout(config, coords.cp_size)
    kw = dict(vae=vae, latent_scale=latent_scale, layout=sample.layout, log=log)
    batches = family.make_batches(config, coords=coords, **kw)  # log: token placement, once
    objective = family.make_objective(config, groups, sample)
    return RankData(batches, objective, sample.seq_length, sample.layout, sample.geometry)
