"""The node-placement rule (parallel.topology.check_ulysses_in_node): pure, one home, used by
init_video_parallel, groups_from_megatron and the training config."""

import pytest

from megatron_video.parallel.topology import (
    check_ranks_per_node,
    check_ulysses_in_node,
    default_cp_groups,
    local_groups,
)


def _spans(cp_groups, U, R, rpn, placement):
    """Oracle: does any Ulysses group of any CP group hold ranks of two nodes?"""
    return any(
        len({g // rpn for g in group}) > 1
        for cp in cp_groups
        for group in local_groups(list(cp), U, R, placement)[0]
    )


def test_default_cp_groups_is_megatrons_tp_cp_order():
    assert default_cp_groups(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert default_cp_groups(8, 1, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert default_cp_groups(4, 1, 1) == [[0], [1], [2], [3]]
    groups = default_cp_groups(16, 2, 4)
    assert sorted(r for g in groups for r in g) == list(range(16))  # a partition of the world


@pytest.mark.parametrize("placement", ["ulysses_inner", "ring_inner"])
def test_check_agrees_with_the_oracle_and_the_arithmetic_rule(placement):
    for world in (4, 8, 12, 16):
        for tp in (1, 2):
            for cp in (1, 2, 3, 4, 8):
                if world % (tp * cp):
                    continue
                for U in (u for u in range(1, cp + 1) if cp % u == 0):
                    R = cp // U
                    for rpn in (r for r in range(1, world + 1) if world % r == 0):
                        groups = default_cp_groups(world, tp, cp)
                        bad = _spans(groups, U, R, rpn, placement)
                        # the arithmetic form of the rule under Megatron's rank order
                        block = tp * (U if placement == "ulysses_inner" else cp)
                        assert bad == (U > 1 and rpn < world and rpn % block != 0), (
                            world,
                            tp,
                            cp,
                            U,
                            placement,
                            rpn,
                        )
                        if bad:
                            with pytest.raises(ValueError, match="must lie inside one node"):
                                check_ulysses_in_node(groups, U, R, rpn, placement, tp_size=tp)
                        else:
                            check_ulysses_in_node(groups, U, R, rpn, placement, tp_size=tp)


def test_messages_name_parameter_value_and_rule():
    with pytest.raises(ValueError) as e:
        check_ulysses_in_node(default_cp_groups(4, 1, 4), 2, 2, 1, tp_size=1, prefix="parallel.")
    msg = str(e.value)
    assert (
        "parallel.ulysses_size (2) x tensor_model_parallel_size (1) must be <= "
        "parallel.ranks_per_node (1) and divide it" in msg
    )
    assert "the all-to-all group [0, 1] spans nodes [0, 1]" in msg
    with pytest.raises(ValueError) as e:
        check_ulysses_in_node([[0, 1, 2, 3]], 2, 2, 2, "ring_inner")
    msg = str(e.value)
    assert (
        "context_parallel_size (4) x tensor_model_parallel_size (1) must be <= ranks_per_node (2)"
        in msg
        and "ulysses_size (2) with placement 'ring_inner'" in msg
    )
    with pytest.raises(ValueError) as e:
        check_ulysses_in_node(
            [[0, 1, 2, 3]], 4, 1, 2, setting="cp_comm_type ('a2a')", hint="use 'p2p'"
        )
    assert str(e.value).startswith("cp_comm_type ('a2a'): the all-to-all group [0, 1, 2, 3] spans")
    assert str(e.value).endswith("; use 'p2p'")


def test_tp_times_u_below_ranks_per_node_is_not_enough():
    """U=3 over 4-rank nodes: 3 <= 4, yet the Ulysses group [3, 4, 5] crosses a node boundary (the
    training config used to accept this; init_video_parallel refused it)."""
    with pytest.raises(ValueError, match=r"the all-to-all group \[3, 4, 5\] spans nodes \[0, 1\]"):
        check_ulysses_in_node(default_cp_groups(12, 1, 3), 3, 1, 4)


def test_check_ranks_per_node():
    assert check_ranks_per_node(2, 8) == 2
    with pytest.raises(
        ValueError, match=r"parallel.ranks_per_node \(3\) must divide the world size \(8\)"
    ):
        check_ranks_per_node(3, 8, "parallel.ranks_per_node")
    for bad in (0, True, 2.0, "2"):
        with pytest.raises(ValueError, match=r"ranks_per_node \(.*\) must be a positive integer"):
            check_ranks_per_node(bad, 8)


def test_training_config_uses_the_rule():
    from megatron_video.training.config import load_config, validate

    cfg = load_config(
        None,
        [
            "parallel.context_parallel_size=4",
            "parallel.ulysses_size=2",
            "parallel.ring_size=2",
            "parallel.ranks_per_node=2",
            "parallel.placement=ring_inner",
            "parallel.ring_balance=false",
        ],
    )
    with pytest.raises(
        ValueError,
        match=r"the all-to-all group \[0, 2\] spans nodes \[0, 1\] at "
        r"parallel.ranks_per_node \(2\)",
    ):
        validate(cfg, 4)
