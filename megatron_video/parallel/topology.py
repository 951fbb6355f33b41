"""U x R context-parallel topology carved out of Megatron's CP group: groups from Megatron
(``groups_from_megatron``) or explicit (``init_video_parallel``), and the node-placement rule
(``check_ulysses_in_node``). Design: docs/architecture.md, "Groups".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch.distributed as dist

from ..checks import check_positive_int
from .comm import drop_host_groups

__all__ = [
    "CP_COMM_TYPES",
    "groups_from_megatron",
    "resolve_video_groups",
    "VideoParallelGroups",
    "init_video_parallel",
    "get_video_parallel_groups",
    "destroy_video_parallel",
    "PLACEMENTS",
    "cp_index",
    "local_groups",
    "check_ranks_per_node",
    "check_ulysses_in_node",
    "default_cp_groups",
]

PLACEMENTS = ("ulysses_inner", "ring_inner")
# Megatron's TransformerConfig.cp_comm_type values; None means "p2p" (Megatron's / TE's default).
CP_COMM_TYPES = ("p2p", "a2a", "a2a+p2p", "all_gather")


def cp_index(
    u: int, r: int, ulysses_size: int, ring_size: int, placement: str = "ulysses_inner"
) -> int:
    """CP index of Ulysses rank ``u`` and ring rank ``r`` (pure): ``c = r*U + u`` with
    ``placement="ulysses_inner"`` (the Ulysses group is contiguous in the CP group: inside a node),
    ``c = u*R + r`` with ``"ring_inner"`` (the ring group is contiguous)."""
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
    dp_group: object  # data parallel, without CP
    dp_cp_group: object  # data parallel including CP (gradient reduction group)
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
        return (
            f"VideoParallelGroups(cp={self.cp_size}=U{self.ulysses_size}xR{self.ring_size}, "
            f"placement={self.placement}, cp_rank={self.cp_rank}, u={self.ulysses_rank}, "
            f"r={self.ring_rank}, ulysses_ranks={self.ulysses_ranks}, ring_ranks={self.ring_ranks})"
        )


_GROUPS: Optional[VideoParallelGroups] = None


def get_video_parallel_groups(check_initialized: bool = True) -> Optional[VideoParallelGroups]:
    if _GROUPS is None and check_initialized:
        raise RuntimeError(
            "megatron_video parallel groups are not initialised: call "
            "megatron_video.parallel.init_video_parallel(...) after "
            "parallel_state.initialize_model_parallel(...)"
        )
    return _GROUPS


def destroy_video_parallel() -> None:
    """Forget the groups and destroy the ones created here (Megatron's own are left to Megatron),
    host groups (``comm.host_group``) included."""
    global _GROUPS
    if dist.is_initialized():
        drop_host_groups()
    if _GROUPS is not None and dist.is_initialized():
        for g in _GROUPS.extra.get("owned_groups", []):
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):  # already destroyed
                pass
    _GROUPS = None


def check_ranks_per_node(ranks_per_node, world_size: int, name: str = "ranks_per_node") -> int:
    """``ranks_per_node`` checked: a positive integer that divides ``world_size`` (pure)."""
    check_positive_int(name, ranks_per_node)
    if world_size % ranks_per_node:
        raise ValueError(f"{name} ({ranks_per_node}) must divide the world size ({world_size})")
    return ranks_per_node


def _resolve_ranks_per_node(ranks_per_node: Optional[int], world_size: int) -> int:
    if ranks_per_node is not None:
        return check_ranks_per_node(ranks_per_node, world_size)
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is None:
        return world_size
    try:
        value = int(env)
    except ValueError:
        raise ValueError(
            f"LOCAL_WORLD_SIZE ({env!r}) must be an integer number of ranks per node"
        ) from None
    return check_ranks_per_node(value, world_size, "LOCAL_WORLD_SIZE")


def default_cp_groups(world_size: int, tp_size: int, cp_size: int) -> List[List[int]]:
    """Global ranks of every CP group, in CP-index order, under Megatron's default rank order
    (``"tp-cp-ep-dp-pp"``: TP fastest, then CP), as ``initialize_model_parallel`` builds them
    (pure)."""
    block = tp_size * cp_size
    return [
        [base + t + tp_size * c for c in range(cp_size)]
        for base in range(0, world_size, block)
        for t in range(tp_size)
    ]


def check_ulysses_in_node(
    cp_groups: Sequence[Sequence[int]],
    ulysses_size: int,
    ring_size: int,
    ranks_per_node: int,
    placement: str = "ulysses_inner",
    tp_size: int = 1,
    prefix: str = "",
    setting: Optional[str] = None,
    hint: Optional[str] = None,
) -> None:
    """The node-placement rule, in one place: every Ulysses (all-to-all) group of every CP group
    must lie inside one node (rank ``g`` is on node ``g // ranks_per_node``). Pure: no collectives,
    so callers that see the same ``cp_groups`` reach the same verdict on every rank.

    ``cp_groups``: global ranks of each CP group in CP-index order (``default_cp_groups`` for a
    configuration not yet running). ``prefix`` names the parameters as the caller's user knows them
    (``"parallel."`` in a training config); ``setting`` replaces the leading "which setting" part of
    the message (e.g. ``"cp_comm_type ('a2a')"``) and ``hint`` is appended to it.
    Raises ``ValueError`` naming the parameters, their values and the rule.
    """
    U, R, rpn, p = ulysses_size, ring_size, ranks_per_node, prefix
    for cp in cp_groups:
        for group in local_groups(list(cp), U, R, placement)[0]:
            nodes = sorted({g // rpn for g in group})
            if len(nodes) < 2:
                continue
            tp = f"tensor_model_parallel_size ({tp_size})"
            if placement == "ring_inner":
                rule = (
                    f"{p}context_parallel_size ({U * R}) x {tp} must be <= "
                    f"{p}ranks_per_node ({rpn}) and divide it for {p}placement 'ring_inner' "
                    f"with {p}ulysses_size ({U}) > 1: the all-to-all group strides over the "
                    f"ring, so the whole CP group must lie inside one node"
                )
            else:
                rule = (
                    f"{p}ulysses_size ({U}) x {tp} must be <= {p}ranks_per_node ({rpn}) and "
                    f"divide it"
                )
            head = setting or f"{p}ulysses_size ({U}) with {p}placement {placement!r}"
            raise ValueError(
                f"{head}: the all-to-all group {list(group)} spans nodes {nodes} at "
                f"{p}ranks_per_node ({rpn}); the Ulysses group must lie inside one "
                f"node ({rule})" + (f"; {hint}" if hint else "")
            )


def init_video_parallel(
    ulysses_size: int,
    ring_size: Optional[int] = None,
    ranks_per_node: Optional[int] = None,
    placement: str = "ulysses_inner",
) -> VideoParallelGroups:
    """Derive Ulysses and ring groups from Megatron's CP group and validate their placement.

    Three steps: placement (sizes, ranks per node, every CP group's Ulysses groups inside a node),
    reuse (Megatron's hierarchical CP groups when they are exactly ours), creation (otherwise).
    Collective over the world (group creation). Raises ``ValueError`` for invalid configurations
    before creating any group.
    """
    global _GROUPS
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised")
    cp_group = ps.get_context_parallel_group(check_initialized=False)
    if cp_group is None:
        raise RuntimeError(
            "Megatron parallel state is not initialised: call "
            "parallel_state.initialize_model_parallel(...) first"
        )
    ring_size, rpn, cp_groups = _placement(
        ps, cp_group, ulysses_size, ring_size, ranks_per_node, placement
    )
    cp_ranks = list(dist.get_process_group_ranks(cp_group))  # this rank's CP group, CP-index order
    pair, owned = _reuse_megatron_groups(ps, cp_ranks, ulysses_size, ring_size, placement), []
    reused = pair is not None
    if not reused:
        pair, owned = _create_groups(cp_groups, ulysses_size, ring_size, placement)
    ulysses_group, ring_group = pair
    ulysses_ranks = list(dist.get_process_group_ranks(ulysses_group))
    ring_ranks = list(dist.get_process_group_ranks(ring_group))
    me = dist.get_rank()
    _GROUPS = VideoParallelGroups(
        cp_group=cp_group,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(with_context_parallel=False),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        cp_ranks=cp_ranks,
        ulysses_ranks=ulysses_ranks,
        ring_ranks=ring_ranks,
        ulysses_size=ulysses_size,
        ring_size=ring_size,
        cp_rank=cp_ranks.index(me),
        ulysses_rank=ulysses_ranks.index(me),
        ring_rank=ring_ranks.index(me),
        placement=placement,
        ranks_per_node=rpn,
        reused_megatron_groups=reused,
        extra={"owned_groups": owned},
    )
    return _GROUPS


def _placement(ps, cp_group, ulysses_size, ring_size, ranks_per_node, placement):
    """Placement step of ``init_video_parallel``: ``(ring_size, ranks_per_node, cp_groups)``.

    Every rank learns every CP group (one ``all_gather_object``) so that group creation is called
    identically everywhere and the node check gives the same verdict on every rank (no rank may
    raise while the others go on into a collective).
    """
    cp_size = ps.get_context_parallel_world_size()
    world = dist.get_world_size()
    if placement not in PLACEMENTS:
        raise ValueError(f"placement ({placement!r}) must be one of {PLACEMENTS}")
    check_positive_int("ulysses_size", ulysses_size)
    if ring_size is None:
        if cp_size % ulysses_size:
            raise ValueError(
                f"ulysses_size ({ulysses_size}) must divide context_parallel_size "
                f"({cp_size}) so that ring_size = context_parallel_size / ulysses_size"
            )
        ring_size = cp_size // ulysses_size
    check_positive_int("ring_size", ring_size)
    if ulysses_size * ring_size != cp_size:
        raise ValueError(
            f"ulysses_size * ring_size ({ulysses_size} * {ring_size} = "
            f"{ulysses_size * ring_size}) must equal Megatron's context_parallel_size "
            f"({cp_size})"
        )
    rpn = _resolve_ranks_per_node(ranks_per_node, world)
    all_cp = [None] * world
    dist.all_gather_object(all_cp, list(dist.get_process_group_ranks(cp_group)))
    cp_groups = sorted({tuple(g) for g in all_cp})
    check_ulysses_in_node(
        cp_groups,
        ulysses_size,
        ring_size,
        rpn,
        placement,
        tp_size=ps.get_tensor_model_parallel_world_size(),
    )
    return ring_size, rpn, cp_groups


def _reuse_megatron_groups(ps, cp_ranks, ulysses_size, ring_size, placement):
    """Reuse step: Megatron's hierarchical CP groups as ``(ulysses_group, ring_group)`` when they
    are exactly ours; ``None`` when there are none to reuse; ``ValueError`` when they disagree."""
    hier = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
    if hier is None or len(hier) != 2 or ulysses_size == 1 or ring_size == 1:
        return None
    ug, rg = local_groups(cp_ranks, ulysses_size, ring_size, placement)
    me = dist.get_rank()
    my_ug, my_rg = (sorted(next(g for g in gs if me in g)) for gs in (ug, rg))
    lvl0, lvl1 = (sorted(dist.get_process_group_ranks(g)) for g in hier)
    if placement == "ulysses_inner" and (lvl0, lvl1) == (my_ug, my_rg):
        return hier[0], hier[1]
    if placement == "ring_inner" and (lvl0, lvl1) == (my_rg, my_ug):
        return hier[1], hier[0]
    sizes = [dist.get_world_size(g) for g in hier]
    raise ValueError(
        f"hierarchical_context_parallel_sizes ({sizes}) given to Megatron do not match "
        f"ulysses_size ({ulysses_size}) x ring_size ({ring_size}) with placement "
        f"{placement!r}; use [{ulysses_size}, {ring_size}] for 'ulysses_inner' or "
        f"[{ring_size}, {ulysses_size}] for 'ring_inner'"
    )


def _create_groups(cp_groups, ulysses_size, ring_size, placement):
    """Creation step: new Ulysses and ring groups for every CP group (``dist.new_group`` is called
    identically on every rank). Returns ``((ulysses_group, ring_group), owned_groups)``."""
    me = dist.get_rank()
    mine, owned = [None, None], []
    for g in cp_groups:
        for kind, groups in enumerate(local_groups(list(g), ulysses_size, ring_size, placement)):
            for ranks in groups:
                grp = dist.new_group(ranks)
                if me in ranks:
                    mine[kind] = grp
                    owned.append(grp)
    return tuple(mine), owned


def check_cp_comm_type(cp_comm_type) -> str:
    """The scheme for Megatron's ``cp_comm_type`` (None -> ``"p2p"``); ``ValueError`` otherwise."""
    comm = "p2p" if cp_comm_type is None else cp_comm_type
    if comm not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type ({cp_comm_type!r}) must be one of {CP_COMM_TYPES} or None")
    if comm == "all_gather":
        raise ValueError(
            "cp_comm_type ('all_gather') is not supported by megatron_video's 2D "
            "attention (it would hold the whole sequence's K/V on every rank); use "
            "'p2p' (ring), 'a2a' (Ulysses) or 'a2a+p2p' (Ulysses x ring)"
        )
    return comm


def _pg(pg_collection, name):
    return getattr(pg_collection, name, None) if pg_collection is not None else None


def _megatron_ulysses_ring(comm: str, cp_group, n: int, pg_collection):
    """``(U, ulysses group, ring group)`` of a CP group of ``n`` ranks for ``cp_comm_type``
    ``comm``: the whole group is Ulysses (``a2a``) or ring (``p2p``), or for ``a2a+p2p``
    Megatron's two hierarchical levels."""
    from megatron.core import parallel_state as ps

    if comm == "a2a":
        return n, cp_group, None
    if comm == "p2p":
        return 1, None, cp_group
    hcp = _pg(pg_collection, "hcp") or ps.get_hierarchical_context_parallel_groups(
        check_initialized=False
    )
    if not hcp or len(hcp) != 2:
        raise ValueError(
            f"cp_comm_type ('a2a+p2p') needs two levels of hierarchical context-parallel groups "
            f"(initialize_model_parallel(..., hierarchical_context_parallel_sizes=[U, R]) or "
            f"pg_collection.hcp); got {0 if not hcp else len(hcp)}"
        )
    ug, rg = hcp
    U = dist.get_world_size(ug)
    if U * dist.get_world_size(rg) != n:
        raise ValueError(
            f"hierarchical_context_parallel_sizes ([{U}, {dist.get_world_size(rg)}]) "
            f"must multiply to context_parallel_size ({n})"
        )
    return U, ug, rg


def groups_from_megatron(
    pg_collection=None, cp_comm_type=None, ranks_per_node: Optional[int] = None
) -> Optional[VideoParallelGroups]:
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
    U, ug, rg = _megatron_ulysses_ring(comm, cp_group, n, pg_collection)
    R = n // U
    u, r = cp_rank % U, cp_rank // U
    want_u, want_r = cp_ranks[r * U : (r + 1) * U], cp_ranks[u::U]
    ulysses_ranks = list(dist.get_process_group_ranks(ug)) if ug is not None else [me]
    ring_ranks = list(dist.get_process_group_ranks(rg)) if rg is not None else [me]
    if U > 1 and R > 1 and (ulysses_ranks != want_u or ring_ranks != want_r):
        raise ValueError(
            f"hierarchical context-parallel groups (level 0 {ulysses_ranks}, level 1 {ring_ranks}) "
            f"must be the contiguous and the strided split of the CP group {cp_ranks} "
            f"(level 0 = {want_u}, level 1 = {want_r}), as initialize_model_parallel builds them"
        )
    rpn = _resolve_ranks_per_node(ranks_per_node, dist.get_world_size())
    tp_group = _pg(pg_collection, "tp") or ps.get_tensor_model_parallel_group(
        check_initialized=False
    )
    check_ulysses_in_node(
        [cp_ranks],
        U,
        R,
        rpn,
        tp_size=dist.get_world_size(tp_group) if tp_group is not None else 1,
        setting=f"cp_comm_type ({comm!r})",
        hint="use 'a2a+p2p' with hierarchical_context_parallel_sizes [U, R], or 'p2p'",
    )
    return VideoParallelGroups(
        cp_group=cp_group,
        ulysses_group=ug,
        ring_group=rg,
        tp_group=tp_group,
        dp_group=_pg(pg_collection, "dp"),
        dp_cp_group=_pg(pg_collection, "dp_cp"),
        cp_ranks=cp_ranks,
        ulysses_ranks=ulysses_ranks,
        ring_ranks=ring_ranks,
        ulysses_size=U,
        ring_size=R,
        cp_rank=cp_rank,
        ulysses_rank=u,
        ring_rank=r,
        placement="ulysses_inner",
        ranks_per_node=rpn,
        reused_megatron_groups=True,
        extra={"cp_comm_type": comm},
    )


def resolve_video_groups(
    groups: Optional[VideoParallelGroups] = None, pg_collection=None, cp_comm_type=None
) -> Optional[VideoParallelGroups]:
    """The U x R groups a module built from a spec runs on (the one rule; docs/architecture.md,
    "Groups"): ``groups`` when given; else the groups of ``init_video_parallel`` when it was called
    (explicit control, e.g. ``placement="ring_inner"``) on the CP group in use (the same group
    object: ``pg_collection.cp`` or Megatron's current one, so groups left over from an earlier
    ``initialize_model_parallel`` are never picked up); else ``groups_from_megatron(pg_collection,
    cp_comm_type)``. ``None`` without context parallelism.
    """
    if groups is not None:
        if not isinstance(groups, VideoParallelGroups):
            raise ValueError(
                f"groups ({type(groups).__name__}) must be None or the "
                f"VideoParallelGroups of init_video_parallel(...)"
            )
        return groups
    if _GROUPS is not None:
        from megatron.core import parallel_state as ps

        cp = _pg(pg_collection, "cp") or ps.get_context_parallel_group(check_initialized=False)
        if cp is not None and cp is _GROUPS.cp_group:
            return _GROUPS
    return groups_from_megatron(pg_collection, cp_comm_type)
