"""Whether an update goes as a delta or in full, from what earlier updates measured:
the pure policy (``delta.policy``), table-driven."""

from __future__ import annotations

import itertools

import pytest

from p2pweights.delta.policy import Decision, DeltaPolicy, Measured

GB = 10**9


def _full(wait_s: float, num_bytes: int = GB) -> Measured:
    return Measured("full", num_bytes, sent_bytes=num_bytes, compare_s=0.0, wait_s=wait_s)


def _delta(compare_s: float, fraction: float, num_bytes: int = GB) -> Measured:
    sent = int(fraction * num_bytes)
    return Measured("delta", num_bytes, sent_bytes=sent, compare_s=compare_s, wait_s=0.0)


def _warm(policy: DeltaPolicy, full_wait_s: float, compare_s: float, fraction: float) -> None:
    """The first update (full) and the first delta measured."""
    assert policy.decide(can_delta=False).mode == "full"
    policy.observe(_full(full_wait_s))
    assert policy.decide(can_delta=True).mode == "delta"
    policy.observe(_delta(compare_s, fraction))


# (case, seconds waiting for a full update's writes of 1 GB, compare seconds of 1 GB,
#  fraction a delta sent, expected mode)
CASES = [
    # a 50 GB/s NIC, the compare on a GPU (429 GB/s): the link is the bottleneck
    ("rdma, gpu compare, lr 1e-6", 0.020, 0.0023, 0.058, "delta"),
    # a 1 GB/s link against a host-CPU compare at 2 GB/s, few changes
    ("slow link, cpu compare", 1.0, 0.5, 0.05, "delta"),
    # one H200, colocated: a device copy of 1 GB under a millisecond
    ("colocated h200", 0.0008, 0.0126, 0.058, "full"),
    # this CPU over loopback: 103 MB written in 42 ms, compared in 100 ms
    ("cpu loopback, lr 1e-6", 0.042 * 10, 0.100 * 10, 0.043, "full"),
    # lr 1e-4: most bytes change, the compare costs seven times the writes
    ("cpu loopback, lr 1e-4", 0.042 * 10, 0.70 * 10, 0.89, "full"),
    # the link saves exactly the compare: no gain beyond the margin, full
    ("even", 1.0, 0.5, 0.5, "full"),
    # most bytes change: writes hardly shrink, whatever the compare costs
    ("rdma, lr 1e-4", 0.020, 0.0023, 0.95, "full"),
]


@pytest.mark.parametrize(("case", "wait_s", "compare_s", "fraction", "mode"), CASES)
def test_chooses_what_the_measured_costs_predict_faster(case, wait_s, compare_s, fraction, mode):
    policy = DeltaPolicy("auto")
    _warm(policy, wait_s, compare_s, fraction)
    decision = policy.decide(can_delta=True)
    assert decision.mode == mode, (case, decision)
    assert decision.reason == "predicted"
    assert decision.predicted_full_s == pytest.approx(wait_s)
    assert decision.predicted_delta_s == pytest.approx(compare_s + fraction * wait_s, rel=1e-6)
    assert ("delta" if mode == "delta" else "full") in decision.describe()


def test_the_first_update_is_full_and_keeps_a_copy_then_a_delta_is_measured():
    policy = DeltaPolicy("auto")
    first = policy.decide(can_delta=False)
    assert (first.mode, first.keep_copy, first.reason) == ("full", True, "no_base")
    assert first.predicted_delta_s is None and first.predicted_full_s is None
    policy.observe(_full(0.5))
    second = policy.decide(can_delta=True)
    assert (second.mode, second.keep_copy, second.reason) == ("delta", True, "probe")


def test_always_sends_deltas_wherever_an_engine_holds_the_previous_update():
    policy = DeltaPolicy("always")
    assert policy.decide(can_delta=False) == Decision("full", True, "always")
    policy.observe(_full(0.0001))
    policy.observe(_delta(10.0, 0.99))
    for _ in range(5):  # however costly the deltas measured
        assert policy.decide(can_delta=True) == Decision("delta", True, "always")


def test_while_full_is_faster_a_copy_is_kept_only_before_a_probe():
    """Full updates leave the stored copy out (no copy, no compare); the update before a
    probe keeps one, the probe compares; a probe that confirms full doubles the wait."""
    policy = DeltaPolicy("auto", probe_after=3, max_probe_after=12)
    _warm(policy, 0.04, 0.7, 0.89)
    seen = []
    for _ in range(24):
        decision = policy.decide(can_delta=seen[-1:] == ["full+copy"] or seen[-1:] == ["delta"])
        name = decision.mode + ("+copy" if decision.mode == "full" and decision.keep_copy else "")
        seen.append(name)
        if decision.mode == "delta":
            assert decision.reason == "probe"
            policy.observe(_delta(0.7, 0.89))
        else:
            policy.observe(_full(0.04))
    probes = [i for i, name in enumerate(seen) if name == "delta"]
    assert probes == [3, 10, 23]  # 3 full updates, then 6, then 12 (the most)
    assert all(seen[i - 1] == "full+copy" for i in probes)
    assert seen.count("full+copy") == len(probes)


def test_a_probe_that_finds_deltas_faster_goes_back_to_deltas():
    """The learning rate fell: the fraction too; the first probe finds deltas faster."""
    policy = DeltaPolicy("auto", probe_after=2)
    _warm(policy, 0.020, 0.0023, 0.95)  # most bytes changed
    modes = []
    for step in range(8):
        decision = policy.decide(can_delta=modes[-1:] != ["full"] if modes else False)
        kept = decision.mode == "full" and decision.keep_copy
        modes.append("copy" if kept else decision.mode)
        if decision.mode == "delta":
            policy.observe(_delta(0.0023, 0.05 if step >= 1 else 0.95))
        else:
            policy.observe(_full(0.020))
    # after two deltas one full update (keeping its copy) measures the writes anew; it
    # confirms deltas, so the next full probe comes after four
    assert modes == ["full", "copy", "delta", "delta", "copy", "delta", "delta", "delta"]


