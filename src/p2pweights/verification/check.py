"""The trainer side of verified writes: which engines can be checked, and the check.

After ``end_weight_update`` each trainer rank reads, at once, the record every engine
rank it wrote took right before its end (``p2pweights.engine_side.steps``; the trainer
rank that ended the sessions finds them in the local engine's answer to that end, and
reads none) and compares the digest of each parameter it staged for that rank
(``RunResult.digests``) with the rank's digest of the same parameter. A record belongs
to this update only if it was taken after this update's writes: the rank clears it when
a session opens (``begin``), its ``update`` number must have grown since the last record
this session read, and where the rank reports the weight version it must be this
update's ``p2pweights-updating:<v>``.

Direct loads (CUDA IPC into the trainer's own GPU: the replica's loaders wrote the
engine's memory themselves) are checked the same way, by the digest of the bytes the
loaders left at the addresses this rank mapped.

Whether an engine's writes were checked, and if not why and what turns it on, goes into
every ``UpdateReport`` (``WriteCheck.verification``); an engine whose writes were not
checked is warned about once per session (``WriteCheck.warn_unverified``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2pweights.config import SyncConfig
from p2pweights.engines.concurrency import concurrently
from p2pweights.engines.fleet import ConnectedEngine
from p2pweights.errors import ConfigError, EngineError, TransferError, some_of
from p2pweights.report import EngineRankKey, EngineReport, Verification
from p2pweights.verification import checker as weights_checker
from p2pweights.verification import records
from p2pweights.verification.checker import CheckerShare, CheckerTarget
from p2pweights.verification.records import UNNAMED_SCHEME
from p2pweights.wire.digest import SCHEME
from p2pweights.wire.publication import Runner

logger = logging.getLogger(__name__)

__all__ = [
    "UNNAMED_SCHEME",
    "Mismatch",
    "WriteCheck",
    "digest_scheme",
    "serves_digests",
    "why_unverified",
]


def digest_scheme(engine: ConnectedEngine) -> str | None:
    """How the engine's ranks digest their writes (``wire.digest.SCHEME`` of their
    p2pweights), or None where they record no write digests."""
    info = engine.server_info
    if not info.get("p2pweights_write_digests") and not any(
        pub.write_digests for pub in engine.publications
    ):
        return None
    named = info.get("p2pweights_digest_scheme") or next(
        (pub.digest_scheme for pub in engine.publications if pub.digest_scheme), None
    )
    return named if isinstance(named, str) else UNNAMED_SCHEME


def serves_digests(engine: ConnectedEngine) -> bool:
    """Whether the engine's ranks record write digests this trainer can compare with its
    own (local engine, p2pweights plugin, of this digest scheme)."""
    return digest_scheme(engine) == SCHEME


def why_unverified(engine: ConnectedEngine, mode: str) -> str | None:
    """Why the engine's writes are not verified by write digests under ``verify_writes``
    ``mode``, naming the setting that is missing; None where they are."""
    if mode == "off":
        return "SyncConfig(verify_writes='off'); 'auto' verifies every engine that digests"
    scheme = digest_scheme(engine)
    if scheme == SCHEME:
        return None
    if scheme is not None:
        return (
            f"its write digests are made another way ({scheme!r}; this trainer: {SCHEME!r}): "
            f"run one p2pweights release on the trainer and the engines"
        )
    if "p2pweights_engine_state" in engine.server_info:  # the local engine
        return (
            "it records no write digests (a local engine started with "
            "P2PWEIGHTS_WRITE_DIGESTS=0); start it without that setting"
        )
    if any(pub.live for pub in engine.publications):  # the p2pweights plugin publishes live
        return (
            "it runs the p2pweights plugin but records no write digests (started with "
            "P2PWEIGHTS_WRITE_DIGESTS=0); start it without that setting"
        )
    return (
        "it records no write digests (released sglang's own publication); start it with "
        "SGLANG_PLUGINS=p2pweights_nixl (which digests unless P2PWEIGHTS_WRITE_DIGESTS=0) "
        "and write over NixlConfig (docs/nixl-plugin.md)"
    )


@dataclass
class Mismatch:
    """What one runner's record said against what was staged for it."""

    runner: Runner
    problem: str

    def __str__(self) -> str:
        url, rank, role = self.runner
        runner = "" if role == "target" else f" ({role})"
        return f"engine {url} rank {rank}{runner}: {self.problem}"


