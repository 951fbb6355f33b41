"""U x R context-parallel topology carved out of Megatron's CP group.

Two ways in (docs/architecture.md, "Groups"):

* ``groups_from_megatron(pg_collection, cp_comm_type)``: the default, used by the Megatron
  core-attention adapter. It reads what Megatron already has (``pg_collection`` when given, else
  ``megatron.core.parallel_state`` through its public getters), creates no group and keeps no
  state. ``cp_comm_type`` picks the scheme like Transformer Engine does: ``"a2a+p2p"`` -> Ulysses
  over Megatron's hierarchical level 0 x ring over level 1 (``initialize_model_parallel(...,
  hierarchical_context_parallel_sizes=[U, R])``), ``"p2p"`` (and None, Megatron's default) -> ring
  over the CP group, ``"a2a"`` -> Ulysses over the CP group.
* ``init_video_parallel(U)``: explicit control (placement, ranks-per-node checks, groups created
  here when Megatron's do not match), called after ``initialize_model_parallel``.
The CP group of size ``N = U*R`` splits into a Ulysses (all-to-all) group of size U and a ring
(P2P) group of size R. With ``placement="ulysses_inner"`` (default) the CP index is ``c = r*U + u``:
the Ulysses group ``{r*U + u : u}`` is contiguous in the CP group (inside a node, over NVLink) and
the ring group ``{r*U + u : r}`` is strided (across nodes). ``placement="ring_inner"`` swaps them
(``c = u*R + r``). When Megatron was initialised with ``hierarchical_context_parallel_sizes`` that
match, its groups are reused (level 0 is the contiguous one); otherwise groups are created here.

The result is kept next to Megatron's parallel state (``get_video_parallel_groups``) so that
modules built from specs (e.g. the Megatron core-attention adapter) can find it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch.distributed as dist

__all__ = [
    "CP_COMM_TYPES", "groups_from_megatron", "resolve_video_groups", "VideoParallelGroups", "init_video_parallel", "get_video_parallel_groups",
    "destroy_video_parallel", "PLACEMENTS", "cp_index", "local_groups",
]

PLACEMENTS = ("ulysses_inner", "ring_inner")
# Megatron's TransformerConfig.cp_comm_type values; None means "p2p" (Megatron's / TE's default).
CP_COMM_TYPES = ("p2p", "a2a", "a2a+p2p", "all_gather")


def cp_index(u: int, r: int, ulysses_size: int, ring_size: int, placement: str = "ulysses_inner") -> int:
    """CP index of Ulysses rank ``u`` and ring rank ``r`` (pure)."""
    return r * ulysses_size + u if placement == "ulysses_inner" else u * ring_size + r


def local_groups(cp_ranks: List[int], ulysses_size: int, ring_size: int, placement: str):
    """Pure split of one CP group's global ranks into its Ulysses and ring groups.

    Returns ``(ulysses_groups, ring_groups)``: lists of global-rank lists; ulysses group ``r`` holds
    CP indices ``cp_index(u, r)`` for all ``u`` and ring group ``u`` holds ``cp_index(u, r)`` for all ``r``.
    """
    U, R = ulysses_size, ring_size
    ug = [[cp_ranks[cp_index(u, r, U, R, placement)] for u in range(U)] for r in range(R)]
    rg = [[cp_ranks[cp_index(u, r, U, R, placement)] for r in range(R)] for u in range(U)]
    return ug, rg


@dataclass
class VideoParallelGroups:
    """Process groups and indices of this rank for 2D (Ulysses x ring) context parallelism."""

    cp_group: object
    ulysses_group: object
    ring_group: object
    tp_group: object
    dp_group: object            # data parallel, without CP
    dp_cp_group: object         # data parallel including CP (gradient reduction group)
    cp_ranks: List[int]
    ulysses_ranks: List[int]
    ring_ranks: List[int]
    ulysses_size: int
    ring_size: int
    cp_rank: int
    ulysses_rank: int
    ring_rank: int
    placement: str = "ulysses_inner"
    ranks_per_node: int = 1
    reused_megatron_groups: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def cp_size(self) -> int:
        return self.ulysses_size * self.ring_size

    def __repr__(self) -> str:  # short, for logs
        return (f"VideoParallelGroups(cp={self.cp_size}=U{self.ulysses_size}xR{self.ring_size}, "
                f"placement={self.placement}, cp_rank={self.cp_rank}, u={self.ulysses_rank}, "
                f"r={self.ring_rank}, ulysses_ranks={self.ulysses_ranks}, ring_ranks={self.ring_ranks})")


_GROUPS: Optional[VideoParallelGroups] = None


def get_video_parallel_groups(check_initialized: bool = True) -> Optional[VideoParallelGroups]:
    if _GROUPS is None and check_initialized:
        raise RuntimeError("megatron_video parallel groups are not initialised: call "
                           "megatron_video.parallel.init_video_parallel(...) after "
                           "parallel_state.initialize_model_parallel(...)")
    return _GROUPS


def destroy_video_parallel() -> None:
    """Forget the groups and destroy the ones created here (Megatron's own are left to Megatron)."""
    global _GROUPS
    if _GROUPS is not None and dist.is_initialized():
        for g in _GROUPS.extra.get("owned_groups", []):
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):  # already destroyed
                pass
    _GROUPS = None


