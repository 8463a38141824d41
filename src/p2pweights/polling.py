"""Asking again until an answer or a deadline: the one loop every wait in p2pweights runs
(transfers in flight, an engine starting, a server refusing while requests run)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["poll_until"]


def poll_until(
    ask: Callable[[], bool],
    deadline: float,
    *,
    sleep_s: float,
    max_sleep_s: float | None = None,
    first: bool | None = None,
) -> bool:
    """Whether ``ask()`` answered True before ``deadline`` (a ``time.monotonic()`` time).

    Asks at once, then, while the deadline has not passed, again after each sleep:
    ``sleep_s`` first, doubling up to ``max_sleep_s`` (the same every time without it).
    ``first`` is the first answer where the caller already has it (``ask`` is then first
    called after a sleep). What ``ask`` raises propagates: a refusal not worth asking
    again raises there.
    """
    longest = sleep_s if max_sleep_s is None else max_sleep_s
    answer = ask() if first is None else first
    while not answer:
        if time.monotonic() >= deadline:
            return False
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, longest)
        answer = ask()
    return True
