"""poll_until: when it asks, how long it sleeps between, and when it gives up (on a fake
clock: each sleep moves it on)."""

from __future__ import annotations

import pytest

from p2pweights import polling


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(polling.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(polling.time, "sleep", fake.sleep)
    return fake


@pytest.mark.parametrize(
    ("answers", "deadline", "kwargs", "expected", "asked", "sleeps"),
    [
        # answered at once: no sleep
        ([True], 1.0, {"sleep_s": 0.5}, True, 1, []),
        # the same sleep every time without max_sleep_s
        ([False, False, True], 10.0, {"sleep_s": 0.5}, True, 3, [0.5, 0.5]),
        # doubling up to max_sleep_s
        (
            [False] * 5 + [True],
            100.0,
            {"sleep_s": 1.0, "max_sleep_s": 4.0},
            True,
            6,
            [1.0, 2.0, 4.0, 4.0, 4.0],
        ),
        # past the deadline: False, after asking once more at the deadline
        ([False] * 10, 1.0, {"sleep_s": 0.5}, False, 3, [0.5, 0.5]),
        # a deadline already passed still asks once
        ([False], 0.0, {"sleep_s": 0.5}, False, 1, []),
        ([True], 0.0, {"sleep_s": 0.5}, True, 1, []),
        # the caller's own first answer: not asked until after a sleep
        ([True], 1.0, {"sleep_s": 0.5, "first": False}, True, 1, [0.5]),
        ([], 1.0, {"sleep_s": 0.5, "first": True}, True, 0, []),
        ([], 0.0, {"sleep_s": 0.5, "first": False}, False, 0, []),
    ],
)
def test_poll_until(clock, answers, deadline, kwargs, expected, asked, sleeps):
    given = iter(answers)
    calls = []

    def ask() -> bool:
        calls.append(clock.now)
        return next(given)

    assert polling.poll_until(ask, deadline, **kwargs) is expected
    assert len(calls) == asked
    assert clock.sleeps == sleeps


def test_what_ask_raises_propagates(clock):
    def ask() -> bool:
        raise LookupError("refused")

    with pytest.raises(LookupError, match="refused"):
        polling.poll_until(ask, 1.0, sleep_s=0.5)
