"""Owner sends: each trainer rank writes the HF tensors it owns, to every engine rank.

A trainer rank under expert parallelism holds its own experts only; gathering them to
every rank before sending moves each expert to ranks that do not write it. With owner
sends a rank hands ``update()`` the tensors it holds: those it owns alone (declared by
the input's ``owned()``, see ``source.owned``) and the replicated ones every rank of its
pipeline stage holds whole. The first update gathers every rank's claim once
(``ownership_of``: two ranks claiming one tensor, or a tensor some ranks of a stage send
whole and others neither send nor own, are refused naming it); later updates must send
the same names.

The plan (``plan_owned``), per replica (one per engine layout) and parameter group:

* replicated inputs only: as without owners, to the engine ranks this rank is assigned;
* owned inputs of this rank only: staged whole, to every engine rank of the layout;
* owned inputs of several ranks (the fused experts of a layer on a TP engine rank): each
  owner runs the loaders of its own inputs alone into a zeroed copy of the group and
  writes only the byte ranges they write (``Replica.written_spans``, found on meta);
  bytes no owner's inputs write go with the first owner's (zeros, as sglang's loader
  leaves them); ranges of two owners that overlap are refused, naming the parameter;
* owned and replicated inputs in one group: refused;
* sharded inputs (``Shard(d)`` slices of one tensor on several holders): each holder writes
  the bytes its rows make (found by loading markers, ``_marker_spans``); where the loaders
  compute on values across holders' rows (their bytes overlap) or take the tensor
  quantized (an fp8 block may span two holders), the group's tensors are *gathered*
  instead: every holder all-gathers each such tensor's slices while reading its input
  (``OwnedPlan.gathered``), and the group is then planned as a replicated one.

Pure but for the replicas' probes; no transport, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from p2pweights.errors import ConfigError
from p2pweights.plan.byte_plan import (
    BytePlan,
    GroupPlan,
    Slot,
    TargetWrites,
    aligned,
    target_writes,
)
from p2pweights.replica.base import merged
from p2pweights.replica.registry import ReplicaHandle
from p2pweights.source.fp8_block import SCALE_SUFFIX
from p2pweights.source.inputs import InputSpec
from p2pweights.wire.publication import RankPublication, Runner

__all__ = [
    "Claim",
    "OwnedGroup",
    "OwnedPlan",
    "Owner",
    "Ownership",
    "build_owned_plan",
    "ownership_of",
    "plan_owned",
]

Owner = tuple[int, int]
"""(pipeline stage, trainer rank): one sending trainer rank."""

Spans = tuple[tuple[int, int], ...]
"""Sorted, disjoint ``[start, end)`` byte ranges of one parameter."""


@dataclass(frozen=True)
class Claim:
    """What one trainer rank said at the first update: its inputs, and those it owns."""

    owner: Owner
    specs: Mapping[str, InputSpec]
    owned: frozenset[str]
    shards: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)
    """HF name -> (dim, start, stop) of the slice this rank holds (its tensor is sent
    whole-shaped, zero outside the slice)."""


@dataclass(frozen=True)
class Ownership:
    """Who owns which HF tensor; the others are replicated (whole on every rank of a stage)."""

    owners: Mapping[str, Owner]
    shards: Mapping[str, Mapping[Owner, tuple[int, int, int]]] = field(default_factory=dict)
    """HF name -> each holder's (dim, start, stop): together they tile the tensor."""
    senders: frozenset[Owner] = frozenset()
    """Every sending trainer rank that made a claim."""

    def owner_of(self, engine_name: str) -> Owner | None:
        """The owner of a loader input (an fp8 weight's scale belongs to its weight's owner)."""
        found = self.owners.get(engine_name)
        if found is None and engine_name.endswith(SCALE_SUFFIX):
            found = self.owners.get(engine_name.removesuffix(SCALE_SUFFIX))
        return found

    def __bool__(self) -> bool:
        return bool(self.owners) or bool(self.shards)

    def holders_of(self, engine_name: str) -> Mapping[Owner, tuple[int, int, int]]:
        """Each holder's slice of a sharded loader input (empty: not sharded)."""
        found = self.shards.get(engine_name)
        if found is None and engine_name.endswith(SCALE_SUFFIX):
            found = self.shards.get(engine_name.removesuffix(SCALE_SUFFIX))
        return found or {}


