"""Which trainer rank writes which engine rank: a pure function, no I/O.

The senders are the trainer ranks that hold the same (gathered) weights. A target is
one (engine, engine rank) with the bytes an update writes there. The rules:

1. every target gets exactly one sender;
2. when there are at least as many targets as senders, every sender writes something;
3. bytes are balanced, not target counts: no target is split, so the busiest sender
   writes at least ``max(total / senders, largest target)``, and the assignment aims at
   that (MoE ranks under EP, first-k dense layers, embeddings and heads make targets
   unequal, and engines of different TP sizes differ by whole factors);
4. a sender that loads one layout's bytes also takes other targets of that layout (the
   same rank of identical engines) where that costs no balance: it loads them once and
   writes them several times;
5. deterministic: the same targets give the same assignment on every trainer rank.

How. Targets sharing a layout form a class (equal bytes). Each class is cut into
pieces of at most ``k`` targets, for ``k`` from the largest class down to 1 (halving),
and for each ``k`` the pieces are placed largest first on the sender with the fewest
bytes (ties: one that already loads the layout, then the fewest targets, then the
lowest rank); then targets are moved or swapped off the busiest sender while that
lowers it. Of these candidates the one with the fewest bytes on its busiest sender
wins, except that one within ``SHARE_TOLERANCE`` of it that loads fewer bytes in all
(more sharing) is preferred.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from p2pweights.errors import PlanError

__all__ = ["SHARE_TOLERANCE", "Target", "assign_targets", "busiest_bytes", "loaded_bytes"]

SHARE_TOLERANCE = 0.02
"""How much more (relative) the busiest sender may write so that senders load fewer
distinct layouts. Loading is the staging copy, writing is the NIC: on a GPU cluster the
NIC is the slower link, so only a small imbalance is traded for sharing."""

_MAX_IMPROVEMENTS_PER_TARGET = 4


@dataclass(frozen=True, order=True)
class Target:
    """One engine rank to be written, the key of the bytes it needs, and how many."""

    engine_index: int
    engine_rank: int
    layout_key: Hashable = field(default=None, compare=False)
    """Equal for targets that receive the same bytes (one replica)."""
    num_bytes: int = field(default=0, compare=False)
    """What one update writes to this target."""

    def __str__(self) -> str:
        return f"engine {self.engine_index} rank {self.engine_rank}"


def assign_targets(num_senders: int, targets: Sequence[Target]) -> list[list[Target]]:
    """Split ``targets`` among ``num_senders``; entry ``s`` lists what sender ``s`` writes,
    in (engine, engine rank) order."""
    if num_senders < 1:
        raise PlanError(f"need at least one sending trainer rank, got {num_senders}")
    if len(set(targets)) != len(targets):
        raise PlanError("each (engine, engine rank) may be listed once")
    if any(t.num_bytes < 0 for t in targets):
        raise PlanError("a target's num_bytes cannot be negative")
    if all(t.num_bytes == 0 for t in targets):  # no bytes to balance: spread them evenly
        ordered = sorted(targets)
        return [ordered[s::num_senders] for s in range(num_senders)]
    classes = _classes(targets)
    largest_class = max((len(members) for members in classes), default=1)
    candidates: list[tuple[int, int, list[list[Target]]]] = []  # (busiest, loaded, plan)
    lower_bound = _lower_bound(num_senders, targets)
    for cut in _cuts(largest_class):
        plan = _place(num_senders, _pieces(classes, cut))
        if len(targets) >= num_senders and not all(plan):
            continue  # a sender would idle while targets wait: not a candidate
        candidates.append((busiest_bytes(plan), loaded_bytes(plan), plan))
        improved = [list(sender) for sender in plan]
        if _improve(improved, lower_bound):
            candidates.append((busiest_bytes(improved), loaded_bytes(improved), improved))
    best = min(busiest for busiest, _, _ in candidates)
    allowed = best * (1 + SHARE_TOLERANCE)
    _, _, chosen = min(
        (c for c in candidates if c[0] <= allowed), key=lambda c: c[1]
    )  # min() keeps the first of equals: the least cut
    return [sorted(sender) for sender in chosen]


def busiest_bytes(plan: Sequence[Sequence[Target]]) -> int:
    """Bytes the busiest sender writes."""
    return max((sum(t.num_bytes for t in sender) for sender in plan), default=0)


def loaded_bytes(plan: Sequence[Sequence[Target]]) -> int:
    """Bytes all senders load (each loads a layout once, however many targets it has)."""
    return sum(sum({t.layout_key: t.num_bytes for t in sender}.values()) for sender in plan)


def _classes(targets: Sequence[Target]) -> list[list[Target]]:
    """Targets by layout (each sorted), classes in the order of their first target."""
    by_key: dict[Hashable, list[Target]] = {}
    for target in sorted(targets):
        by_key.setdefault(_layout(target), []).append(target)
    return list(by_key.values())


def _layout(target: Target) -> Hashable:
    # a target without a layout key shares its bytes with no other target
    return target.layout_key if target.layout_key is not None else ("target", target)


def _cuts(largest_class: int) -> list[int]:
    """Piece sizes to try: the largest class whole, then halving down to single targets."""
    cuts, cut = [largest_class], largest_class
    while cut > 1:
        cut = -(-cut // 2)
        cuts.append(cut)
    return cuts


def _pieces(classes: list[list[Target]], cut: int) -> list[list[Target]]:
    """Each class cut into near-equal contiguous pieces of at most ``cut`` targets."""
    pieces = []
    for members in classes:
        count = -(-len(members) // cut)
        size, extra = divmod(len(members), count)
        start = 0
        for i in range(count):
            end = start + size + (1 if i < extra else 0)
            pieces.append(members[start:end])
            start = end
    # largest first; equal pieces in class order (stable sort)
    return sorted(pieces, key=lambda piece: -sum(t.num_bytes for t in piece))


def _place(num_senders: int, pieces: list[list[Target]]) -> list[list[Target]]:
    """Largest piece first onto the sender with the fewest bytes (LPT)."""
    plan: list[list[Target]] = [[] for _ in range(num_senders)]
    loads = [0] * num_senders
    owners: dict[Hashable, set[int]] = {}
    for piece in pieces:
        fewest = min(loads)
        layout = _layout(piece[0])
        sharing = owners.get(layout, set())
        sender = min(
            (s for s in range(num_senders) if loads[s] == fewest),
            key=lambda s: (s not in sharing, len(plan[s]), s),
        )
        plan[sender].extend(piece)
        loads[sender] += sum(t.num_bytes for t in piece)
        owners.setdefault(layout, set()).add(sender)
    return plan


def _lower_bound(num_senders: int, targets: Sequence[Target]) -> int:
    """No assignment's busiest sender writes less than this: the ideal split, the largest
    target, for each j the j + 1 smallest of the largest j x S + 1 targets (some sender
    holds j + 1 of those), and the ideal split in whole units of the smallest target
    (every target rounded down to such units still has to be split whole)."""
    sizes = sorted((t.num_bytes for t in targets), reverse=True)
    if not sizes:
        return 0
    bound = max(-(-sum(sizes) // num_senders), sizes[0])
    j = 1
    while j * num_senders < len(sizes):
        top = j * num_senders + 1
        bound = max(bound, sum(sizes[top - j - 1 : top]))
        j += 1
    unit = sizes[-1]
    if unit > 0:
        bound = max(bound, unit * -(-sum(size // unit for size in sizes) // num_senders))
    return bound


def _improve(plan: list[list[Target]], lower_bound: int) -> bool:
    """Move or swap targets off the busiest sender while that lowers it (in place);
    whether anything moved.

    Each step strictly lowers the sum of squared sender loads, so it ends; it is
    bounded anyway, and stops once the busiest sender is at the lower bound.
    """
    loads = [sum(t.num_bytes for t in sender) for sender in plan]
    moved = False
    for _ in range(_MAX_IMPROVEMENTS_PER_TARGET * sum(len(sender) for sender in plan) + 1):
        busiest = max(range(len(plan)), key=lambda s: (loads[s], -s))
        if loads[busiest] <= lower_bound or not _move(plan, loads, busiest):
            break
        moved = True
    return moved


def _move(plan: list[list[Target]], loads: list[int], busiest: int) -> bool:
    """The best single move or swap off ``busiest`` that lowers it; False if none does."""
    top = loads[busiest]
    best: tuple[int, int, int, int] | None = None  # (new max, sender, i on busiest, j | -1)
    lightest = min(range(len(plan)), key=lambda s: (loads[s], s))
    # later targets first: among equal moves, the earliest targets stay where they are
    for i in reversed(range(len(plan[busiest]))):
        target = plan[busiest][i]
        if lightest != busiest and len(plan[busiest]) > 1:
            new = max(top - target.num_bytes, loads[lightest] + target.num_bytes)
            if new < top and (best is None or new < best[0]):
                best = (new, lightest, i, -1)
        for sender, others in enumerate(plan):
            if sender == busiest:
                continue
            for j, other in enumerate(others):
                delta = target.num_bytes - other.num_bytes
                if delta <= 0:
                    continue
                new = max(top - delta, loads[sender] + delta)
                if new < top and (best is None or new < best[0]):
                    best = (new, sender, i, j)
    if best is None:
        return False
    _, sender, i, j = best
    target = plan[busiest].pop(i)
    loads[busiest] -= target.num_bytes
    if j >= 0:
        other = plan[sender].pop(j)
        plan[busiest].append(other)
        loads[busiest] += other.num_bytes
        loads[sender] -= other.num_bytes
    plan[sender].append(target)
    loads[sender] += target.num_bytes
    return True
