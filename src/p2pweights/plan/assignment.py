"""Which trainer rank writes which engine rank: a pure function, no I/O.

The senders are the trainer ranks that hold the same (gathered) weights. Every
target, an (engine, engine rank) pair, gets exactly one sender. First each
sender gets one target, preferring targets of a shard layout nobody sends yet,
so all senders work in parallel on distinct bytes. Every later target goes to a
sender that already prepares the same layout (least loaded first), so that
sender loads the bytes once and writes them to several engines; a layout nobody
sends yet goes to the least loaded sender.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from p2pweights.errors import PlanError


@dataclass(frozen=True, order=True)
class Target:
    """One engine rank to be written, and the key of the bytes it needs."""

    engine_index: int
    engine_rank: int
    layout_key: Hashable = None

    def __str__(self) -> str:
        return f"engine {self.engine_index} rank {self.engine_rank}"


def assign_targets(num_senders: int, targets: Sequence[Target]) -> list[list[Target]]:
    """Split ``targets`` among ``num_senders``; entry ``s`` lists what sender ``s`` writes."""
    if num_senders < 1:
        raise PlanError(f"need at least one sending trainer rank, got {num_senders}")
    if len(set(targets)) != len(targets):
        raise PlanError("each (engine, engine rank) may be listed once")
    assigned: list[list[Target]] = [[] for _ in range(num_senders)]
    owners: dict[Hashable, list[int]] = {}
    pending = sorted(targets)

    for sender in range(min(num_senders, len(pending))):
        fresh = [t for t in pending if t.layout_key not in owners]
        pick = fresh[0] if fresh else pending[0]
        pending.remove(pick)
        assigned[sender].append(pick)
        owners.setdefault(pick.layout_key, []).append(sender)

    for target in pending:
        candidates = owners.get(target.layout_key) or range(num_senders)
        sender = min(candidates, key=lambda s: (len(assigned[s]), s))
        assigned[sender].append(target)
        if sender not in owners.setdefault(target.layout_key, []):
            owners[target.layout_key].append(sender)
    return assigned
