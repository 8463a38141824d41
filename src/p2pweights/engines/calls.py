"""The HTTP calls a client made to its engine: route, when, and whether it opened a connection.

``EngineClient`` records every request it sends in its ``CallLog``; ``Fleet`` clears
the logs when an update opens and sums them (``Fleet.control_calls()``) into
``ControlCalls``: how many calls the update made, the seconds they took one by one,
and the wall seconds during which at least one was in flight (calls issued at once
overlap, so the wall time is what they cost the update).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

__all__ = ["ControlCall", "CallLog", "ControlCalls"]


@dataclass(frozen=True)
class ControlCall:
    """One HTTP request to an engine (answered or not)."""

    url: str
    route: str
    """Method and path, e.g. ``"POST /pause_generation"``."""
    started: float
    """The client's clock (monotonic seconds) when the request was sent."""
    ended: float
    """... when its answer (or its failure) came back."""
    new_connection: bool = False
    """It opened a TCP connection instead of reusing a kept-alive one."""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class CallLog:
    """A client's recent calls (thread-safe: an update issues some at once)."""

    def __init__(self, max_calls: int = 4096):
        # bounded: a client whose log nobody clears (a trainer rank that does not drive
        # the engines) must not grow without end
        self._calls: deque[ControlCall] = deque(maxlen=max_calls)
        self._lock = threading.Lock()

    def record(self, call: ControlCall) -> None:
        with self._lock:
            self._calls.append(call)

    def calls(self) -> list[ControlCall]:
        with self._lock:
            return list(self._calls)

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()


@dataclass(frozen=True)
class ControlCalls:
    """The calls of one update, over every engine."""

    calls: tuple[ControlCall, ...] = ()

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def call_seconds(self) -> float:
        """The calls' seconds added up (more than the wall time where they overlapped)."""
        return sum(call.seconds for call in self.calls)

    @property
    def wall_seconds(self) -> float:
        """Seconds during which at least one call was in flight."""
        total, reached = 0.0, float("-inf")
        for call in sorted(self.calls, key=lambda c: c.started):
            if call.ended > reached:
                total += call.ended - max(call.started, reached)
                reached = call.ended
        return total

    @property
    def num_new_connections(self) -> int:
        return sum(call.new_connection for call in self.calls)

    def by_route(self) -> dict[tuple[str, str], tuple[int, float]]:
        """(engine URL, route) -> (calls, their seconds added up)."""
        out: dict[tuple[str, str], tuple[int, float]] = {}
        for call in self.calls:
            count, seconds = out.get((call.url, call.route), (0, 0.0))
            out[call.url, call.route] = (count + 1, seconds + call.seconds)
        return out

    def summary(self) -> str:
        return (
            f"{self.num_calls} control calls, {self.wall_seconds * 1e3:.1f} ms wall "
            f"({self.call_seconds * 1e3:.1f} ms one by one, "
            f"{self.num_new_connections} new connections)"
        )
