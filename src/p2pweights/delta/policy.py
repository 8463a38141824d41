"""Whether an update goes as a delta or in full, from what earlier updates measured.

A delta saves link time (the bytes it does not write) and costs compare time (every
staged byte compared with the stored copy of the previous update's, the entries
packed). Which wins depends on the link: over RDMA between hosts the compare on a GPU
is cheap beside the writes it saves; into an engine on the trainer's own GPU, or over
loopback on a CPU, writing every byte is faster than comparing them. Per update of
``B`` bytes a full update writes, the policy predicts::

    full  = w * B
    delta = c * B + w * f * B

``w``: seconds an update waited for its writes per byte written, measured on updates
written in full; ``c``: seconds comparing and packing per byte a full update writes,
measured on delta updates (with ``objective="pause"``: only the compare done while the
engines stood paused, every staging buffer's after the first, which is compared before
they pause); ``f``: the share of those bytes the last delta sent. What
both share (loading, the control plane, digests) cancels. Rates are medians of the
last few updates (a noisy neighbour does not flip the choice); the fraction is the
latest (it moves as the learning rate does). A delta is chosen only where it is
predicted ``margin`` faster: the engine's apply, not measured here, costs a delta too.

While full is predicted faster, the stored copy is left out (no copy, no compare);
every so often (``probe_after`` full updates, doubling up to ``max_probe_after`` while
probes confirm full) one full update keeps a copy and the next is a delta again, to
measure the fraction anew (a learning-rate schedule changes it). While deltas are
predicted faster, every so often (the same spacing, doubling while probes confirm
deltas) one update goes in full, keeping its copy, to measure ``w`` anew: otherwise a
first update whose writes ran cold would keep deltas going for good. The first update, and
any after which no engine rank holds the previous update (a failure, a restart), is
full whatever the policy predicts.

The policy is pure: ``decide`` before an update, ``observe`` after it; no clock, no I/O.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

__all__ = ["Decision", "DeltaPolicy", "Measured", "Mode", "Objective", "Reason"]

Mode = Literal["auto", "always"]
"""``DeltaConfig.mode``."""

Objective = Literal["update", "pause"]
"""``DeltaConfig.objective``: what ``"auto"`` minimises, the update's seconds or the
seconds the engines stand paused."""

Reason = Literal["always", "no_base", "probe", "predicted"]
"""Why a decision was made: ``"always"`` (``DeltaConfig(mode="always")``), ``"no_base"`` (no
engine rank holds the previous update: the first update, or after a failure or restart),
``"probe"`` (a delta to measure its costs: nothing measured yet, or full has run for a
while) or ``"predicted"`` (faster by the measured costs)."""


@dataclass(frozen=True)
class Decision:
    """How one update is sent."""

    mode: Literal["delta", "full"]
    """``"delta"``: slots compared with the stored copy, changed elements sent where that is
    smaller; ``"full"``: every byte written, nothing compared."""
    keep_copy: bool
    """Whether this update's bytes are stored for the next one to compare with (always,
    for a delta; a full update keeps them where the next may be a delta)."""
    reason: Reason
    predicted_delta_s: float | None = None
    """Seconds the delta's compare and writes were predicted to take (None: no prediction)."""
    predicted_full_s: float | None = None
    """Seconds a full update's writes were predicted to take."""
    objective: Objective = "update"
    """What the prediction minimised (``DeltaConfig.objective``)."""

    def describe(self) -> str:
        """One line saying what was decided and why."""
        counted = (
            "writes and compare" if self.objective == "update" else "writes and paused compare"
        )
        minimised = "update time" if self.objective == "update" else "the engines' pause"
        predicted = (
            ""
            if self.predicted_delta_s is None or self.predicted_full_s is None
            else f" (minimising {minimised}; predicted {counted}: delta "
            f"{self.predicted_delta_s:.3f} s, full {self.predicted_full_s:.3f} s)"
        )
        what = {
            "always": (
                'as a delta where an engine rank holds the previous update (mode "always")'
                if self.mode == "delta"
                else 'in full: no engine rank holds the previous update (mode "always")'
            ),
            "no_base": "in full: no engine rank holds the previous update",
            "probe": f"{'as a delta' if self.mode == 'delta' else 'in full'}, to measure "
            f"what it costs now",
            "predicted": f"{'as a delta' if self.mode == 'delta' else 'in full'}: faster",
        }[self.reason]
        return f"sent {what}{predicted}"


@dataclass(frozen=True)
class Measured:
    """What one update measured."""

    mode: Literal["delta", "full"]
    full_bytes: int
    """Bytes a full update writes (every staged slot to each of its ranks)."""
    sent_bytes: int
    """Bytes written."""
    compare_s: float
    """Seconds comparing with the stored copy and packing entries (a delta's)."""
    wait_s: float
    """Seconds the update waited for its writes."""
    compare_paused_s: float | None = None
    """Of ``compare_s``, the seconds spent while the engines stood paused (None: all)."""