def ownership_of(claims: Sequence[Claim]) -> tuple[dict[str, InputSpec], Ownership]:
    """Every rank's inputs as one, and who owns what.

    Raises ``ConfigError`` naming the HF tensor if two ranks own it, one owns it and
    another sends it whole, ranks send it with different shapes or dtypes, or some ranks
    of a pipeline stage send it whole and others of that stage do not (and nobody owns it).
    """
    owners: dict[str, Owner] = {}
    for claim in sorted(claims, key=lambda c: c.owner):
        for name in sorted(claim.owned):
            if name not in claim.specs:
                raise ConfigError(
                    f"{_rank(claim.owner)} declares HF tensor {name!r} owned but does not send it"
                )
            if name in owners:
                raise ConfigError(
                    f"HF tensor {name!r} is claimed by {_rank(owners[name])} and "
                    f"{_rank(claim.owner)}; each owned tensor must have exactly one owner"
                )
            owners[name] = claim.owner
    union: dict[str, InputSpec] = {}
    senders: dict[str, list[Owner]] = {}
    for claim in claims:
        for name, spec in claim.specs.items():
            if union.setdefault(name, spec) != spec:
                raise ConfigError(
                    f"HF tensor {name!r} is sent as {spec.shape} {spec.dtype} by "
                    f"{_rank(claim.owner)} but as {union[name].shape} {union[name].dtype} "
                    f"by another rank"
                )
            if name not in claim.owned and name not in claim.shards:
                senders.setdefault(name, []).append(claim.owner)
    stages: dict[int, list[Owner]] = {}
    for claim in claims:
        stages.setdefault(claim.owner[0], []).append(claim.owner)
    sharded = {name for claim in claims for name in claim.shards}
    for name, sent_by in sorted(senders.items()):
        if name in sharded:
            raise ConfigError(
                f"HF tensor {name!r} is sharded on some ranks but sent whole by "
                f"{_rank(sent_by[0])}; a sharded tensor comes from its slices' holders only"
            )
        if name in owners:
            raise ConfigError(
                f"HF tensor {name!r} is owned by {_rank(owners[name])} but also sent whole by "
                f"{_rank(sent_by[0])}; an owned tensor comes from its owner only"
            )
        stage = sent_by[0][0]
        lacking = sorted(set(stages[stage]) - set(sent_by))
        if lacking:
            raise ConfigError(
                f"HF tensor {name!r} is sent whole by {_rank(sent_by[0])} but neither sent nor "
                f"owned by {_rank(lacking[0])}, and no rank owns it: a replicated tensor must "
                f"come from every rank of its pipeline stage, an owned one from its owner "
                f"(declared with p2pweights.owned_tensors)"
            )
        other = next((o for o in sent_by if o[0] != stage), None)
        if other is not None:
            raise ConfigError(
                f"HF tensor {name!r} was sent by pipeline stages {stage} and {other[0]}; each "
                f"tensor must come from one stage (drop tied copies on all but one)"
            )
    return union, Ownership(owners, _tiled(claims, union), frozenset(c.owner for c in claims))


def _tiled(
    claims: Sequence[Claim], union: Mapping[str, InputSpec]
) -> dict[str, dict[Owner, tuple[int, int, int]]]:
    """Each sharded tensor's slices by holder, refused unless they tile it along one dim."""
    shards: dict[str, dict[Owner, tuple[int, int, int]]] = {}
    for claim in claims:
        for name, found in claim.shards.items():
            shards.setdefault(name, {})[claim.owner] = found
    for name, held in sorted(shards.items()):
        dims = {dim for dim, _, _ in held.values()}
        if len(dims) > 1:
            raise ConfigError(f"HF tensor {name!r} is sharded along dims {sorted(dims)} at once")
        (dim,) = dims
        at, last = 0, (-1, -1)
        for owner, (_, start, stop) in sorted(held.items(), key=lambda item: item[1][1]):
            if start < at:
                raise ConfigError(
                    f"HF tensor {name!r}: {dim=} {start}..{at} are claimed by {_rank(last)} and "
                    f"{_rank(owner)}; each slice must have exactly one holder"
                )
            if start > at:
                raise ConfigError(f"HF tensor {name!r}: {dim=} {at}..{start} are held by no rank")
            at, last = stop, owner
        if at != union[name].shape[dim]:
            raise ConfigError(
                f"HF tensor {name!r}: {dim=} {at}..{union[name].shape[dim]} are held by no rank"
            )
    return shards


