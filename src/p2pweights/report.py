"""What ``WeightSyncSession.update`` returns: what the update did, engine by engine.

``UpdateReport.summary()`` is the text to print; the fields hold the same facts for code.
Everything is as this trainer rank saw it: with several sending ranks each reports the
bytes it wrote, and only the rank that drives the engines (stage 0's rank 0) knows how
long they stood paused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from p2pweights.errors import some_of

if TYPE_CHECKING:
    from typing_extensions import Self

    from p2pweights.delta.sender import DeltaSummary

__all__ = [
    "DeltaReport",
    "EngineRankBytes",
    "EngineRankKey",
    "EngineReport",
    "UpdateReport",
    "Verification",
]

Verification = Literal["write_digests", "weights_checker", "weight_check"]
"""How an engine's writes were checked: "write_digests" (each engine rank's digest of
every parameter, taken right before its ``end_weight_update``, equal to the digest of
the bytes staged for it; ``SyncConfig.verify_writes``), "weights_checker" (for engines
that record no digests, released sglang: its ``/weights_checker`` ``checksum`` of every
written parameter, asked after the writes and before ``end_weight_update``, equal to the
same hash of the bytes staged for it; ``SyncConfig.verify_writes``), "weight_check" (the engine's
own weight checker compared the update with the weights it started with;
``SyncConfig.verify_with_weight_checker``, first update only)."""


@dataclass(frozen=True, eq=False)
class EngineRankKey:
    """One engine rank: what ``UpdateReport.bytes_by_target`` and the writers are keyed by.

    It replaced the tuple ``(url, rank)`` and still behaves as one: it unpacks
    (``url, rank = key``), equals and hashes as that tuple (``bytes_by_target[(url, 0)]``
    finds it) and sorts by URL, then rank."""

    url: str
    """The engine's URL, as connected."""
    rank: int
    """The engine rank (its tensor-parallel rank; each rank holds its own weights)."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.url, self.rank))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EngineRankKey):
            return (self.url, self.rank) == (other.url, other.rank)
        if isinstance(other, tuple):
            return (self.url, self.rank) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.url, self.rank))

    def __lt__(self, other: EngineRankKey | tuple[str, int]) -> bool:
        return (self.url, self.rank) < tuple(other)

    def __gt__(self, other: EngineRankKey | tuple[str, int]) -> bool:
        return (self.url, self.rank) > tuple(other)


@dataclass(frozen=True)
class EngineRankBytes(Mapping[EngineRankKey, int]):
    """Engine rank -> bytes: a read-only mapping (``items()``, ``[key]``, ``==`` a dict)
    held as a tuple of records, so that ``dataclasses.asdict`` of a report (and
    ``json.dumps`` of that) works: a JSON object's keys are strings, a rank's key is not."""

    ranks: tuple[EngineRankWritten, ...] = ()
    """Each engine rank and its bytes, sorted by URL, then rank."""

    @classmethod
    def of(cls, given: Mapping[EngineRankKey, int] | Mapping[tuple[str, int], int]) -> Self:
        """From a mapping keyed by ``EngineRankKey`` or by ``(url, rank)`` tuples."""
        if isinstance(given, cls):
            return given
        keyed = {EngineRankKey(*key): num_bytes for key, num_bytes in given.items()}
        return cls(
            tuple(
                EngineRankWritten(key.url, key.rank, num_bytes)
                for key, num_bytes in sorted(keyed.items(), key=lambda item: item[0])
            )
        )

    @functools.cached_property
    def _by_key(self) -> dict[EngineRankKey, int]:
        return {EngineRankKey(r.url, r.rank): r.num_bytes for r in self.ranks}

    def __getitem__(self, key: EngineRankKey | tuple[str, int]) -> int:
        return self._by_key[key]  # type: ignore[index]  # a tuple hashes and equals as its key

    def __iter__(self) -> Iterator[EngineRankKey]:
        return (EngineRankKey(r.url, r.rank) for r in self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"EngineRankBytes({self._by_key!r})"

    __eq__ = Mapping.__eq__
    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class EngineRankWritten:
    """One engine rank and the bytes this trainer rank wrote there."""

    url: str
    rank: int
    num_bytes: int


@dataclass(frozen=True)
class EngineReport:
    """What one update did to one engine."""

    url: str
    """The engine's URL, as connected."""
    transport: str
    """What its bytes were written over: "mooncake", "nixl" or "cuda_ipc"."""
    protocol: str
    """What the transport writes over, as it set itself up (Mooncake's ``protocol="auto"``
    resolved): Mooncake's "rdma" or "tcp", NIXL's backend ("UCX", ...), or "device copy"
    for CUDA IPC."""
    num_ranks_written: int
    """Engine ranks (speculative draft runners not counted apart) this trainer rank wrote."""
    bytes_written: int
    """Bytes this trainer rank wrote into the engine, all its ranks together (for a delta
    update: the delta entries and the parameters written in full)."""
    verified_by: tuple[Verification, ...] = ()
    """How this update's writes into the engine were checked; empty: they were not."""
    unverified_reason: str | None = None
    """Why this trainer rank's writes into the engine were not checked (by write digests
    or sglang's weight checker), and the settings that have them checked; None where
    they were."""
    paused_s: float | None = None
    """Seconds the engine stood paused for this update: from the answer to the pause this
    update made (or, where it was paused already, from when this update began with it)
    to the answer to its resume. None on a trainer rank that does not drive the engines."""
    pause_made: bool | None = None
    """Whether this update paused the engine. False: it was paused already (left so by an
    earlier failed update, or found so at ``connect``), and ``paused_s`` counts from when
    this update began with it. None where ``paused_s`` is."""

    @property
    def verified(self) -> bool:
        """Whether this update's writes into the engine were checked at all."""
        return bool(self.verified_by)


