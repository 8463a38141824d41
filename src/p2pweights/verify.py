"""Moved to ``p2pweights.reference_check`` (the bit-exact reference check: what an engine
holds against what sglang's own loader gives); this name stays for compatibility and
re-exports it whole."""

from __future__ import annotations

from p2pweights.reference_check import (
    EngineClient,
    HfTensors,
    checksums_by_rank,
    compare,
    engine_checksums,
    expected_checksums,
    verify_engine,
)

__all__ = [
    "EngineClient",
    "HfTensors",
    "checksums_by_rank",
    "compare",
    "engine_checksums",
    "expected_checksums",
    "verify_engine",
]