def _resolve_ranks_per_node(ranks_per_node: Optional[int], world_size: int) -> int:
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return world_size
        try:
            ranks_per_node = int(env)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE ({env!r}) must be an integer number of ranks per node")
        source = "LOCAL_WORLD_SIZE"
    else:
        source = "ranks_per_node"
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"{source} ({ranks_per_node!r}) must be a positive integer")
    if world_size % ranks_per_node:
        raise ValueError(f"{source} ({ranks_per_node}) must divide the world size ({world_size})")
    return ranks_per_node


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")


def init_video_parallel(ulysses_size: int, ring_size: Optional[int] = None,
                        ranks_per_node: Optional[int] = None,
                        placement: str = "ulysses_inner") -> VideoParallelGroups:
    """Derive Ulysses and ring groups from Megatron's CP group and validate their placement.

    Collective over the world (group creation). Raises ``ValueError`` for invalid configurations
    before creating any group.
    """
    global _GROUPS
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised")
    cp_group = ps.get_context_parallel_group(check_initialized=False)
    if cp_group is None:
        raise RuntimeError("Megatron parallel state is not initialised: call "
                           "parallel_state.initialize_model_parallel(...) first")
    cp_size = ps.get_context_parallel_world_size()
    tp_size = ps.get_tensor_model_parallel_world_size()
    world = dist.get_world_size()

    if placement not in PLACEMENTS:
        raise ValueError(f"placement ({placement!r}) must be one of {PLACEMENTS}")
    _check_positive_int("ulysses_size", ulysses_size)
    if ring_size is None:
        if cp_size % ulysses_size:
            raise ValueError(f"ulysses_size ({ulysses_size}) must divide context_parallel_size "
                             f"({cp_size}) so that ring_size = context_parallel_size / ulysses_size")
        ring_size = cp_size // ulysses_size
    _check_positive_int("ring_size", ring_size)
    if ulysses_size * ring_size != cp_size:
        raise ValueError(f"ulysses_size * ring_size ({ulysses_size} * {ring_size} = "
                         f"{ulysses_size * ring_size}) must equal Megatron's context_parallel_size "
                         f"({cp_size})")
    rpn = _resolve_ranks_per_node(ranks_per_node, world)

    cp_ranks = list(dist.get_process_group_ranks(cp_group))  # this rank's CP group, CP-index order
    ug, rg = local_groups(cp_ranks, ulysses_size, ring_size, placement)
    me = dist.get_rank()
    my_ug = next(g for g in ug if me in g)

    # Every rank learns every CP group so that group creation is called identically everywhere,
    # and so that the placement check below gives the same verdict on every rank (no rank may
    # raise while the others go on into a collective).
    all_cp = [None] * world
    dist.all_gather_object(all_cp, cp_ranks)
    cp_groups = sorted({tuple(g) for g in all_cp})
    for g in cp_groups:
        for a2a_group in local_groups(list(g), ulysses_size, ring_size, placement)[0]:
            nodes = sorted({r // rpn for r in a2a_group})
            if len(nodes) > 1:
                raise ValueError(
                    f"ulysses_size ({ulysses_size}) with placement {placement!r}: the all-to-all "
                    f"group {a2a_group} spans nodes {nodes} at ranks_per_node ({rpn}); the Ulysses "
                    f"group must lie inside one node (tensor_model_parallel_size * ulysses_size = "
                    f"{tp_size * ulysses_size} <= ranks_per_node for 'ulysses_inner'; the whole CP "
                    f"group for 'ring_inner')")

    # Reuse Megatron's hierarchical groups when they are exactly ours.
    hier = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
    reused = False
    ulysses_group = ring_group = None
    if hier is not None and len(hier) == 2 and ulysses_size > 1 and ring_size > 1:
        sizes = [dist.get_world_size(g) for g in hier]
        lvl0 = dist.get_process_group_ranks(hier[0])
        lvl1 = dist.get_process_group_ranks(hier[1])
        my_rg = next(g for g in rg if me in g)
        if placement == "ulysses_inner" and sorted(lvl0) == sorted(my_ug) and sorted(lvl1) == sorted(my_rg):
            ulysses_group, ring_group, reused = hier[0], hier[1], True
        elif placement == "ring_inner" and sorted(lvl0) == sorted(my_rg) and sorted(lvl1) == sorted(my_ug):
            ring_group, ulysses_group, reused = hier[0], hier[1], True
        else:
            raise ValueError(
                f"hierarchical_context_parallel_sizes ({sizes}) given to Megatron do not match "
                f"ulysses_size ({ulysses_size}) x ring_size ({ring_size}) with placement "
                f"{placement!r}; use [{ulysses_size}, {ring_size}] for 'ulysses_inner' or "
                f"[{ring_size}, {ulysses_size}] for 'ring_inner'")
    owned = []
    if not reused:
        for g in cp_groups:
            gu, gr = local_groups(list(g), ulysses_size, ring_size, placement)
            for ranks in gu:
                grp = dist.new_group(ranks)
                if me in ranks:
                    ulysses_group = grp
                    owned.append(grp)
            for ranks in gr:
                grp = dist.new_group(ranks)
                if me in ranks:
                    ring_group = grp
                    owned.append(grp)

    ulysses_ranks = dist.get_process_group_ranks(ulysses_group)
    ring_ranks = dist.get_process_group_ranks(ring_group)
    cp_rank = cp_ranks.index(me)
    groups = VideoParallelGroups(
        cp_group=cp_group, ulysses_group=ulysses_group, ring_group=ring_group,
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(with_context_parallel=False),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        cp_ranks=cp_ranks, ulysses_ranks=list(ulysses_ranks), ring_ranks=list(ring_ranks),
        ulysses_size=ulysses_size, ring_size=ring_size, cp_rank=cp_rank,
        ulysses_rank=list(ulysses_ranks).index(me), ring_rank=list(ring_ranks).index(me),
        placement=placement, ranks_per_node=rpn, reused_megatron_groups=reused,
        extra={"owned_groups": owned},
    )
    _GROUPS = groups
    return groups


def check_cp_comm_type(cp_comm_type) -> str:
    """The scheme for Megatron's ``cp_comm_type`` (None -> ``"p2p"``); ``ValueError`` otherwise."""
    comm = "p2p" if cp_comm_type is None else cp_comm_type
    if comm not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type ({cp_comm_type!r}) must be one of {CP_COMM_TYPES} or None")
    if comm == "all_gather":
        raise ValueError("cp_comm_type ('all_gather') is not supported by megatron_video's 2D "
                         "attention (it would hold the whole sequence's K/V on every rank); use "
                         "'p2p' (ring), 'a2a' (Ulysses) or 'a2a+p2p' (Ulysses x ring)")
    return comm


def _pg(pg_collection, name):
    return getattr(pg_collection, name, None) if pg_collection is not None else None


def groups_from_megatron(pg_collection=None, cp_comm_type=None,
                         ranks_per_node: Optional[int] = None) -> Optional[VideoParallelGroups]:
    """U x R groups from Megatron's groups; ``None`` when there is no CP (size 1 or no state).

    ``pg_collection`` (a Megatron ``ProcessGroupCollection``) wins where it has a group (``cp``,
    ``hcp``, ``tp``, ``dp``, ``dp_cp``); the rest comes from ``megatron.core.parallel_state``'s
    public getters. Creates no process group, keeps no state and communicates nothing, so it may run
    lazily at a layer's first forward. The CP index is the rank in the CP group (what Megatron-LM's
    ``get_batch_on_this_cp_rank`` uses). For ``"a2a+p2p"`` the Ulysses group is Megatron's
    hierarchical level 0, which must be contiguous in the CP group (``c = r*U + u``), and must lie in
    one node (``ranks_per_node``, default ``LOCAL_WORLD_SIZE``); the same holds for the whole CP
    group with ``"a2a"``. Every member of a group reaches the same verdict (they see the same ranks).
    Raises ``ValueError`` naming the setting and the rule.
    """
    from megatron.core import parallel_state as ps

    comm = check_cp_comm_type(cp_comm_type)
    cp_group = _pg(pg_collection, "cp") or ps.get_context_parallel_group(check_initialized=False)
    if cp_group is None or not dist.is_initialized() or dist.get_world_size(cp_group) == 1:
        return None
    cp_ranks = list(dist.get_process_group_ranks(cp_group))
    me = dist.get_rank()
    n, cp_rank = len(cp_ranks), cp_ranks.index(me)
    if comm == "a2a":
        U, ug, rg = n, cp_group, None
    elif comm == "p2p":
        U, ug, rg = 1, None, cp_group
    else:
        hcp = _pg(pg_collection, "hcp") or ps.get_hierarchical_context_parallel_groups(
            check_initialized=False)
        if not hcp or len(hcp) != 2:
            raise ValueError(
                f"cp_comm_type ('a2a+p2p') needs two levels of hierarchical context-parallel groups "
                f"(initialize_model_parallel(..., hierarchical_context_parallel_sizes=[U, R]) or "
                f"pg_collection.hcp); got {0 if not hcp else len(hcp)}")
        ug, rg = hcp
        U = dist.get_world_size(ug)
        if U * dist.get_world_size(rg) != n:
            raise ValueError(f"hierarchical_context_parallel_sizes ([{U}, {dist.get_world_size(rg)}]) "
                             f"must multiply to context_parallel_size ({n})")
    R = n // U
    u, r = cp_rank % U, cp_rank // U
    want_u, want_r = cp_ranks[r * U:(r + 1) * U], cp_ranks[u::U]
    ulysses_ranks = list(dist.get_process_group_ranks(ug)) if ug is not None else [me]
    ring_ranks = list(dist.get_process_group_ranks(rg)) if rg is not None else [me]
    if U > 1 and R > 1 and (ulysses_ranks != want_u or ring_ranks != want_r):
        raise ValueError(
            f"hierarchical context-parallel groups (level 0 {ulysses_ranks}, level 1 {ring_ranks}) "
            f"must be the contiguous and the strided split of the CP group {cp_ranks} "
            f"(level 0 = {want_u}, level 1 = {want_r}), as initialize_model_parallel builds them")
    rpn = _resolve_ranks_per_node(ranks_per_node, dist.get_world_size())
    nodes = sorted({g // rpn for g in ulysses_ranks})
    if len(nodes) > 1:
        raise ValueError(
            f"cp_comm_type ({comm!r}): the all-to-all group {ulysses_ranks} spans nodes {nodes} at "
            f"ranks_per_node ({rpn}); the Ulysses group must lie inside one node (use 'a2a+p2p' "
            f"with hierarchical_context_parallel_sizes [U, R] and tensor_model_parallel_size * U <= "
            f"ranks_per_node, or 'p2p')")
    return VideoParallelGroups(
        cp_group=cp_group, ulysses_group=ug, ring_group=rg,
        tp_group=_pg(pg_collection, "tp") or ps.get_tensor_model_parallel_group(check_initialized=False),
        dp_group=_pg(pg_collection, "dp"), dp_cp_group=_pg(pg_collection, "dp_cp"),
        cp_ranks=cp_ranks, ulysses_ranks=ulysses_ranks, ring_ranks=ring_ranks,
        ulysses_size=U, ring_size=R, cp_rank=cp_rank, ulysses_rank=u, ring_rank=r,
        placement="ulysses_inner", ranks_per_node=rpn, reused_megatron_groups=True,
        extra={"cp_comm_type": comm})


def resolve_video_groups(groups: Optional[VideoParallelGroups] = None, pg_collection=None,
                         cp_comm_type=None) -> Optional[VideoParallelGroups]:
    """The U x R groups a module built from a spec runs on (the one rule; docs/architecture.md,
    "Groups"): ``groups`` when given; else the groups of ``init_video_parallel`` when it was called
    (explicit control, e.g. ``placement="ring_inner"``) on the CP group in use (the same group
    object: ``pg_collection.cp`` or Megatron's current one, so groups left over from an earlier
    ``initialize_model_parallel`` are never picked up); else ``groups_from_megatron(pg_collection,
    cp_comm_type)``. ``None`` without context parallelism.
    """
    if groups is not None:
        if not isinstance(groups, VideoParallelGroups):
            raise ValueError(f"groups ({type(groups).__name__}) must be None or the "
                             f"VideoParallelGroups of init_video_parallel(...)")
        return groups
    if _GROUPS is not None:
        from megatron.core import parallel_state as ps

        cp = _pg(pg_collection, "cp") or ps.get_context_parallel_group(check_initialized=False)
        if cp is not None and cp is _GROUPS.cp_group:
            return _GROUPS
    return groups_from_megatron(pg_collection, cp_comm_type)