class DeltaPolicy:
    """Delta or full, update by update, from the costs measured (module docstring)."""

    def __init__(
        self,
        mode: Mode = "auto",
        *,
        objective: Objective = "update",
        margin: float = 0.1,
        probe_after: int = 4,
        max_probe_after: int = 64,
        window: int = 3,
    ) -> None:
        if mode not in ("auto", "always"):
            raise ValueError(f'mode must be "auto" or "always", got {mode!r}')
        if objective not in ("update", "pause"):
            raise ValueError(f'objective must be "update" or "pause", got {objective!r}')
        self.objective: Objective = objective
        if probe_after < 1 or max_probe_after < probe_after or window < 1:
            raise ValueError(
                f"probe_after ({probe_after}) must be at least 1 and at most max_probe_after "
                f"({max_probe_after}), window ({window}) at least 1"
            )
        self.mode = mode
        self.margin = margin
        self.probe_after = probe_after
        self.max_probe_after = max_probe_after
        self._write_s_per_byte: deque[float] = deque(maxlen=window)
        self._compare_s_per_byte: deque[float] = deque(maxlen=window)
        self._fraction: float | None = None
        self._full_bytes = 0
        # Full updates since the last delta.
        self._num_full = 0
        # Full updates before the next probe.
        self._wait = probe_after
        # Whether the last decision probed while full was predicted faster.
        self._reprobe = False
        # Delta updates since the last full one.
        self._num_delta = 0
        # Delta updates before the next full probe.
        self._full_wait = probe_after
        # Whether the last decision probed a full update while deltas were faster.
        self._full_probe = False

    def decide(self, can_delta: bool) -> Decision:
        """How the next update goes; ``can_delta``: some engine rank holds the previous
        update (the stored copy is theirs)."""
        self._reprobe = self._full_probe = False
        if self.mode == "always":
            return Decision("delta" if can_delta else "full", True, "always")
        predicted = self.predict()
        if predicted is None:  # nothing to predict with: measure a delta
            if can_delta:
                return Decision("delta", True, "probe")
            return Decision("full", True, "no_base")
        delta_s, full_s = predicted
        aim = self.objective
        if delta_s < full_s * (1 - self.margin):
            if can_delta and self._num_delta >= self._full_wait:
                self._full_probe = True
                return Decision("full", True, "probe", delta_s, full_s, aim)
            mode: Literal["delta", "full"] = "delta" if can_delta else "full"
            reason: Reason = "predicted" if can_delta else "no_base"
            return Decision(mode, True, reason, delta_s, full_s, aim)
        if can_delta and self._num_full >= self._wait:
            self._reprobe = True
            return Decision("delta", True, "probe", delta_s, full_s, aim)
        keep = self._num_full + 1 >= self._wait  # the next update probes
        return Decision("full", keep, "predicted", delta_s, full_s, aim)

    def predict(self) -> tuple[float, float] | None:
        """(delta seconds, full seconds) for the bytes of the last update, or None where a
        rate is not measured yet (seconds of the engines' pause with ``objective="pause"``:
        only the compare done while paused is counted)."""
        if not self._write_s_per_byte or not self._compare_s_per_byte or self._fraction is None:
            return None
        write = statistics.median(self._write_s_per_byte)
        compare = statistics.median(self._compare_s_per_byte)
        num_bytes = self._full_bytes
        return (compare + write * self._fraction) * num_bytes, write * num_bytes

    def observe(self, measured: Measured) -> None:
        """What the update just decided measured (one that staged nothing measures nothing)."""
        if measured.full_bytes <= 0:
            return
        self._full_bytes = measured.full_bytes
        if measured.mode == "full":
            self._num_full += 1
            self._num_delta = 0
            if measured.sent_bytes > 0:
                if self._full_probe:  # the fresh measure stands alone: the old ones misled
                    self._write_s_per_byte.clear()
                self._write_s_per_byte.append(measured.wait_s / measured.sent_bytes)
            if self._full_probe:
                predicted = self.predict()
                confirmed = predicted is not None and predicted[0] < predicted[1] * (
                    1 - self.margin
                )
                self._full_wait = (
                    min(2 * self._full_wait, self.max_probe_after)
                    if confirmed
                    else self.probe_after
                )
            self._full_probe = False
            return
        self._num_full = 0
        self._num_delta += 1
        compare_s = measured.compare_s
        if self.objective == "pause" and measured.compare_paused_s is not None:
            compare_s = measured.compare_paused_s
        self._compare_s_per_byte.append(compare_s / measured.full_bytes)
        self._fraction = measured.sent_bytes / measured.full_bytes
        predicted = self.predict()
        if predicted is not None and predicted[0] < predicted[1] * (1 - self.margin):
            self._wait = self.probe_after  # deltas again: probe soon after the next switch
        elif self._reprobe:
            self._wait = min(2 * self._wait, self.max_probe_after)
        self._reprobe = False
