"""What ``WeightSyncSession.update`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class UpdateReport:
    """One update: the new version, the bytes each engine rank received and where time went."""

    version: str
    bytes_by_target: dict[tuple[str, int], int]
    """(engine URL, engine rank) -> bytes this trainer rank wrote there."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """control_plane, probe (first update only), convert (e.g. fp8 quantization, when an
    engine needs it), load (into buffers), wait (on writes), verify."""
    seconds: float = 0.0
    paused_s: dict[str, float] = field(default_factory=dict)
    """Engine URL -> seconds its generation stood paused for this update: from the answer
    to its pause (or from when a failed earlier update left it paused, or a session
    found it so) to the answer to its resume (``Fleet.paused_seconds()``)."""
    num_control_calls: int = 0
    """HTTP calls to the engines during the update (``Fleet.control_calls()``)."""
    control_call_seconds: float = 0.0
    """Wall seconds during which at least one of those calls was in flight (calls issued
    at once count once)."""

    @property
    def bytes_written(self) -> int:
        return sum(self.bytes_by_target.values())

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        stages = " ".join(f"{k}={v:.3f}s" for k, v in self.stage_seconds.items())
        paused = f"; paused {max(self.paused_s.values()):.3f} s" if self.paused_s else ""
        calls = (
            f"; {self.num_control_calls} control calls {self.control_call_seconds:.3f} s"
            if self.num_control_calls
            else ""
        )
        return (
            f"version {self.version}: {self.bytes_written / 1e6:.1f} MB to "
            f"{len(self.bytes_by_target)} engine rank(s) in {self.seconds:.3f} s "
            f"({self.gb_per_s:.2f} GB/s; {stages}{paused}{calls})"
        )
