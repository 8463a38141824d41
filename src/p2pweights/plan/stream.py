"""One update's tensors, checked against what the first update established, as ready groups.

The first update fixes the contract: the HF names, shapes and dtypes the loaders were
probed with (after it was itself checked against the engine's checkpoint). Every
later update must send the same. A sequence or mapping is checked whole before any
byte moves; an iterator is checked tensor by tensor as it streams (the first bad
tensor then stops the update after some bytes were written; the engines stay paused
and show the update as incomplete until a later update completes).

A partial update declares the HF names it sends (``subset``): only the parameter groups
those feed are written, the rest of every engine keeps its bytes. The subset is said,
never guessed: a name outside it, a name of it missing from the update, or a parameter
group it covers only in part (q_proj without k_proj and v_proj of a fused qkv) is
refused before any byte moves, naming the tensors.

Every input must stay unchanged from the moment it is received (the call, for a
sequence or mapping; its yield, for an iterator) until its bytes were read: each
tensor's version counter and data pointer are recorded on receipt and checked right
before its bytes are read (``source.receipts``; its ``checked_loaders`` wraps the replicas
for that).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

import torch

from p2pweights.errors import ConfigError
from p2pweights.plan.byte_plan import BytePlan, GroupPlan
from p2pweights.source.checkpoint_format import QuantizeToBlockFp8
from p2pweights.source.collect import ConvertingCollector
from p2pweights.source.finite import check_finite
from p2pweights.source.fp8_block import SCALE_SUFFIX
from p2pweights.source.fp8_regions import Read, block_box
from p2pweights.source.inputs import InputSpec, check_input
from p2pweights.source.receipts import Receipts

__all__ = ["UpdateSource"]

ReadyGroup = tuple[GroupPlan, Sequence[tuple[str, torch.Tensor]]]
Reads = Mapping[str, "list[Read] | None"]
"""Per loader input a replica loaded, the views its replayed loads read (None: a load of
it runs the loader)."""


class ReadRecorder(Protocol):
    """A replica's record of what its replayed loads read (``ReplicaHandle``)."""

    @property
    def replays_changed(self) -> int: ...

    def input_reads(self) -> Reads: ...


def _views(
    name: str, readers: Mapping[str, set[Hashable]], reads: Mapping[Hashable, Reads]
) -> list[Read] | None:
    """Every view ``name``'s replicas read of it; None unless each replays every load."""
    out: list[Read] = []
    for key in readers.get(name, ()):
        views = reads.get(key, {}).get(name)
        if views is None:
            return None
        out += views
    return out


