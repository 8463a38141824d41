"""Sender side of delta updates: which staged slots go as deltas, to where, and the headers.

``DeltaSender`` lives as long as the executor: the previous update's bytes
(``PreviousBytes``) and the engine ranks holding them. ``DeltaRun`` is one update:
after a staging buffer was loaded, ``compare`` compares each staged slot with the
stored bytes (before the engines pause); once they opened, ``place`` decides: where
every engine rank the slot goes to holds the previous update and has room left in its
scratch region, the slot's delta entry is packed over the slot's own bytes in the
staging buffer (an entry is always smaller than the slot) and written to each rank's
scratch region at that rank's next offset; otherwise the slot is written in full. A
slot whose bytes did not change is not written at all. The last flush carries each
rank's header (``headers``): the update's sequence, the update its entries change,
their number and size. A rank whose publication has no scratch region gets full
writes.

Whether an update is a delta at all is ``DeltaPolicy``'s decision (``DeltaConfig.mode``),
made as the run begins from what earlier runs measured (``finish``): a run decided full
compares nothing and writes every slot whole; it stores its bytes only where the
policy wants the next update to be able to go as a delta (``Decision.keep_copy``), and
otherwise leaves the stored copy stale (no rank holds it: the next update is full).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from p2pweights.config import DeltaConfig
from p2pweights.delta.flush_compare import FlushSlot
from p2pweights.delta.policy import Decision, DeltaPolicy, Measured
from p2pweights.delta.store import FlushLayout, PreviousBytes
from p2pweights.report import EngineRankKey
from p2pweights.wire.delta import HEADER_BYTES, SCRATCH_NAME, DeltaEntry, PayloadHeader
from p2pweights.wire.landed import flag_names
from p2pweights.wire.publication import RankPublication, Runner

logger = logging.getLogger(__name__)

__all__ = [
    "DeltaRun",
    "DeltaSender",
    "DeltaSummary",
    "FullHeaders",
    "has_scratch",
    "with_scratch",
]


@dataclass
class DeltaSummary:
    """What one update's deltas saved."""

    full_bytes: int = 0
    """Bytes a full update would have written (every staged slot to each of its ranks)."""
    sent_bytes: int = 0
    """Bytes written instead: full slots, delta entries and headers."""
    num_delta_slots: int = 0
    num_full_slots: int = 0
    num_unchanged_slots: int = 0
    store_bytes: int = 0
    """Memory the copy of the previous update's bytes takes."""
    decision: Decision | None = None
    """Whether the update went as a delta or in full, why, and the seconds predicted
    for each (``DeltaConfig.mode``; ``Decision.describe`` says it in a line)."""

    @property
    def fraction(self) -> float:
        return self.sent_bytes / self.full_bytes if self.full_bytes else 1.0


@dataclass(frozen=True)
class SlotWrites:
    """Where one staged slot goes instead of its parameter: ``num_bytes`` (its entry,
    0: unchanged) to each rank's scratch (address, GPU)."""

    num_bytes: int
    dst: Mapping[Runner, tuple[int, int | None]]


class DeltaSender:
    """The previous update's bytes and the ranks that hold them, for a session."""

    def __init__(self, config: DeltaConfig) -> None:
        self.config = config
        self.store = PreviousBytes(torch.device("cpu") if config.store == "host" else None)
        self.policy = DeltaPolicy(config.mode, objective=config.objective)

    def begin(self, connected: Mapping[Runner, RankPublication]) -> DeltaRun:
        """A run, as a delta or in full as the policy decides (a delta only where some
        rank publishing a scratch region holds the stored bytes)."""
        can_delta = any(self.store.holds(runner) for runner in with_scratch(connected))
        return DeltaRun(self, connected, decision=self.policy.decide(can_delta))

    def finish(
        self,
        run: DeltaRun,
        failed: Iterable[EngineRankKey],
        *,
        compare_s: float = 0.0,
        wait_s: float = 0.0,
        compare_paused_s: float | None = None,
    ) -> None:
        """The run ended: ranks that failed get full writes next time; with any failure
        the update failed, and everything is forgotten. What it measured (``compare_s``
        comparing its flushes, ``wait_s`` waiting for its writes) goes to the policy."""
        if any(True for _ in failed):
            self.forget()
            return
        if run.decision.keep_copy:
            self.store.finish(run.sequence, run.scratch, run.num_flushes)
        else:
            self.store.stale()
        run.summary.store_bytes = self.store.num_bytes
        self.policy.observe(
            Measured(
                run.decision.mode,
                full_bytes=run.summary.full_bytes,
                sent_bytes=run.summary.sent_bytes,
                compare_s=compare_s + run.pack_s,
                wait_s=wait_s,
                compare_paused_s=None
                if compare_paused_s is None
                else compare_paused_s + run.pack_s,  # entries are packed once the engines pause
            )
        )

    def forget(self) -> None:
        """An update failed: the next one is written in full."""
        if self.store.sequence or self.store.num_bytes:
            logger.info("p2pweights: delta state forgotten; the next update is written in full")
        self.store.forget()

    def forget_target(self, runner: Runner) -> None:
        self.store.forget_target(runner)


