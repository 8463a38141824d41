"""The trainer side of verified writes: which engines can be checked, and the check.

After ``end_weight_update`` each trainer rank reads, at once, the record every engine
rank it wrote took right before its end (``p2pweights.engine_side``) and compares
the digest of each parameter it staged for that rank (``RunResult.digests``) with the
rank's digest of the same parameter. A record belongs to this update only if it was
taken after this update's writes: the rank clears it when a session opens (``begin``),
its ``update`` number must have grown since the last record this session read, and
where the rank reports the weight version it must be this update's
``p2pweights-updating:<v>``.

Direct loads (CUDA IPC into the trainer's own GPU: the replica's loaders wrote the
engine's memory themselves, no bytes in transit) stage nothing and are not checked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2pweights.engines.concurrency import concurrently
from p2pweights.engines.fleet import ConnectedEngine
from p2pweights.errors import EngineError, TransferError, some_of
from p2pweights.integrity.digest import SCHEME

logger = logging.getLogger(__name__)

__all__ = ["Mismatch", "Runner", "WriteCheck", "serves_digests"]

Runner = tuple[str, int, str]
"""(engine URL, engine rank, role): one model runner of an engine rank."""


def serves_digests(engine: ConnectedEngine) -> bool:
    """Whether the engine's ranks record write digests (local engine, p2pweights plugin)."""
    return bool(engine.server_info.get("p2pweights_write_digests")) or any(
        pub.write_digests for pub in engine.publications
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
    """The engines a session checks, and the last record number read per runner."""

    engines: dict[str, ConnectedEngine] = field(default_factory=dict)
    last_update: dict[Runner, int] = field(default_factory=dict)
    engine_digest_s: float = 0.0
    """The longest an engine rank took for its digests in the last check."""

    @classmethod
    def connect(cls, engines: Sequence[ConnectedEngine], mode: str) -> WriteCheck:
        """The engines to check under ``SyncConfig.verify_writes`` ``mode``; "always"
        refuses an engine that serves no digests (``EngineError``, before anything)."""
        if mode == "off":
            return cls()
        serving: list[ConnectedEngine] = []
        others: list[ConnectedEngine] = []
        for engine in engines:
            (serving if serves_digests(engine) else others).append(engine)
        for engine in others:
            if mode == "always":
                raise EngineError(
                    f"engine {engine.url} records no write digests (released sglang's own "
                    f"publication), so its writes cannot be verified; start it with the "
                    f"p2pweights plugin (SGLANG_PLUGINS=p2pweights_nixl), or use "
                    f"SyncConfig(verify_writes='auto') to update it unverified"
                )
            logger.info(
                "p2pweights: engine %s records no write digests; its writes are not verified",
                engine.url,
            )
        return cls({engine.url: engine for engine in serving})

    def __bool__(self) -> bool:
        return bool(self.engines)

    def check(self, expected: Mapping[Runner, Mapping[str, str]], marker: str) -> list[Mismatch]:
        """Compare every checked runner's record with ``expected``: each runner whose
        record disagreed or could not be read (empty if all agreed)."""
        runners = [r for r in expected if r[0] in self.engines and expected[r]]
        records = concurrently(self._read, runners)
        self.engine_digest_s = max((float(r.get("digest_s", 0.0)) for r in records), default=0.0)
        problems = [
            problem
            for runner, record in zip(runners, records, strict=True)
            for problem in self._compare(runner, record, expected[runner], marker)
        ]
        return problems

    @staticmethod
    def raise_if_wrong(problems: Sequence[Mismatch]) -> None:
        if not problems:
            return
        raise TransferError(
            f"write verification failed on {len(problems)} engine rank(s): {some_of(problems)}. "
            f"Those engines stay paused with torn weights (p2pweights-updating:); the next "
            f"update rewrites them whole"
        )

    def _read(self, runner: Runner) -> dict[str, Any]:
        url, rank, role = runner
        engine = self.engines[url]
        port = engine.server_info.get("engine_info_bootstrap_port")
        started = time.perf_counter()
        try:
            record = engine.client.write_digests(rank, role, None if port is None else int(port))
        except EngineError as exc:
            return {"error": f"its write digests could not be read ({exc})"}
        logger.debug("write digests of %s read in %.3f s", runner, time.perf_counter() - started)
        return record

    def _compare(
        self, runner: Runner, record: dict[str, Any], staged: Mapping[str, str], marker: str
    ) -> Iterable[Mismatch]:
        digests = record.get("digests")
        if not isinstance(digests, dict):
            why = record.get("error") or "it recorded none before this update's end"
            yield Mismatch(runner, f"no write digests for this update: {why}")
            return
        scheme = record.get("digest_scheme", "lanes16-v1")  # releases before the scheme
        if scheme != SCHEME:
            yield Mismatch(
                runner,
                f"its write digests are made another way ({scheme!r}; this trainer: "
                f"{SCHEME!r}): run one p2pweights release on the trainer and the engines",
            )
            return
        number, last = record.get("update"), self.last_update.get(runner)
        version = record.get("weight_version")
        if not isinstance(number, int) or (last is not None and number <= last):
            yield Mismatch(runner, f"stale write digests (record {number}, last read {last})")
            return
        if version is not None and version != marker:
            yield Mismatch(runner, f"write digests taken at weight version {version!r}")
            return
        self.last_update[runner] = number
        wrong = sorted(name for name, value in staged.items() if digests.get(name) != value)
        if wrong:
            names = some_of([repr(n) for n in wrong], ", ")
            yield Mismatch(
                runner,
                f"{len(wrong)} of {len(staged)} written parameter(s) do not hold the bytes "
                f"staged for them: {names}",
            )