@dataclass(frozen=True)
class DeltaReport:
    """What a delta update (``SyncConfig.delta``) sent instead of every byte."""

    num_delta_params: int
    """Staged parameters written as deltas (changed elements only). A parameter staged for
    several shard layouts (engines of other TP sizes) counts once per layout."""
    num_full_params: int
    """Staged parameters written in full: too many elements changed, no room in the
    engine rank's scratch region, or the rank did not hold the previous update."""
    num_unchanged_params: int
    """Staged parameters with no element changed: nothing written."""
    full_bytes: int
    """Bytes a full update would have written (every staged parameter to each of its ranks)."""
    sent_bytes: int
    """Bytes written instead: full parameters, delta entries and their headers."""
    store_bytes: int
    """Memory the trainer keeps for the previous update's bytes (what deltas compare with)."""
    decision: str | None = None
    """Whether the update went as deltas or in full, why, and the seconds predicted for
    each where ``DeltaConfig.mode`` predicted them, in a line; None where not decided."""

    @classmethod
    def of(cls, summary: DeltaSummary) -> DeltaReport:
        """The report of what the delta sender counted."""
        return cls(
            num_delta_params=summary.num_delta_slots,
            num_full_params=summary.num_full_slots,
            num_unchanged_params=summary.num_unchanged_slots,
            full_bytes=summary.full_bytes,
            sent_bytes=summary.sent_bytes,
            store_bytes=summary.store_bytes,
            decision=None if summary.decision is None else summary.decision.describe(),
        )

    @property
    def fraction(self) -> float:
        """``sent_bytes`` over ``full_bytes`` (1.0 when nothing was staged)."""
        return self.sent_bytes / self.full_bytes if self.full_bytes else 1.0


