"""The mask rules on token identities: the one Python definition (``csrc/mask_rules.h`` is the C++ one).

Each token carries ``side`` (0 clean, 1 noisy), ``block`` (global latent frame // frames per block),
``doc`` (document id, for packing) and ``pos`` (position). Rules (docs/attention.md, "Attention
engine (linear memory)"):

``full``             every pair;
``causal``           ``pos_k <= pos_q``;
``block_causal``     ``block_k <= block_q``;
``teacher_forcing``  clean->clean iff ``block_k <= block_q``; noisy->clean iff ``block_k < block_q``;
                     noisy->noisy iff same block; clean->noisy never.

With ``same_doc`` the rule is ANDed with ``doc_q == doc_k``. The tile-status codes ``EMPTY``,
``PARTIAL``, ``FULL`` are the ones the C++ kernels write (``kEmptyTile`` ...). This module depends on
torch only, so every layer (index maps, masks, kernels) can call it.
"""

from __future__ import annotations

import torch

__all__ = [
    "EMPTY",
    "PARTIAL",
    "FULL",
    "RULES",
    "FIELDS",
    "ORDER_KEY",
    "CLEAN",
    "NOISY",
    "allowed",
    "teacher_forcing",
]

EMPTY, PARTIAL, FULL = 0, 1, 2
RULES = {"full": 0, "causal": 1, "block_causal": 2, "teacher_forcing": 3}  # codes of csrc/kernels.h
# The identity fields each rule reads (``doc`` is read by every rule when both sides carry it).
FIELDS = {
    "full": (),
    "causal": ("pos",),
    "block_causal": ("block",),
    "teacher_forcing": ("side", "block"),
}
# The one field a rule orders tokens by (``key_k <= key_q``), where it has one: a tile whose keys
# strictly increase and agree on both sides is then exactly the lower triangle. Teacher forcing
# orders by ``block`` only on an all-clean tile.
ORDER_KEY = {"causal": "pos", "block_causal": "block", "teacher_forcing": "block"}
CLEAN, NOISY = 0, 1


def teacher_forcing(
    q_side: torch.Tensor, q_block: torch.Tensor, k_side: torch.Tensor, k_block: torch.Tensor
) -> torch.Tensor:
    """The teacher-forcing predicate on (broadcastable) token identities; True = attend."""
    q_clean = q_side == CLEAN
    return torch.where(
        k_side == CLEAN,
        torch.where(q_clean, k_block <= q_block, k_block < q_block),
        ~q_clean & (k_block == q_block),
    )


def allowed(rule: str, same_doc: bool, q, k) -> torch.Tensor:
    """``rule`` on broadcastable ``(side, block, doc, pos)`` tuples; also a FlexAttention mask_mod body."""
    qs, qb, qd, qp = q
    ks, kb, kd, kp = k
    if rule == "causal":
        a = kp <= qp
    elif rule == "block_causal":
        a = kb <= qb
    elif rule == "teacher_forcing":
        a = teacher_forcing(qs, qb, ks, kb)
    else:
        a = (qb == qb) & (kb == kb)  # all true, in the broadcast shape (works under vmap too)
    return a & (qd == kd) if same_doc else a
