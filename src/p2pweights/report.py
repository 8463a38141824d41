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

    @property
    def bytes_written(self) -> int:
        return sum(self.bytes_by_target.values())

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        stages = " ".join(f"{k}={v:.3f}s" for k, v in self.stage_seconds.items())
        return (
            f"version {self.version}: {self.bytes_written / 1e6:.1f} MB to "
            f"{len(self.bytes_by_target)} engine rank(s) in {self.seconds:.3f} s "
            f"({self.gb_per_s:.2f} GB/s; {stages})"
        )