@dataclass
class WriteCheck:
    """The engines a session checks, how, and the last record number read per runner."""

    engines: dict[str, ConnectedEngine] = field(default_factory=dict)
    """Engine URL -> engine checked by write digests."""
    checker: dict[str, CheckerTarget] = field(default_factory=dict)
    """Engine URL -> engine that records no digests, checked through sglang's
    ``/weights_checker`` before its end (``verification.checker``)."""
    last_update: dict[Runner, int] = field(default_factory=dict)
    engine_digest_s: float = 0.0
    """The longest an engine rank took for its digests in the last check."""
    unverified: dict[str, str] = field(default_factory=dict)
    """Engine URL -> why its writes are not checked (``why_unverified``), for each
    connected engine that is not."""
    warned: set[str] = field(default_factory=set)
    """Engine URLs already warned about as unverified; the session passes the same set to
    every connect, so each engine is warned about once per session."""
    off: bool = False
    """``verify_writes="off"``: nothing is checked, and no warning says so."""

    @classmethod
    def connect(
        cls,
        engines: Sequence[ConnectedEngine],
        mode: str,
        warned: set[str] | None = None,
        *,
        digests_only: bool = False,
    ) -> WriteCheck:
        """The engines to check under ``SyncConfig.verify_writes`` ``mode``, each by write
        digests where it records them, else through its ``/weights_checker`` (not with
        ``digests_only``: a delta update, whose payload the engine applies at its end);
        "always" refuses an engine neither can check (``EngineError``, before anything)."""
        check = cls(warned=set() if warned is None else warned, off=mode == "off")
        for engine in engines:
            why = why_unverified(engine, mode)
            if why is None:
                check.engines[engine.url] = engine
                continue
            if mode != "off":
                why_no_checker = (
                    "delta updates are checked by write digests only (the engine applies "
                    "the payload at its end, after its checker could look)"
                    if digests_only
                    else weights_checker.why_not(engine)
                )
                device = weights_checker.checker_device(engine)
                if why_no_checker is None and device is not None:
                    check.checker[engine.url] = CheckerTarget(engine, device)
                    continue
                why = f"{why}; nor by sglang's /weights_checker: {why_no_checker}"
            if mode == "always":
                raise EngineError(
                    f"engine {engine.url}: its writes cannot be verified: {why}. Either way "
                    f"verifies them: write digests (the p2pweights plugin or local engine, "
                    f"not started with P2PWEIGHTS_WRITE_DIGESTS=0) or sglang's "
                    f"/weights_checker (sglang >= 0.5.23, and CUDA on the trainer for a GPU "
                    f"engine); or use SyncConfig(verify_writes='auto') to update it unverified"
                )
            check.unverified[engine.url] = why
        return check

    @classmethod
    def for_config(
        cls, config: SyncConfig, engines: Sequence[ConnectedEngine], warned: set[str]
    ) -> WriteCheck:
        """``connect`` under ``config``'s policy: ``verify_writes``, and for delta updates
        "always" by write digests only (a delta an engine refused is seen only through its
        record; ``SyncConfig.verification_policy`` says the same)."""
        delta = config.delta is not None
        mode = "always" if delta and config.verify_writes == "auto" else config.verify_writes
        return cls.connect(engines, mode, warned, digests_only=delta)

    def __bool__(self) -> bool:
        return bool(self.engines)

    def flagged(self, digest_as_written: bool) -> frozenset[str]:
        """The engines whose ranks digest each parameter as its writes land
        (``SyncConfig.digest_as_written``): the sender flags its writes to them."""
        return frozenset(self.engines) if digest_as_written else frozenset()

    def refuse_shared_parameters(self, digest_as_written: bool, named: str = "") -> None:
        """Owner sends planned parameters several trainer ranks write in shares: refuse,
        before anything is sent, what no check could verify (``ConfigError``): early
        digests (a share may land after the flag) and engines checked through their
        ``/weights_checker`` (its hash cannot be made from the shares). ``named``: the
        first such parameter and its HF tensors, for the message."""
        which = named or "a parameter several owners write"
        if digest_as_written:
            raise ConfigError(
                f"digest_as_written digests a parameter once its flag lands, but {which} is "
                f"written in shares by several owners, which land from several trainer ranks, "
                f"so its early digest could miss a share; use digest_as_written=False with "
                f"owned tensors that share parameters; nothing was sent"
            )
        checked = sorted(self.checker)
        if checked:
            raise ConfigError(
                f"engines {', '.join(checked[:3])} are verified through sglang's "
                f"/weights_checker, whose hash of a parameter cannot be made from the shares "
                f"several owners write of it ({which}); start them with the p2pweights plugin "
                f"and write digests (docs/real-sglang.md), or send these tensors whole; "
                f"nothing was sent"
            )

    @property
    def checker_devices(self) -> dict[str, str]:
        """Engine URL -> the kind of device its checker hashes on, for each engine checked
        through its ``/weights_checker`` (what the sender hashes its slots for)."""
        return {url: target.device for url, target in self.checker.items()}

    def verification(
        self,
        url: str,
        written: Collection[EngineRankKey],
        digests: Mapping[Runner, Mapping[str, str]],
        checksums: Mapping[Runner, Mapping[str, str]] | None = None,
        *,
        weight_checked: bool = False,
    ) -> tuple[tuple[Verification, ...], str | None]:
        """How this trainer rank's writes into ``url`` (``written``: the engine ranks it
        wrote) were checked in a passed update (``weight_checked``: the engines' own
        weight check ran too, and passed), and why not where they were not.

        An engine rank it wrote without a digest (or checksum) of what it wrote there was
        not checked."""
        by, why = self._verified_by(url, written, digests, checksums)
        return by + (("weight_check",) if weight_checked else ()), why

    def _verified_by(
        self,
        url: str,
        written: Collection[EngineRankKey],
        digests: Mapping[Runner, Mapping[str, str]],
        checksums: Mapping[Runner, Mapping[str, str]] | None,
    ) -> tuple[tuple[Verification, ...], str | None]:
        if url in self.checker:
            how: Verification = weights_checker.METHOD
            hashed = checksums or {}
        elif url in self.engines:
            how, hashed = "write_digests", digests
        else:
            return (), self.unverified.get(url, "it was not connected for verification")
        seen = {(u, rank) for (u, rank, _), staged in hashed.items() if staged}
        missed = sorted(rank for u, rank in written if u == url and (u, rank) not in seen)
        if missed:
            ranks = ", ".join(str(rank) for rank in missed)
            return (), f"this trainer rank hashed nothing it wrote into engine rank(s) {ranks}"
        return (how,), None

    def check_before_end(
        self,
        staged: Mapping[Runner, Mapping[str, str]],
        share: CheckerShare | None = None,
    ) -> list[Mismatch]:
        """The checker engines' ``/weights_checker`` checksums of what this trainer rank
        wrote, compared with ``staged`` (its hashes of the staged bytes): each runner that
        disagreed or could not be checked (empty if all agreed). With ``share`` each
        engine's checker is asked once among the sending ranks (``checker.check``)."""
        return [
            Mismatch(runner, problem)
            for runner, problem in weights_checker.check(self.checker, staged, share)
        ]

    def warn_unverified(self, engines: Iterable[EngineReport]) -> None:
        """Warn, once per session and engine, about each engine written without any check."""
        if self.off:
            return
        for engine in engines:
            if engine.verified or engine.url in self.warned or not engine.num_ranks_written:
                continue
            self.warned.add(engine.url)
            logger.warning(
                "p2pweights: engine %s: writes are not verified: %s (warned once per session; "
                "every UpdateReport says how each engine was verified)",
                engine.url,
                engine.unverified_reason,
            )

    def check(self, expected: Mapping[Runner, Mapping[str, str]], marker: str) -> list[Mismatch]:
        """Compare every checked runner's record with ``expected``: each runner whose
        record disagreed or could not be read (empty if all agreed)."""
        runners = [r for r in expected if r.engine_url in self.engines and expected[r]]
        read = concurrently(self._read, runners)
        self.engine_digest_s = max((records.digest_seconds(r) for r in read), default=0.0)
        problems = []
        for runner, record in zip(runners, read, strict=True):
            last = self.last_update.get(runner)
            problem, number = records.compare(record, expected[runner], marker, last)
            if number is not None:
                self.last_update[runner] = number
            if problem is not None:
                problems.append(Mismatch(runner, problem))
        return problems

    def note_begun(self, runners: Iterable[Runner]) -> None:
        """Once the update sessions opened, on a session's first update: the record each
        checked runner serves now, for those whose number this session has not read, so
        that the end's record is never taken on its number alone. A record its begin
        renewed (no digests) is this update's number; one with digests was left by an
        earlier end (the engine's begin did not renew it), so the end's must be newer.
        One that cannot be read leaves the number alone to decide."""
        fresh = [r for r in runners if r.engine_url in self.engines and r not in self.last_update]
        for runner, record in zip(fresh, concurrently(self._read, fresh), strict=True):
            number = records.begun_number(record)
            if number is not None:
                self.last_update[runner] = number

    @staticmethod
    def raise_if_wrong(problems: Sequence[Mismatch], left: str = "") -> None:
        if not problems:
            return
        raise TransferError(
            f"write verification failed on {len(problems)} engine rank(s): {some_of(problems)}. "
            f"Those engines stay paused with torn weights (p2pweights-updating:){left}; the "
            f"next update rewrites them whole"
        )

    def _read(self, runner: Runner) -> dict[str, Any]:
        return records.read(self.engines[runner.engine_url], runner)