def _rank(owner: Owner) -> str:
    stage, rank = owner
    return f"trainer rank {rank}" if stage == 0 else f"pipeline stage {stage} trainer rank {rank}"


@dataclass(frozen=True)
class OwnedGroup:
    """One group this rank stages under owner sends, and which engine ranks it writes."""

    key: Hashable
    hf_names: frozenset[str]
    """The loader inputs this rank stages (its own, where the group is shared)."""
    params: tuple[str, ...]
    to_all: bool
    """Written to every engine rank of the layout (owned), else to this rank's assigned."""
    spans: Mapping[str, Spans] | None = None
    """Shared with other owners: per parameter, the byte ranges this rank writes."""


@dataclass
class OwnedPlan:
    """The first update's owned plan: the groups, replanned where publications moved."""

    groups: dict[Hashable, list[OwnedGroup]]
    assigned: frozenset[Runner]
    """The engine ranks (runners) this rank writes replicated groups to."""
    gathered: frozenset[str] = frozenset()
    """Sharded HF tensors whose slices every holder all-gathers before staging (their
    loaders mix holders' rows, or quantize blocks that may span two holders)."""

    def build(
        self,
        replicas: Mapping[Hashable, ReplicaHandle],
        targets: Mapping[Hashable, Sequence[RankPublication]],
        buffer_bytes: int,
    ) -> BytePlan:
        return build_owned_plan(self, replicas, targets, buffer_bytes)


def plan_owned(
    groups: Mapping[Hashable, Sequence[tuple[frozenset[str], Sequence[str]]]],
    engine_specs: Mapping[Hashable, Mapping[str, InputSpec]],
    ownership: Ownership,
    me: Owner,
    replicas: Mapping[Hashable, ReplicaHandle],
    assigned: Iterable[Runner],
    assigned_keys: Iterable[Hashable],
) -> OwnedPlan:
    """The groups this rank stages, for every replica.

    ``groups[key]``: the replica's probed groups (loader input names, parameters) of every
    rank's inputs; ``engine_specs[key]``: those inputs as the replica's loaders take them;
    ``assigned_keys``: the replicas of the engine ranks this rank is assigned.
    """
    own_keys = set(assigned_keys)
    out: dict[Hashable, list[OwnedGroup]] = {}
    gathered: set[str] = set()
    for key in sorted(groups, key=str):
        planned: list[OwnedGroup] = []
        for hf_names, params in groups[key]:
            sharded = {n for n in hf_names if ownership.holders_of(n)}
            if sharded:
                if sharded != hf_names:
                    raise ConfigError(
                        f"parameters {list(params)[:4]} are loaded from sharded HF tensors "
                        f"{sorted(sharded)[:3]} and whole ones {sorted(hf_names - sharded)[:3]} "
                        f"together; shard them all, or send them all whole"
                    )
                holders = set().union(*(ownership.holders_of(n) for n in hf_names))
                if me not in holders:
                    continue
                spans = _holder_spans(
                    key, hf_names, params, holders, ownership, engine_specs[key], replicas[key]
                )
                if spans is not None:
                    planned.append(OwnedGroup(key, hf_names, tuple(params), True, spans[me]))
                    continue
                gathered |= _gathered_inputs(hf_names, params, holders, ownership)
                if key in own_keys:  # whole on every holder now: a replicated group
                    planned.append(OwnedGroup(key, hf_names, tuple(params), to_all=False))
                continue
            by_owner: dict[Owner | None, set[str]] = {}
            for name in hf_names:
                by_owner.setdefault(ownership.owner_of(name), set()).add(name)
            if None in by_owner and len(by_owner) > 1:
                raise ConfigError(
                    f"parameters {list(params)[:4]} are loaded from owned HF tensors "
                    f"{sorted(by_owner[next(o for o in by_owner if o is not None)])[:3]} and "
                    f"replicated ones {sorted(by_owner[None])[:3]} together; send them all "
                    f"whole, or all owned"
                )
            if None in by_owner:
                if key in own_keys:
                    planned.append(OwnedGroup(key, hf_names, tuple(params), to_all=False))
                continue
            if me not in by_owner:
                continue
            if len(by_owner) == 1:
                planned.append(OwnedGroup(key, hf_names, tuple(params), to_all=True))
                continue
            spans = _shared_spans(key, params, by_owner, engine_specs[key], replicas[key])
            planned.append(OwnedGroup(key, frozenset(by_owner[me]), tuple(params), True, spans[me]))
        out[key] = planned
    return OwnedPlan(out, frozenset(assigned), frozenset(gathered))