class UpdateSource:
    """Trainer tensors -> (planned group, loader inputs), converted and checked."""

    def __init__(
        self,
        known: Mapping[str, InputSpec],
        groups: Mapping[Hashable, Sequence[Iterable[str]]],
        formats: Mapping[Hashable, object],
        *,
        finite: bool = False,
    ):
        """``known``: the first update's specs; ``groups[key]``: each replica's groups'
        HF names, in plan order; ``formats[key]``: its checkpoint format;
        ``finite``: refuse NaN / Inf."""
        self.known = dict(known)
        self._groups = groups
        self._formats = dict(formats)
        self._finite = finite
        self.convert_s = 0.0
        # Weights quantized only in the blocks this sender's loaders read (``use_regions``).
        self.regions = 0
        # The recordings' change counts the regions were learned from.
        self._reads_seen: tuple[int, ...] | None = None

    def learn_regions(self, replicas: Mapping[Hashable, ReadRecorder]) -> None:
        """After writes landed: quantize, from the next update on, only the blocks the
        replicas' checked recordings read, if those changed since they were last learned."""
        keys = self.quantizing_keys()
        seen = tuple(replicas[key].replays_changed for key in keys)
        if not keys or seen == self._reads_seen:
            return
        self._reads_seen = seen
        self.use_regions({key: replicas[key].input_reads() for key in keys})

    def forget_regions(self) -> None:
        """After a failed write (a loader may have to run again): quantize whole."""
        self._reads_seen = None
        self.use_regions({})

    def quantizing_keys(self) -> list[Hashable]:
        """The replicas whose loaders read weights this sender quantizes."""
        return [k for k, f in self._formats.items() if isinstance(f, QuantizeToBlockFp8)]

    def use_regions(self, reads: Mapping[Hashable, Reads]) -> None:
        """Quantize each weight only in the blocks its loaders read, where every replica
        reading it (or its scale) replays every load of it from a checked recording
        (``reads[key]``: ``ModelReplica.input_reads``); the rest whole. ``{}`` quantizes
        everything whole again (after a failed update)."""
        lanes: dict[Hashable, list[Hashable]] = {}
        for key in self.quantizing_keys():
            lanes.setdefault(self._formats[key].key, []).append(key)  # type: ignore[attr-defined]
        self.regions = 0
        for keys in lanes.values():
            fmt = self._formats[keys[0]]
            assert isinstance(fmt, QuantizeToBlockFp8)
            readers: dict[str, set[Hashable]] = {}
            for key in keys:
                for names in self._groups[key]:
                    for name in names:
                        readers.setdefault(name, set()).add(key)
            regions = {}
            for name in sorted(fmt.names & self.known.keys()):
                weight = _views(name, readers, reads)
                scale = _views(name + SCALE_SUFFIX, readers, reads)
                if weight is None or scale is None:
                    continue  # some loader of it still runs: whole
                box = block_box(self.known[name].shape, fmt.fmt.block, weight, scale)
                if box is not None:
                    regions[name] = box
            with_regions = dataclasses.replace(fmt, regions=regions)
            for key in keys:
                self._formats[key] = with_regions
            self.regions += len(regions)

    def check_subset(self, subset: frozenset[str]) -> None:
        """A partial update's declared names: each one the first update sent, and every
        parameter group they feed fed whole by them."""
        unknown = sorted(subset - self.known.keys())
        if unknown:
            raise ConfigError(
                f"the update's subset names {len(unknown)} HF tensor(s) the first update did "
                f"not send: {', '.join(unknown[:8])}"
            )
        for key_groups in self._groups.values():
            for names in key_groups:
                needed = set(names) & self.known.keys()
                given = needed & subset
                if given and given != needed:
                    raise ConfigError(
                        f"the update's subset feeds a parameter group only in part: it has "
                        f"{', '.join(sorted(given))} but not {', '.join(sorted(needed - given))}, "
                        f"which the engine loads together; add them to the subset"
                    )

    def check_whole(
        self, tensors: Sequence[tuple[str, torch.Tensor]], subset: frozenset[str] | None = None
    ) -> None:
        """Every tensor matches the contract and none of it (of ``subset``, for a partial
        update) is missing (before any write)."""
        seen = set()
        for name, tensor in tensors:
            self._check(name, tensor, subset)
            if name in seen:
                raise ConfigError(f"HF tensor {name!r} was given twice in one update")
            seen.add(name)
        wanted = set(self.known) if subset is None else set(subset)
        missing = sorted(wanted - seen)
        if missing:
            said = "the first update sent" if subset is None else "its declared subset names"
            raise ConfigError(
                f"this update lacks {len(missing)} HF tensor(s) {said}: {', '.join(missing[:8])}"
            )

    def _check(self, name: str, tensor: torch.Tensor, subset: frozenset[str] | None) -> None:
        check_input(name, tensor, self.known)
        if subset is not None and name not in subset:
            raise ConfigError(
                f"HF tensor {name!r} is not in this update's declared subset; add it to the "
                f"subset, or leave it out of the update"
            )
        if self._finite:
            check_finite(name, tensor)

    def _groups_of(
        self, subset: frozenset[str] | None
    ) -> Mapping[Hashable, Sequence[Iterable[str]]]:
        """The groups to collect: all, or those ``subset`` feeds (the others emptied, so
        every group keeps its index in the plan and none waits for an input)."""
        if subset is None:
            return self._groups
        return {
            key: [names if set(names) & subset else () for names in key_groups]
            for key, key_groups in self._groups.items()
        }

    def ready(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        plan: BytePlan,
        *,
        checked: bool,
        receipts: Receipts | None = None,
        subset: frozenset[str] | None = None,
    ) -> Iterator[ReadyGroup]:
        """The planned groups with their inputs, as the tensors complete them (those
        ``subset`` feeds, for a partial update; ``check_subset`` first).

        ``checked``: the tensors went through ``check_whole`` already.
        ``receipts``: where each tensor is recorded as it arrives from an iterator (a
        sequence's tensors were recorded by whoever read them; without ``receipts``, here,
        at once), to be checked before its bytes are converted (here) or loaded (the
        loaders ``checked_loaders`` makes with the same receipts).
        """
        if receipts is None:
            receipts = Receipts()
            if isinstance(tensors, Sequence):
                receipts.record_all(tensors)
        if not isinstance(tensors, Sequence):
            tensors = receipts.recording(tensors)
        collector = ConvertingCollector(
            self._groups_of(subset),
            self._formats,  # type: ignore[arg-type]
            before_read=receipts.check,
        )
        try:
            for name, tensor in tensors:
                if not checked:
                    self._check(name, tensor, subset)
                for key, index, inputs in collector.add(name, tensor):
                    yield plan.group(key, index), inputs
            for key, index, inputs in collector.flush():
                yield plan.group(key, index), inputs
            collector.raise_if_incomplete()
        finally:
            self.convert_s = collector.convert_s
