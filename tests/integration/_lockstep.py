"""Trainer processes run in lockstep with the test: each update, every process puts one
result on a queue and waits on that update's event while the test checks the engines."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def run_in_lockstep(
    trainers: Sequence[Any],
    out: Any,
    gos: Sequence[Any],
    check: Callable[[int, list[tuple]], None],
) -> None:
    """Start ``trainers`` (processes); after update ``index`` gather one result per process
    from ``out`` (tuples starting ``(index, rank)``, sorted by rank), call
    ``check(index, results)``, then set ``gos[index]`` to let them go on. Every process
    must exit 0."""
    for process in trainers:
        process.start()
    try:
        for index, go in enumerate(gos):
            results = sorted(out.get(timeout=300) for _ in trainers)
            assert [r[:2] for r in results] == [(index, rank) for rank in range(len(trainers))]
            check(index, results)
            go.set()
    finally:
        for process in trainers:
            process.join(timeout=60)
    assert [process.exitcode for process in trainers] == [0] * len(trainers)
