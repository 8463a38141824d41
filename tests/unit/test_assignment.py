"""Rank assignment: every target gets exactly one sender, spread first, shared layouts after."""

from __future__ import annotations

import itertools

import pytest

from p2pweights.errors import PlanError
from p2pweights.plan.assignment import Target, assign_targets


def _targets(engine_ranks: list[int]) -> list[Target]:
    """Engines of the given TP sizes; rank r of every engine of one TP size shares a layout."""
    return [
        Target(e, r, layout_key=(tp, r)) for e, tp in enumerate(engine_ranks) for r in range(tp)
    ]


def _as_pairs(plan: list[list[Target]]) -> list[list[tuple[int, int]]]:
    return [[(t.engine_index, t.engine_rank) for t in sender] for sender in plan]


@pytest.mark.parametrize(
    ("num_senders", "engines", "expected"),
    [
        # one sender writes everything
        (1, [2], [[(0, 0), (0, 1)]]),
        # as many senders as targets: one each
        (2, [2], [[(0, 0)], [(0, 1)]]),
        # two identical engines, two senders: each sender owns one layout, writes it twice
        (2, [2, 2], [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]),
        # more senders than distinct layouts: the extra sender takes a duplicate
        (3, [2, 2], [[(0, 0)], [(0, 1), (1, 1)], [(1, 0)]]),
        # more senders than targets: idle senders get nothing
        (4, [1, 1], [[(0, 0)], [(1, 0)], [], []]),
        # mixed TP sizes: TP2 and TP1 layouts differ, so all three are fresh
        (2, [2, 1], [[(0, 0), (1, 0)], [(0, 1)]]),
    ],
)
def test_assignment_table(num_senders, engines, expected):
    assert _as_pairs(assign_targets(num_senders, _targets(engines))) == expected


@pytest.mark.parametrize(
    ("num_senders", "engines"),
    list(itertools.product([1, 2, 3, 4, 8], [[1], [2], [4], [2, 2], [4, 2, 1], [8, 8, 8, 8]])),
)
def test_every_target_exactly_once(num_senders, engines):
    targets = _targets(engines)
    plan = assign_targets(num_senders, targets)
    flat = [t for sender in plan for t in sender]
    assert sorted(flat) == sorted(targets)
    # every sender works when there are enough targets
    assert sum(1 for s in plan if s) == min(num_senders, len(targets))


def test_shared_layout_is_prepared_by_few_senders():
    # 4 identical TP4 engines, 4 senders: each sender owns one rank layout
    plan = assign_targets(4, _targets([4, 4, 4, 4]))
    for sender in plan:
        assert len({t.layout_key for t in sender}) == 1
        assert len(sender) == 4


def test_rejects_bad_input():
    with pytest.raises(PlanError, match="at least one"):
        assign_targets(0, _targets([1]))
    with pytest.raises(PlanError, match="once"):
        assign_targets(1, [Target(0, 0), Target(0, 0)])
