"""This rank's micro-batches and objective, built the same way by both entries (the trainer and
the Megatron-LM entry): a family's fixed-shape batches, or packed micro-batches of mixed-shape
clips when ``data.buckets`` is set (``packed_data.PackedBatchMaker``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .config import Config
from .family_spec import FamilySpec

__all__ = ["RankData", "rank_data"]


@dataclass
class RankData:
    batches: Any  # the family's micro-batch maker, or a PackedBatchMaker (data.buckets)
    objective: Any
    seq_length: int  # tokens per micro-batch the schedule is told (packed: the token budget)
    layout: Optional[object] = None  # fixed shape: the sample's layout and token geometry
    geometry: Optional[object] = None


def rank_data(
    config: Config,
    family: FamilySpec,
    groups,
    *,
    vae,
    latent_scale: float,
    cp_rank: int,
    cp_size: int,
    dp_rank: int,
    dp_size: int,
    need_latents: bool,
    log: Optional[Callable[[str], None]] = None,
) -> RankData:
    """``need_latents``: this pipeline stage reads clips (the first and the last); ``log``: where
    the packed plan is printed (the console rank)."""
    if config.data.buckets is not None:
        from .packed_data import PackedBatchMaker

        p = config.parallel
        maker = PackedBatchMaker(
            config,
            kind=family.packed_kind,
            latent_scale=latent_scale,
            cp_rank=cp_rank,
            ulysses_size=p.ulysses_size,
            ring_size=p.ring_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            log=log,
            vae=vae,
            need_latents=need_latents,
        )
        # the schedule's nominal length; with PP the stages exchange each micro-batch's shape
        # (Megatron's variable_seq_lengths: packed micro-batches vary in length)
        return RankData(maker, family.make_packed_objective(config), maker.budget)
    sample = family.sample_layout(config, cp_size)
    batches = family.make_batches(
        config,
        vae=vae,
        latent_scale=latent_scale,
        cp_rank=cp_rank,
        cp_size=cp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        layout=sample.layout,
        need_latents=need_latents,
    )
    objective = family.make_objective(config, groups, sample)
    return RankData(batches, objective, sample.seq_length, sample.layout, sample.geometry)
