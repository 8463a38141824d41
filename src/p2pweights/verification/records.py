"""The trainer's reading of an engine rank's write-digest record.

An engine rank takes a record right before its ``end_weight_update``
(``engine_side.steps``: ``{"update": n, "role": ..., "digests": {param: hex} | None,
"error": str | None, "digest_scheme", "digest_s", "digested_early", ...}``). The trainer
finds it in the end's answer where the engine carried it (the local engine, to the
trainer rank that ended the session: ``EngineUpdate.end_records``), else reads it from
the engine (``EngineClient.write_digests``: the engine's route, or the info bootstrap
server the p2pweights plugin puts it on). An engine's record is untrusted: this module
says whether it belongs to this update and what it holds (``compare``); the HTTP calls
stay in the client, the record's envelope in ``wire.publication``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from p2pweights.engines.fleet import ConnectedEngine
from p2pweights.errors import EngineError, some_of
from p2pweights.wire.digest import SCHEME
from p2pweights.wire.publication import Runner

logger = logging.getLogger(__name__)

__all__ = ["UNNAMED_SCHEME", "begun_number", "compare", "digest_seconds", "read"]

UNNAMED_SCHEME = "lanes16-v1"
"""The scheme of engines that record digests without naming it (releases before it was
named: plain lane sums, blind to reordered bytes)."""


def read(engine: ConnectedEngine, runner: Runner) -> dict[str, Any]:
    """The runner's record: from the end answer where it carried one (the local engine,
    to the trainer rank that ended the session), else read from the engine; one that
    cannot be read is ``{"error": why}``."""
    rank, role = runner.engine_rank, runner.role
    carried = engine.update.end_records.get((rank, role))
    if carried is not None:
        return carried
    port = engine.server_info.get("engine_info_bootstrap_port")
    started = time.perf_counter()
    try:
        record = engine.client.write_digests(rank, role, None if port is None else int(port))
    except EngineError as exc:
        return {"error": f"its write digests could not be read ({exc})"}
    logger.debug("write digests of %s read in %.3f s", runner, time.perf_counter() - started)
    return record


def digest_seconds(record: Mapping[str, Any]) -> float:
    """How long the engine rank took for its digests (0 where it does not say)."""
    return float(record.get("digest_s", 0.0))


def begun_number(record: Mapping[str, Any]) -> int | None:
    """The last record number to compare the end's against, from the record a rank
    serves once its session opened: a record its begin renewed (no digests) is this
    update's number, so the end's is this one; one with digests was left by an earlier
    end (the engine's begin did not renew it), so the end's must be newer. None where
    the record cannot say (its number then decides alone)."""
    number = record.get("update")
    if not isinstance(number, int) or isinstance(number, bool):
        return None
    renewed = record.get("digests") is None and not record.get("error")
    return number - 1 if renewed else number


def compare(
    record: Mapping[str, Any], staged: Mapping[str, str], marker: str, last: int | None
) -> tuple[str | None, int | None]:
    """What is wrong with ``record`` against ``staged`` (parameter -> this rank's digest of
    what it wrote), the update's weight version ``marker`` and ``last`` (the last record
    number read from this runner); and the record's number where it belongs to this
    update (the next record must be newer)."""
    digests = record.get("digests")
    if not isinstance(digests, dict):
        why = record.get("error") or "it recorded none before this update's end"
        return f"no write digests for this update: {why}", None
    scheme = record.get("digest_scheme", UNNAMED_SCHEME)
    if scheme != SCHEME:
        return (
            f"its write digests are made another way ({scheme!r}; this trainer: "
            f"{SCHEME!r}): run one p2pweights release on the trainer and the engines"
        ), None
    number, version = record.get("update"), record.get("weight_version")
    if not isinstance(number, int) or (last is not None and number <= last):
        return f"stale write digests (record {number}, last read {last})", None
    if version is not None and version != marker:
        return f"write digests taken at weight version {version!r}", None
    wrong = sorted(name for name, value in staged.items() if digests.get(name) != value)
    if wrong:
        names = some_of([repr(n) for n in wrong], ", ")
        return (
            f"{len(wrong)} of {len(staged)} written parameter(s) do not hold the bytes "
            f"staged for them: {names}"
        ), number
    return None, number
