"""The byte plan of an update: where every staged byte goes, checked once, before any write.

Pure: built from the probe's parameter groups, the replicas' parameter sizes, the
regions each target engine rank published and the configured buffer size; no
sglang, no transport, no I/O, so it is unit-tested on its own.

A group (parameters loaded together from the same HF inputs) is staged as one
block of ``Slot``s, each parameter at an aligned offset from the block's start. The
executor places whole blocks into a staging buffer as their inputs complete (the
order in which a trainer yields tensors decides the placement, so it is not
planned); everything else is: each slot's size, and, for every engine rank that
needs the group, the destination address of each slot's write. Those writes are
checked here, the only place: every parameter an update feeds must be published by
each target and have exactly the bytes the replica lays out, so no write can leave
a region the engine published.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from p2pweights.errors import LayoutMismatchError
from p2pweights.report import EngineRankKey
from p2pweights.wire.publication import RankPublication

__all__ = [
    "ALIGNMENT_BYTES",
    "aligned",
    "Slot",
    "PlannedWrite",
    "TargetWrites",
    "GroupPlan",
    "BytePlan",
    "build_byte_plan",
    "target_writes",
]

ALIGNMENT_BYTES = 256
"""Every staged parameter starts at a multiple of this (cache lines, RDMA-friendly, dtype-safe)."""


def aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


@dataclass(frozen=True)
class Slot:
    """One parameter's bytes inside its group's staged block."""

    param: str
    offset: int
    """From the start of the group's block; a multiple of ``ALIGNMENT_BYTES``."""
    num_bytes: int


@dataclass(frozen=True)
class PlannedWrite:
    """Slot ``slot`` of a group goes to ``dst_address`` of one engine rank."""

    slot: int
    dst_address: int
    dst_device: int | None = None
    """The GPU the region lives on, where the engine published one (NIXL)."""
    src_offset: int = 0
    """Where in the slot the write starts (``dst_address`` is that byte's destination)."""
    num_bytes: int | None = None
    """How many bytes of the slot it writes; None: the slot's bytes from ``src_offset`` on.
    An owner sharing a parameter with other owners writes only its ranges of it
    (``plan.owners``)."""

    def length(self, slot: Slot) -> int:
        return slot.num_bytes - self.src_offset if self.num_bytes is None else self.num_bytes

    @property
    def whole(self) -> bool:
        """It writes its whole slot."""
        return self.src_offset == 0 and self.num_bytes is None


@dataclass(frozen=True)
class TargetWrites:
    """What one engine rank (one runner: target or draft) receives from one group."""

    target: RankPublication
    writes: tuple[PlannedWrite, ...]


@dataclass(frozen=True)
class GroupPlan:
    """One parameter group of one replica: its staged block and where it goes."""

    key: Hashable
    """The replica (shard layout) whose loaders make these bytes."""
    index: int
    """Its position among the replica's groups."""
    hf_names: frozenset[str]
    slots: tuple[Slot, ...]
    block_bytes: int
    """Staging bytes the block takes, alignment included."""
    targets: tuple[TargetWrites, ...]
    partial: bool = False
    """This rank writes only part of the slots (owner sends, ``plan.owners``): its loaders
    run on its own HF tensors alone, each slot is zeroed before, and the digests of its
    slots are summed with the other owners' before they are compared."""

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(slot.param for slot in self.slots)

    def unwritten(self) -> list[tuple[int, int]]:
        """Of a ``partial`` group: the ``[start, end)`` ranges of its slots (from the block's
        start) no write of this rank covers; empty for a whole one."""
        if not self.partial or not self.targets:
            return []
        written = sorted(
            (
                self.slots[w.slot].offset + w.src_offset,
                self.slots[w.slot].offset + w.src_offset + w.length(self.slots[w.slot]),
            )
            for w in self.targets[0].writes
        )
        out, at = [], 0
        for slot in self.slots:
            at = slot.offset
            for start, end in written:
                if end <= slot.offset or start >= slot.offset + slot.num_bytes:
                    continue
                if start > at:
                    out.append((at, start))
                at = max(at, end)
            if at < slot.offset + slot.num_bytes:
                out.append((at, slot.offset + slot.num_bytes))
        return out


@dataclass(frozen=True)
class BytePlan:
    """Every group of every replica this trainer rank stages, and the buffer size they need."""

    buffer_bytes: int
    """Each of the two staging buffers: the configured size, or the largest block if larger."""
    groups: Mapping[tuple[Hashable, int], GroupPlan] = field(repr=False)

    def group(self, key: Hashable, index: int) -> GroupPlan:
        return self.groups[(key, index)]

    @property
    def bytes_by_target(self) -> dict[EngineRankKey, int]:
        """Engine rank -> bytes one update writes there (drafts included)."""
        totals: dict[EngineRankKey, int] = {}
        for group in self.groups.values():
            for tw in group.targets:
                key = tw.target.key
                totals[key] = totals.get(key, 0) + sum(
                    w.length(group.slots[w.slot]) for w in tw.writes
                )
        return totals


def build_byte_plan(
    groups: Mapping[Hashable, Sequence[tuple[frozenset[str], Sequence[str]]]],
    param_bytes: Mapping[Hashable, Mapping[str, int]],
    targets: Mapping[Hashable, Sequence[RankPublication]],
    buffer_bytes: int,
) -> BytePlan:
    """Plan every group of every replica key.

    ``groups[key]``: the replica's groups as (HF names, parameter names);
    ``param_bytes[key][param]``: bytes the replica lays the parameter out in;
    ``targets[key]``: the engine ranks (publications) that replica's bytes go to.
    Raises ``LayoutMismatchError`` naming engine URL, rank and parameter if a target
    did not publish a parameter the update feeds, or published a different size.
    """
    plans: dict[tuple[Hashable, int], GroupPlan] = {}
    largest = 0
    for key, key_groups in groups.items():
        sizes = param_bytes[key]
        for index, (hf_names, params) in enumerate(key_groups):
            slots, offset = [], 0
            for param in params:
                slots.append(Slot(param, offset, sizes[param]))
                offset += aligned(sizes[param])
            writes = tuple(target_writes(pub, slots, hf_names) for pub in targets.get(key, ()))
            plans[(key, index)] = GroupPlan(
                key, index, frozenset(hf_names), tuple(slots), offset, writes
            )
            largest = max(largest, offset)
    return BytePlan(max(buffer_bytes, largest), plans)


def target_writes(
    pub: RankPublication, slots: Sequence[Slot], hf_names: frozenset[str]
) -> TargetWrites:
    writes = []
    for index, slot in enumerate(slots):
        region = pub.regions.get(slot.param)
        if region is None:
            raise LayoutMismatchError(
                f"{pub.where} did not publish parameter {slot.param!r}, which this update's HF "
                f"tensors {sorted(hf_names)[:4]} feed; nothing written"
            )
        if region.num_bytes != slot.num_bytes:
            raise LayoutMismatchError(
                f"{pub.where} parameter {slot.param!r}: the replica stages {slot.num_bytes} "
                f"bytes but the engine published {region.num_bytes}; refusing to write outside "
                f"the published region"
            )
        writes.append(PlannedWrite(index, region.address, region.gpu_id))
    return TargetWrites(pub, tuple(writes))