@dataclass
class DeltaRun:
    """One update's delta decisions."""

    sender: DeltaSender
    connected: Mapping[Runner, RankPublication]
    decision: Decision = field(default_factory=lambda: Decision("delta", True, "always"))
    """Whether this update compares and sends deltas (``DeltaPolicy.decide``)."""
    sequence: int = 0
    base: int = 0
    scratch: dict[Runner, RankPublication] = field(default_factory=dict)
    """Runners publishing a scratch region: they get a header every update."""
    summary: DeltaSummary = field(default_factory=DeltaSummary)
    _holders: set[Runner] = field(default_factory=set)
    _offsets: dict[Runner, int] = field(default_factory=dict)
    _entries: dict[Runner, int] = field(default_factory=dict)
    _names: dict[Runner, dict[str, int]] = field(default_factory=dict)
    _slots: dict[tuple[int, int], SlotWrites] = field(default_factory=dict)

    num_flushes: int = 0
    """Flushes compared so far (a flush's position in the update)."""
    pack_s: float = 0.0
    """Seconds ``place`` took (deciding and packing entries)."""
    _started: bool = False
    _pending: list[tuple[tuple[int, int], DeltaEntry | None, frozenset[Runner], int, int]] = field(
        default_factory=list
    )

    def __post_init__(self) -> None:
        store = self.sender.store
        self.sequence, self.base = store.next_sequence(), store.sequence
        self.summary.decision = self.decision

    @property
    def max_headers(self) -> int:
        """Headers this run may write (one per runner connected)."""
        return len(self.connected)

    def _start(self) -> None:
        """The ranks holding the previous update, as connected when the run began."""
        if self._started:
            return
        self._started = True
        store = self.sender.store
        self.scratch = with_scratch(self.connected)
        if self.decision.mode == "delta":  # else every slot is written whole
            self._holders = {r for r in self.scratch if store.holds(r)}
        self._offsets = dict.fromkeys(self.scratch, HEADER_BYTES)

    def compare(
        self,
        placed: Iterable[tuple[Hashable, int, Iterable[tuple[str, int, int]], frozenset[Runner]]],
        view: Callable[[int, int], torch.Tensor],
        elem_size: Callable[[Hashable, str], int],
    ) -> None:
        """Compare every slot of the groups just loaded with the stored bytes (and store
        the new ones): ``placed`` gives, per group, its replica key, an id, its slots
        (parameter, offset in the buffer, bytes) and its runners; ``view(offset,
        num_bytes)`` is the staging buffer's bytes. Runs before the engines pause; ``place``
        decides once they opened."""
        self._start()
        listed = [
            (key, param, offset, num_bytes, runners, (placed_id, index))
            for key, placed_id, group_slots, runners in placed
            for index, (param, offset, num_bytes) in enumerate(group_slots)
        ]
        if not listed:
            return
        if not self.decision.keep_copy:  # in full, and nothing stored: nothing to compare
            self.num_flushes += 1
            for _, _, offset, num_bytes, runners, slot_id in listed:
                self._pending.append((slot_id, None, runners, offset, num_bytes))
            return
        listed.sort(key=lambda slot: slot[2])  # by offset in the buffer
        start = min(offset for _, _, offset, _, _, _ in listed)
        end = max(offset + num_bytes for _, _, offset, num_bytes, _, _ in listed)
        layout = FlushLayout(
            tuple((key, param, offset - start, n) for key, param, offset, n, _, _ in listed),
            num_bytes=-(-(end - start) // 8) * 8,  # whole words: slots start 256-aligned
        )
        compare: list[FlushSlot | None] = []
        for key, param, offset, num_bytes, runners, _ in listed:
            param_index = self._param_index(runners, param)
            compare.append(
                None  # not every rank it goes to holds the previous update: a full write
                if param_index is None
                else FlushSlot(offset - start, num_bytes, elem_size(key, param), param_index)
            )
        entries = self.sender.store.compare_flush(
            self.num_flushes,
            layout,
            view(start, layout.num_bytes),
            compare,
            max_fraction=self.sender.config.max_fraction,
        )
        self.num_flushes += 1
        for (_, _, offset, num_bytes, runners, slot_id), entry in zip(listed, entries, strict=True):
            self._pending.append((slot_id, entry, runners, offset, num_bytes))

    def place(self, view: Callable[[int, int], torch.Tensor]) -> None:
        """Decide the slots ``compare`` saw, against the publications current now (the
        engines opened: a rank that published afresh takes full writes); a delta's entry
        is packed over its slot's bytes. The decisions hold until the next call (``slot``)."""
        started = time.perf_counter()
        self._place(view)
        self.pack_s += time.perf_counter() - started

    def _place(self, view: Callable[[int, int], torch.Tensor]) -> None:
        self._refresh()
        self._slots = {}  # one flush's: ids of its groups may be reused by the next
        pending, self._pending = self._pending, []
        for slot_id, entry, runners, offset, num_bytes in pending:
            self.summary.full_bytes += num_bytes * len(runners)
            if entry is not None and not runners <= self._holders:
                entry = None
            if entry is not None and entry.count == 0:
                self._slots[slot_id] = SlotWrites(0, {})
                self.summary.num_unchanged_slots += 1
                continue
            if entry is None or not self._fits(runners, entry.num_bytes):
                self.summary.sent_bytes += num_bytes * len(runners)
                self.summary.num_full_slots += 1
                continue
            dst = {}
            for runner in runners:
                region = self.scratch[runner].regions[SCRATCH_NAME]
                dst[runner] = (region.address + self._offsets[runner], region.gpu_id)
                self._offsets[runner] += entry.num_bytes
                self._entries[runner] = self._entries.get(runner, 0) + 1
            entry.pack_into(view(offset, num_bytes))  # over the slot's bytes, already stored
            self._slots[slot_id] = SlotWrites(entry.num_bytes, dst)
            self.summary.sent_bytes += entry.num_bytes * len(runners)
            self.summary.num_delta_slots += 1

    def _refresh(self) -> None:
        """Holders whose publication moved since the run began (republished when their
        update session opened) lose their deltas; headers go to the current addresses."""
        self._start()
        for runner, old in list(self.scratch.items()):
            new = self.connected.get(runner)
            if new is None or not has_scratch(new):
                del self.scratch[runner]
                self._holders.discard(runner)
                continue
            if new.regions != old.regions or new.reached_through != old.reached_through:
                self._holders.discard(runner)
            self.scratch[runner] = new

    def slot(self, placed_id: int, index: int) -> SlotWrites | None:
        """Where a slot ``place`` decided goes instead (None: written in full)."""
        return self._slots.get((placed_id, index))

    def headers(self) -> dict[Runner, PayloadHeader]:
        """Each scratch-publishing runner's header, once every slot was encoded."""
        self._start()
        self.summary.sent_bytes += HEADER_BYTES * len(self.scratch)
        out = {}
        for runner in self.scratch:
            count = self._entries.get(runner, 0)
            base = self.base if count else 0
            out[runner] = PayloadHeader(self.sequence, base, count, self._offsets[runner])
        return out

    def _param_index(self, runners: frozenset[Runner], param: str) -> int | None:
        """The parameter's index in every runner's sorted published names, where every
        runner holds the previous update and all agree; else None (a full write)."""
        if not runners or not runners <= self._holders:
            return None
        indices = set()
        for runner in runners:
            names = self._names.get(runner)
            if names is None:
                # the parameters only: not the scratch region, not the landed flags
                published = flag_names(self.scratch[runner].regions)
                names = self._names[runner] = {n: i for i, n in enumerate(published)}
            indices.add(names.get(param))
        (index,) = indices if len(indices) == 1 else (None,)
        return index

    def _fits(self, runners: frozenset[Runner], num_bytes: int) -> bool:
        return all(
            self._offsets[r] + num_bytes <= self.scratch[r].regions[SCRATCH_NAME].num_bytes
            for r in runners
        )


def has_scratch(pub: RankPublication) -> bool:
    """Whether ``pub`` has a scratch region a header fits in. The parser refuses a smaller
    one (``parse_publication``); a publication built otherwise is checked again here, so
    no header is ever written past the region's end: such a rank gets full writes."""
    region = pub.regions.get(SCRATCH_NAME)
    return region is not None and region.num_bytes >= HEADER_BYTES


def with_scratch(connected: Mapping[Runner, RankPublication]) -> dict[Runner, RankPublication]:
    """The runners of ``connected`` whose scratch region takes a header."""
    return {runner: pub for runner, pub in connected.items() if has_scratch(pub)}


@dataclass
class FullHeaders:
    """The headers of an update sent without deltas: each runner publishing a scratch
    region gets one without entries (a full update). It replaces whatever payload is
    there: one a delta sender wrote and could not see applied (it died before the
    engine's end, and this update took over the engine's open session) would otherwise
    be applied over this update's bytes. The engine rank then holds this update, so a
    delta against an earlier one is refused there."""

    connected: Mapping[Runner, RankPublication]
    scratch: dict[Runner, RankPublication] = field(default_factory=dict)

    @property
    def max_headers(self) -> int:
        return len(with_scratch(self.connected))

    def headers(self) -> dict[Runner, PayloadHeader]:
        """Against the publications current now."""
        self.scratch = with_scratch(self.connected)
        sequence = time.time_ns()
        return {runner: PayloadHeader(sequence, 0, 0, HEADER_BYTES) for runner in self.scratch}
