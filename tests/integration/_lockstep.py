"""Trainer processes run in lockstep with the test: each update, every process puts one
result on a queue and waits on that update's event while the test checks the engines."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def run_in_lockstep(
    trainers: Sequence[Any],
    out: Any,
    gos: Sequence[Any],
    check: Callable[[Any, list[tuple]], None],
    steps: Sequence[Any] | None = None,
    timeout_s: float = 300,
) -> None:
    """Start ``trainers`` (processes); after update ``index`` gather one result per process
    from ``out`` (tuples starting ``(step, rank)``, sorted by rank; ``step`` is
    ``steps[index]``, by default ``index``), call ``check(step, results)``, then set
    ``gos[index]`` to let them go on. Every process must exit 0."""
    labels = list(range(len(gos)) if steps is None else steps)
    assert len(labels) == len(gos)
    for process in trainers:
        process.start()
    try:
        for step, go in zip(labels, gos, strict=True):
            results = sorted(out.get(timeout=timeout_s) for _ in trainers)
            assert [r[:2] for r in results] == [(step, rank) for rank in range(len(trainers))]
            check(step, results)
            go.set()
    finally:
        for process in trainers:
            process.join(timeout=60)
    assert [process.exitcode for process in trainers] == [0] * len(trainers)