def test_without_a_copy_on_the_engine_a_delta_is_never_chosen():
    """After a failure (or a restarted engine) nothing holds the previous update: full,
    keeping a copy where deltas are predicted faster (the next one can be a delta)."""
    policy = DeltaPolicy("auto")
    _warm(policy, 0.020, 0.0023, 0.058)
    decision = policy.decide(can_delta=False)
    assert (decision.mode, decision.keep_copy, decision.reason) == ("full", True, "no_base")
    assert "no engine rank holds" in decision.describe()
    policy.observe(_full(0.020))
    assert policy.decide(can_delta=True).mode == "delta"


def test_rates_are_medians_of_the_last_updates():
    """One slow write (a noisy neighbour) does not flip the choice."""
    policy = DeltaPolicy("auto", probe_after=64)
    _warm(policy, 0.040, 0.100, 0.05)
    for wait_s in (0.040, 0.040, 5.0):  # the last alone would say delta
        policy.observe(_full(wait_s))
    assert policy.decide(can_delta=True).mode == "full"


@pytest.mark.parametrize(
    "measured",
    [
        Measured("full", full_bytes=0, sent_bytes=0, compare_s=0.0, wait_s=0.0),
        Measured("delta", full_bytes=0, sent_bytes=0, compare_s=0.0, wait_s=0.0),
    ],
)
def test_an_update_that_staged_nothing_measures_nothing(measured):
    policy = DeltaPolicy("auto")
    policy.observe(measured)
    assert policy.decide(can_delta=True) == Decision("delta", True, "probe")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="mode"):
        DeltaPolicy("sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probe_after"):
        DeltaPolicy("auto", probe_after=0)


def test_a_cold_first_full_update_does_not_keep_deltas_forever():
    """The first update's writes ran cold (connections set up, 0.5 s per GB) where full
    really takes 0.05 s and a delta 0.065 s: while deltas run, a full update is probed
    now and then, so its true cost is measured and full wins from then on (before, 28 of
    28 updates went as deltas: ``w`` was measured on full updates only)."""
    policy = DeltaPolicy("auto")
    true_full_s, compare_s, fraction = 0.05, 0.060, 0.10  # a delta: 0.060 + 0.005
    assert policy.decide(can_delta=False).mode == "full"
    policy.observe(_full(0.5))  # cold
    modes = []
    for _ in range(28):
        decision = policy.decide(can_delta=True)
        modes.append(decision.mode)
        if decision.mode == "full":
            policy.observe(_full(true_full_s))
        else:
            policy.observe(_delta(compare_s, fraction))
    assert modes[:2] == ["delta", "delta"]  # measured so far: deltas look faster
    assert modes[-20:].count("full") >= 16, modes


def test_while_deltas_win_a_full_probe_confirms_it_less_and_less_often():
    """Deltas really faster: a full update now and then (to measure it anew), spaced out
    while each one confirms deltas."""
    policy = DeltaPolicy("auto", probe_after=2, max_probe_after=8)
    _warm(policy, 1.0, 0.1, 0.05)
    modes = []
    for _ in range(40):
        decision = policy.decide(can_delta=True)
        modes.append(decision.mode)
        assert decision.keep_copy  # a full probe keeps a copy: deltas resume after it
        policy.observe(_full(1.0) if decision.mode == "full" else _delta(0.1, 0.05))
    fulls = [i for i, mode in enumerate(modes) if mode == "full"]
    assert 3 <= len(fulls) <= 8, modes
    gaps = [b - a for a, b in itertools.pairwise(fulls)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], modes


def test_always_says_in_full_where_nothing_holds_the_previous_update():
    decision = DeltaPolicy("always").decide(can_delta=False)
    assert decision.mode == "full"
    assert decision.describe().startswith("sent in full: no engine rank holds")


# -- what to minimise: the update or the engines' pause (issue 41 item 11) ----------------------


def _delta_paused(compare_s: float, paused_s: float, fraction: float) -> Measured:
    sent = int(fraction * GB)
    return Measured(
        "delta", GB, sent_bytes=sent, compare_s=compare_s, wait_s=0.0, compare_paused_s=paused_s
    )


def test_the_pause_objective_counts_only_the_compare_inside_the_pause():
    """CPU loopback at lr 1e-6: comparing costs more than writing every byte, so the update
    is faster in full; but the engines pause only for what comes after the first staging
    buffer's compare, and there the delta's few bytes win."""
    for objective, mode in (("update", "full"), ("pause", "delta")):
        policy = DeltaPolicy("auto", objective=objective)
        assert policy.decide(can_delta=False).mode == "full"
        policy.observe(_full(0.42))
        assert policy.decide(can_delta=True).mode == "delta"
        policy.observe(_delta_paused(1.0, 0.05, 0.043))
        decision = policy.decide(can_delta=True)
        assert (decision.mode, decision.objective) == (mode, objective)
    assert decision.predicted_delta_s == pytest.approx(0.05 + 0.043 * 0.42, rel=1e-6)
    assert decision.predicted_full_s == pytest.approx(0.42)
    assert "pause" in decision.describe()


def test_the_update_objective_says_so_too():
    policy = DeltaPolicy("auto")
    _warm(policy, 1.0, 0.5, 0.05)
    decision = policy.decide(can_delta=True)
    assert decision.objective == "update" and "update time" in decision.describe()


def test_an_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="objective"):
        DeltaPolicy("auto", objective="throughput")  # type: ignore[arg-type]
