"""Rank assignment: one writer per target, bytes balanced, a layout loaded once where free."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pweights.errors import PlanError
from p2pweights.plan.assignment import Target, assign_targets, busiest_bytes, loaded_bytes

MODEL_BYTES = 1200


def _targets(engine_tps: list[int], model_bytes: int = MODEL_BYTES) -> list[Target]:
    """Engines of the given TP sizes; rank r of every engine of one TP size shares a layout
    and holds 1/TP of the model."""
    return [
        Target(e, r, layout_key=(tp, r), num_bytes=model_bytes // tp)
        for e, tp in enumerate(engine_tps)
        for r in range(tp)
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
        # two identical engines, two senders: each sender loads one layout, writes it twice
        (2, [2, 2], [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]),
        # more senders than layouts: every sender busy, the last one shares its layout
        (3, [2, 2], [[(0, 0)], [(1, 0)], [(0, 1), (1, 1)]]),
        # more senders than targets: idle senders get nothing
        (4, [1, 1], [[(0, 0)], [(1, 0)], [], []]),
        # TP 2 ranks hold half a TP 1 rank: the TP 1 rank alone balances both TP 2 ranks
        (2, [2, 1], [[(1, 0)], [(0, 0), (0, 1)]]),
        # TP 4 beside TP 2, 4 senders: the TP 2 ranks (twice the bytes) get a sender each,
        # the four TP 4 ranks pair up; every sender writes a quarter
        (4, [4, 2], [[(1, 0)], [(1, 1)], [(0, 0), (0, 2)], [(0, 1), (0, 3)]]),
        # four identical TP 4 engines, four senders: each loads one layout, writes it 4 times
        (4, [4] * 4, [[(e, r) for e in range(4)] for r in range(4)]),
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


def test_bytes_not_counts_are_balanced():
    # an EP engine whose rank 0 also holds the embedding and the first dense layers
    targets = [Target(0, 0, "r0", 500)] + [Target(0, r, f"r{r}", 100) for r in range(1, 8)]
    plan = assign_targets(4, targets)
    assert busiest_bytes(plan) == 500  # rank 0 alone; the other seven over three senders
    assert [len(s) for s in plan] == [1, 3, 2, 2]


def test_a_layout_is_loaded_once_where_that_costs_no_balance():
    # 8 identical TP 4 engines whose rank 0 is 1 % larger (vocabulary padding), 4 senders
    targets = [Target(e, r, r, 1010 if r == 0 else 1000) for e in range(8) for r in range(4)]
    plan = assign_targets(4, targets)
    assert [{t.layout_key for t in sender} for sender in plan] == [{0}, {1}, {2}, {3}]
    assert loaded_bytes(plan) == 4010


def test_sharing_never_leaves_a_sender_idle():
    # two identical TP 1 engines and two senders: each writes one, though both could share
    plan = assign_targets(2, [Target(0, 0, "same", 10), Target(1, 0, "same", 10)])
    assert _as_pairs(plan) == [[(0, 0)], [(1, 0)]]


def test_the_same_targets_in_any_order_give_the_same_assignment():
    targets = _targets([8, 4, 4, 2, 1])
    plan = assign_targets(5, targets)
    assert assign_targets(5, targets[::-1]) == plan
    assert (
        assign_targets(5, sorted(targets, key=lambda t: (t.engine_rank, -t.engine_index))) == plan
    )


def test_rejects_bad_input():
    with pytest.raises(PlanError, match="at least one"):
        assign_targets(0, _targets([1]))
    with pytest.raises(PlanError, match="once"):
        assign_targets(1, [Target(0, 0), Target(0, 0, layout_key="other")])
    with pytest.raises(PlanError, match="negative"):
        assign_targets(1, [Target(0, 0, num_bytes=-1)])


# -- properties -----------------------------------------------------------------------------


def _reference(num_senders: int, targets: list[Target]) -> float:
    """What the targets allow (a lower bound on the best assignment): the ideal split,
    unless a target is larger; the j + 1 smallest of the largest j x S + 1 targets (some
    sender holds j + 1 of them); and for every target size u, the ideal split of the
    targets rounded down to whole u's, in whole u's (no target is split)."""
    sizes = sorted((t.num_bytes for t in targets), reverse=True)
    bound = max(sum(sizes) / num_senders, sizes[0])
    for j in range(1, len(sizes)):
        top = j * num_senders + 1
        if top > len(sizes):
            break
        bound = max(bound, sum(sizes[top - j - 1 : top]))
    for unit in set(sizes) - {0}:
        units = sum(size // unit for size in sizes)
        bound = max(bound, unit * -(-units // num_senders))
    return bound


@st.composite
def engine_shaped(draw) -> tuple[int, list[Target]]:
    """Engines as deployments have them: TP 1-16 each, ranks of one engine equal up to a
    few percent (embedding, head and dense layers on some ranks), identical engines
    sharing layouts, models of different sizes."""
    num_engines = draw(st.integers(1, 8))
    model_bytes = draw(st.integers(10_000, 1_000_000))
    kinds = draw(st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=3, unique=True))
    targets = []
    for e in range(num_engines):
        tp = draw(st.sampled_from(kinds))
        for r in range(tp):
            extra = draw(st.sampled_from([0, 0, 0, 1, 3])) if r in (0, tp - 1) else 0
            targets.append(Target(e, r, (tp, r), model_bytes // tp * (100 + extra) // 100))
    return draw(st.integers(1, 40)), targets


def _check_invariants(num_senders: int, targets: list[Target], plan: list[list[Target]]) -> None:
    assert len(plan) == num_senders
    flat = [t for sender in plan for t in sender]
    assert sorted(flat) == sorted(targets)  # one writer per target, none left out
    if len(targets) >= num_senders:
        assert all(plan), "a sender idles while targets wait"


@settings(max_examples=300, deadline=None)
@given(engine_shaped())
def test_engine_shaped_targets_balance_within_1_1_of_what_they_allow(case):
    num_senders, targets = case
    plan = assign_targets(num_senders, targets)
    _check_invariants(num_senders, targets, plan)
    assert busiest_bytes(plan) <= 1.1 * _reference(num_senders, targets)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 3),
    st.lists(st.integers(1, 20), min_size=1, max_size=7),
    st.lists(st.integers(0, 2), min_size=7, max_size=7),
)
def test_any_small_case_within_1_1_of_the_best_assignment(num_senders, sizes, layouts):
    targets = [Target(i, 0, layouts[i], size) for i, size in enumerate(sizes)]
    plan = assign_targets(num_senders, targets)
    _check_invariants(num_senders, targets, plan)
    best = min(
        max(
            sum(s for s, who in zip(sizes, choice, strict=True) if who == k)
            for k in range(num_senders)
        )
        for choice in itertools.product(range(num_senders), repeat=len(sizes))
        if len(sizes) < num_senders or len(set(choice)) == num_senders
    )
    assert busiest_bytes(plan) <= 1.1 * best


@pytest.mark.parametrize(("num_senders", "num_targets"), [(2, 4), (3, 2), (2, 0), (4, 4)])
def test_targets_of_zero_bytes_are_spread_evenly(num_senders, num_targets):
    targets = [Target(0, rank, "layout", 0) for rank in range(num_targets)]
    plan = assign_targets(num_senders, targets)
    assert sorted(t for sender in plan for t in sender) == targets  # each once
    sizes = [len(sender) for sender in plan]
    assert max(sizes, default=0) - min(sizes, default=0) <= 1