@dataclass(frozen=True)
class UpdateReport:
    """One update: the new version, what was written where, how it was checked, and where
    the time went."""

    version: str
    """The weight version the engines now show."""
    bytes_by_target: Mapping[EngineRankKey, int]
    """Engine rank (``EngineRankKey(url, rank)``, which unpacks and compares as the
    ``(url, rank)`` tuple it replaced) -> bytes this trainer rank wrote there. Given as
    any such mapping (tuple keys too), held as an ``EngineRankBytes``."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per stage: control_plane, probe (first update only) or check_inputs, convert
    (e.g. fp8 quantization, when an engine needs it), gather (owner sends' one-tensor
    gathers), load (into buffers), wait (on writes), delta_compare, digest and
    verify_writes / engine_digest (write digests), verify (the engines' weight check)."""
    seconds: float = 0.0
    """Wall seconds of the whole ``update()`` call."""
    engines: dict[str, EngineReport] = field(default_factory=dict)
    """Engine URL -> what this update did there (every connected engine)."""
    delta: DeltaReport | None = None
    """What went as deltas; None without ``SyncConfig.delta``."""
    num_control_calls: int = 0
    """HTTP calls to the engines during the update (``Fleet.control_calls()``)."""
    control_call_seconds: float = 0.0
    """Wall seconds during which at least one of those calls was in flight (calls issued
    at once count once)."""
    subset_size: int | None = None
    """A partial update (``update(..., subset=...)``): how many HF tensors its declared
    subset named; the engines kept every weight those do not feed. None: every tensor."""
    inputs_checked_finite: bool = False
    """Whether every input tensor was checked for NaN / Inf before it was staged
    (``SyncConfig.verify_finite_inputs``; off by default: on a CPU the check costs tens
    of percent of an update). False: they reached the engines unchecked."""

    gathered_bytes_by_tensor: Mapping[str, int] = field(default_factory=dict)
    """Owner sends: HF name -> bytes this trainer rank received all-gathering the other
    holders' slices of a sharded tensor it could not write from its own slice (its loaders
    mix holders' rows, or quantize fp8 blocks across them); every other tensor is written
    by its owners, with no gather. Empty without such tensors."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "bytes_by_target", EngineRankBytes.of(self.bytes_by_target))

    @property
    def gathered_bytes(self) -> int:
        """Bytes this trainer rank received in owner sends' one-tensor gathers."""
        return sum(self.gathered_bytes_by_tensor.values())

    @property
    def bytes_written(self) -> int:
        """Bytes this trainer rank wrote, every engine rank together."""
        return sum(self.bytes_by_target.values())

    @property
    def gb_per_s(self) -> float:
        """``bytes_written`` per second of the update, in GB/s (10^9 bytes)."""
        return self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def paused_s(self) -> dict[str, float]:
        """Engine URL -> ``EngineReport.paused_s``, for the engines where it is known."""
        return {
            url: engine.paused_s
            for url, engine in self.engines.items()
            if engine.paused_s is not None
        }

    def metrics(self, prefix: str = "p2pweights/") -> dict[str, float | int]:
        """The update as flat numbers for a step logger (wandb, tensorboard, verl's metrics
        dict, miles' ``pop_metrics``), each name ``prefix`` + one of (docs/metrics.md):

        ``seconds``, ``bytes``, ``gb_per_s``: the whole update, this trainer rank's bytes;
        ``max_engine_rank_bytes``, ``max_engine_rank_gb_per_s``: the engine rank this rank
        wrote the most, over the update's seconds (the busiest link);
        ``num_engines``, ``num_engine_ranks``, ``engines_verified``, ``engines_unverified``;
        ``paused_s_max`` (where this rank drives the engines);
        ``delta_fraction``, ``delta_sent_bytes``, ``delta_params``, ``full_params``,
        ``unchanged_params`` (with ``SyncConfig.delta``);
        ``control_calls``, ``control_call_s``; ``inputs_checked_finite`` (1 or 0);
        ``subset_size`` (a partial update's declared tensors); ``gathered_bytes`` (owner
        sends' one-tensor gathers, received by this rank); and
        ``<stage>_s`` for each stage timed
        (``stage_seconds``: ``load_s``, ``wait_s``, ...)."""
        values: dict[str, float | int] = {
            "seconds": float(self.seconds),
            "bytes": self.bytes_written,
            "gb_per_s": self.gb_per_s,
            "num_engines": len(self.engines) or len({url for url, _ in self.bytes_by_target}),
            "num_engine_ranks": len(self.bytes_by_target),
            "engines_verified": sum(1 for e in self.engines.values() if e.verified),
            "engines_unverified": sum(1 for e in self.engines.values() if not e.verified),
            "control_calls": self.num_control_calls,
            "control_call_s": float(self.control_call_seconds),
            "inputs_checked_finite": int(self.inputs_checked_finite),
            "gathered_bytes": self.gathered_bytes,
        }
        if self.bytes_by_target:
            busiest = max(self.bytes_by_target.values())
            values["max_engine_rank_bytes"] = busiest
            values["max_engine_rank_gb_per_s"] = (
                busiest / self.seconds / 1e9 if self.seconds > 0 else 0.0
            )
        if self.paused_s:
            values["paused_s_max"] = float(max(self.paused_s.values()))
        if self.subset_size is not None:
            values["subset_size"] = self.subset_size
        if self.delta is not None:
            values["delta_fraction"] = self.delta.fraction
            values["delta_sent_bytes"] = self.delta.sent_bytes
            values["delta_params"] = self.delta.num_delta_params
            values["full_params"] = self.delta.num_full_params
            values["unchanged_params"] = self.delta.num_unchanged_params
        for stage, seconds in self.stage_seconds.items():
            values[f"{stage}_s"] = float(seconds)
        return {f"{prefix}{name}": value for name, value in values.items()}

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON types (``json.dumps(report.to_dict())`` works):
        ``bytes_by_target`` as a list of ``{"url", "engine_rank", "bytes"}``, the engines
        and the delta report as dicts, and the derived ``bytes_written``, ``gb_per_s`` and
        ``metrics()`` (unprefixed) beside them."""
        return {
            "version": self.version,
            "seconds": self.seconds,
            "bytes_written": self.bytes_written,
            "gb_per_s": self.gb_per_s,
            "bytes_by_target": [
                {"url": url, "engine_rank": rank, "bytes": num_bytes}
                for (url, rank), num_bytes in sorted(self.bytes_by_target.items())
            ],
            "stage_seconds": dict(self.stage_seconds),
            "engines": {
                url: {**dataclasses.asdict(engine), "verified_by": list(engine.verified_by)}
                for url, engine in self.engines.items()
            },
            "delta": None
            if self.delta is None
            else {**dataclasses.asdict(self.delta), "fraction": self.delta.fraction},
            "num_control_calls": self.num_control_calls,
            "control_call_seconds": self.control_call_seconds,
            "subset_size": self.subset_size,
            "inputs_checked_finite": self.inputs_checked_finite,
            "gathered_bytes": self.gathered_bytes,
            "gathered_bytes_by_tensor": dict(self.gathered_bytes_by_tensor),
            "metrics": self.metrics(prefix=""),
        }

    def summary(self) -> str:
        """A few lines saying what the update did, for a person to read."""
        lines = [self._headline()]
        if self.subset_size is not None:
            lines.append(
                f"  partial update: the {self.subset_size} HF tensor(s) of its declared subset; "
                f"every other weight kept"
            )
        if self.delta is not None:
            lines.append(_delta_line(self.delta))
        lines.extend(_engine_lines(self.engines.values()))
        if not self.inputs_checked_finite:
            lines.append(
                "  inputs NOT checked for NaN / Inf (SyncConfig(verify_finite_inputs=True) "
                "checks them)"
            )
        lines.append(self._time_line())
        return "\n".join(lines)

    def _headline(self) -> str:
        num_engines = len(self.engines) or len({url for url, _ in self.bytes_by_target})
        return (
            f"version {self.version}: {_size(self.bytes_written)} to "
            f"{len(self.bytes_by_target)} engine rank(s) of {num_engines} engine(s) in "
            f"{self.seconds:.3f} s ({_rate(self.bytes_written, self.seconds)})"
        )

    def _time_line(self) -> str:
        stages = " ".join(f"{k}={v:.3f}s" for k, v in self.stage_seconds.items())
        calls = (
            f"; {self.num_control_calls} control calls {self.control_call_seconds:.3f} s"
            if self.num_control_calls
            else ""
        )
        return f"  stages: {stages or 'none'}{calls}"


def _delta_line(delta: DeltaReport) -> str:
    decided = "" if delta.decision is None else f"{delta.decision}; "
    return (
        f"  deltas: {decided}{delta.num_delta_params} parameter(s) as deltas, "
        f"{delta.num_full_params} in full, {delta.num_unchanged_params} unchanged; "
        f"{_size(delta.sent_bytes)} sent, "
        f"{100 * delta.fraction:.1f} % of the {_size(delta.full_bytes)} a full update writes "
        f"(the previous update's copy takes {_size(delta.store_bytes)})"
    )


def _engine_lines(engines: Iterable[EngineReport]) -> list[str]:
    """Engines grouped by what happened to them, so a large fleet stays a few lines."""
    engines = list(engines)
    if not engines:
        return []
    lines = []
    over = sorted({f"{e.transport} ({e.protocol})" for e in engines})
    lines.append(f"  written over {', '.join(over)}")
    checked: dict[tuple[Verification, ...], int] = {}
    for engine in engines:
        if engine.verified:
            checked[engine.verified_by] = checked.get(engine.verified_by, 0) + 1
    parts = [
        f"verified by {' and '.join(_VERIFIED_BY[v] for v in how)}: {n} engine(s)"
        for how, n in checked.items()
    ]
    if parts:
        lines.append(f"  {'; '.join(parts)}")
    unverified: dict[str, list[str]] = {}
    for engine in engines:
        if not engine.verified:
            unverified.setdefault(engine.unverified_reason or "", []).append(engine.url)
    for reason, urls in unverified.items():
        lines.append(f"  NOT verified: {some_of(urls, ', ')}: {reason}")
    paused = {e.url: e.paused_s for e in engines if e.paused_s is not None}
    if paused:
        longest = max(paused, key=lambda url: paused[url])
        line = f"  paused up to {paused[longest]:.3f} s ({longest})"
        already = [e.url for e in engines if e.pause_made is False]
        if already:
            line += (
                f"; {some_of(already, ', ')} was paused already when this update began "
                f"(counted from then)"
            )
        lines.append(line)
    return lines


_VERIFIED_BY: Mapping[Verification, str] = {
    "write_digests": "write digests",
    "weights_checker": "sglang's /weights_checker checksums",
    "weight_check": "the engine's weight check",
}


def _size(num_bytes: float) -> str:
    """Decimal units that show a small (delta) size as more than zero."""
    if num_bytes >= 1e9:
        return f"{num_bytes / 1e9:.2f} GB"
    if num_bytes >= 1e6 or num_bytes == 0:
        return f"{num_bytes / 1e6:.1f} MB"
    return f"{num_bytes / 1e3:.1f} kB"


def _rate(num_bytes: int, seconds: float) -> str:
    """Bytes per second, in units that show a small (delta) update as more than zero."""
    if seconds <= 0:
        return "no time measured"
    return f"{_size(num_bytes / seconds)}/s"