def _shared_spans(
    key: Hashable,
    params: Sequence[str],
    by_owner: Mapping[Owner | None, set[str]],
    specs: Mapping[str, InputSpec],
    replica: ReplicaHandle,
) -> dict[Owner, dict[str, Spans]]:
    """Per owner of a shared group, the byte ranges of each parameter its own inputs'
    loaders write (found on meta)."""
    owners = {o: names for o, names in by_owner.items() if o is not None}
    found = {
        owner: replica.written_spans({n: specs[n] for n in sorted(names)})
        for owner, names in owners.items()
    }
    return _split(key, params, found, owners, replica)


def _holder_spans(
    key: Hashable,
    names: frozenset[str],
    params: Sequence[str],
    holders: Iterable[Owner],
    ownership: Ownership,
    specs: Mapping[str, InputSpec],
    replica: ReplicaHandle,
) -> dict[Owner, dict[str, Spans]] | None:
    """Each holder's byte ranges of a sharded group's parameters; None where they cannot
    be split by holder: the loaders take an input quantized (fp8 blocks may span two
    holders) or two holders' ranges overlap (the loaders compute across their rows)."""
    for name in names:
        held = ownership.shards.get(name, {})
        if specs[name].dtype.itemsize == 1 or not held:  # quantized, or its scale
            return None
        dim = next(iter(held.values()))[0]
        if max(stop for _, _, stop in held.values()) != specs[name].shape[dim]:
            return None  # the engine's format reshapes it: rows are not the HF tensor's
    found = _marker_spans(names, params, holders, ownership, specs, replica)
    if _overlap(params, found) is not None:
        return None
    return _split(key, params, found, {o: set(names) for o in found}, replica)


def _gathered_inputs(
    names: frozenset[str], params: Sequence[str], holders: Iterable[Owner], ownership: Ownership
) -> set[str]:
    """The HF tensors (an fp8 scale is its weight's) to gather for a group that cannot be
    split by holder; refused unless every sending rank holds a slice of each (they all
    take part in the gather, in input order)."""
    missing = sorted(ownership.senders - set(holders))
    if missing:
        raise ConfigError(
            f"parameters {list(params)[:4]} cannot be written by their HF tensors' holders "
            f"(their loaders mix the holders' rows or quantize across them), and gathering "
            f"{sorted(names)[:3]} needs every sending rank to hold a slice, but "
            f"{_rank(missing[0])} holds none; send these tensors whole"
        )
    return {name if name in ownership.shards else name.removesuffix(SCALE_SUFFIX) for name in names}


def _marker_spans(
    names: frozenset[str],
    params: Sequence[str],
    holders: Iterable[Owner],
    ownership: Ownership,
    specs: Mapping[str, InputSpec],
    replica: ReplicaHandle,
) -> dict[Owner, dict[str, Spans]]:
    """Per holder of sharded inputs, the byte ranges of each parameter its slices make:
    the loaders run (on the CPU) on inputs that are 1 in the holder's slices and 0
    elsewhere, into zeroed parameters; the elements left non-zero are its. A loader that
    mixes slices (or fills constants) makes two holders' ranges overlap."""
    import torch

    found: dict[Owner, dict[str, Spans]] = {}
    for owner in sorted(holders):
        inputs = []
        for name in sorted(names):
            spec = specs[name]
            tensor = torch.zeros(spec.shape, dtype=spec.dtype)
            held = ownership.holders_of(name).get(owner)
            if held is not None:
                dim, start, stop = held
                tensor.narrow(dim, start, stop - start).fill_(1)
            inputs.append((name, tensor))
        found[owner] = _nonzero_spans(replica, inputs, params)
    return found


def _nonzero_spans(
    replica: ReplicaHandle, inputs: Sequence[tuple[str, Any]], params: Sequence[str]
) -> dict[str, Spans]:
    """Per parameter, the byte ranges of its elements ``inputs``' loaders left non-zero."""
    import torch

    written: dict[str, Spans] = {}
    layouts = replica.layouts
    views = {p: torch.zeros(int(layouts[p].num_bytes), dtype=torch.uint8) for p in params}
    replica.load_into(list(inputs), views)
    for param, view in views.items():
        dtype = layouts[param].dtype
        elements = view.view(dtype) if view.numel() % dtype.itemsize == 0 else view
        size = elements.element_size()
        mask = (elements != 0).to(torch.int8)
        edges = torch.diff(
            mask, prepend=torch.zeros(1, dtype=torch.int8), append=torch.zeros(1, dtype=torch.int8)
        )
        starts = torch.nonzero(edges == 1).flatten().tolist()
        ends = torch.nonzero(edges == -1).flatten().tolist()
        written[param] = tuple((a * size, b * size) for a, b in zip(starts, ends, strict=True))
    return written


def _split(
    key: Hashable,
    params: Sequence[str],
    found: Mapping[Owner, Mapping[str, Spans]],
    by_owner: Mapping[Owner, set[str]],
    replica: ReplicaHandle,
) -> dict[Owner, dict[str, Spans]]:
    """Each owner's ranges of each parameter; bytes no owner writes go to the first owner;
    overlapping ranges are refused."""
    owners = sorted(found)
    out: dict[Owner, dict[str, Spans]] = {owner: {} for owner in owners}
    for param in params:
        size = replica.param_bytes(param)
        taken: list[tuple[int, int, Owner]] = sorted(
            (start, end, owner) for owner in owners for start, end in found[owner].get(param, ())
        )
        overlap = _overlap([param], found)
        if overlap is not None:
            owner_a, owner_b = overlap
            raise ConfigError(
                f"parameter {param!r} of replica {key}: bytes written by the HF tensors of "
                f"{_rank(owner_a)} and of {_rank(owner_b)} overlap "
                f"({sorted(by_owner[owner_a])[:2]}, {sorted(by_owner[owner_b])[:2]}); "
                f"owner sends need each byte from one owner: send these tensors whole"
            )
        holes, at = [], 0
        for start, end, _ in taken:
            if start > at:
                holes.append((at, start))
            at = max(at, end)
        if at < size:
            holes.append((at, size))
        for owner in owners:
            ranges = list(found[owner].get(param, ()))
            if owner == owners[0]:
                ranges += holes
            out[owner][param] = merged(ranges)
    return out


def _overlap(
    params: Sequence[str], found: Mapping[Owner, Mapping[str, Spans]]
) -> tuple[Owner, Owner] | None:
    """Two owners whose ranges of one of ``params`` overlap; None if none do."""
    for param in params:
        taken = sorted(
            (start, end, owner) for owner in found for start, end in found[owner].get(param, ())
        )
        for (_, end_a, owner_a), (start_b, _, owner_b) in itertools.pairwise(taken):
            if start_b < end_a:
                return owner_a, owner_b
    return None


def build_owned_plan(
    owned: OwnedPlan,
    replicas: Mapping[Hashable, ReplicaHandle],
    targets: Mapping[Hashable, Sequence[RankPublication]],
    buffer_bytes: int,
) -> BytePlan:
    """The byte plan of ``owned``'s groups: owned ones to every target of their layout
    (``targets``: every engine rank's publication), replicated ones to the assigned ones,
    shared ones in this rank's ranges only."""
    plans: dict[tuple[Hashable, int], GroupPlan] = {}
    largest = 0
    for key, groups in owned.groups.items():
        pubs = list(targets.get(key, ()))
        mine = [pub for pub in pubs if pub.runner in owned.assigned]
        for index, group in enumerate(groups):
            slots, offset = [], 0
            for param in group.params:
                size = replicas[key].param_bytes(param)
                slots.append(Slot(param, offset, size))
                offset += aligned(size)
            writes = tuple(
                _ranged(target_writes(pub, slots, group.hf_names), slots, group.spans)
                for pub in (pubs if group.to_all else mine)
            )
            plans[(key, index)] = GroupPlan(
                key,
                index,
                group.hf_names,
                tuple(slots),
                offset,
                writes,
                partial=group.spans is not None,
            )
            largest = max(largest, offset)
    return BytePlan(max(buffer_bytes, largest), plans)


def _ranged(
    tw: TargetWrites, slots: Sequence[Slot], spans: Mapping[str, Spans] | None
) -> TargetWrites:
    """Whole-slot writes cut to this owner's ranges of each parameter."""
    if spans is None:
        return tw
    writes = []
    for w in tw.writes:
        for start, end in spans.get(slots[w.slot].param, ()):
            writes.append(
                replace(
                    w, dst_address=w.dst_address + start, src_offset=start, num_bytes=end - start
                )
            )
    return TargetWrites(tw.target, tuple(writes))
