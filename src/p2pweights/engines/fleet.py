"""Connecting to engines: read what each serves and publishes, refuse what cannot be written."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from p2pweights.engines.calls import ControlCalls
from p2pweights.engines.client import EngineClient
from p2pweights.engines.concurrency import concurrently
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.update_state import (
    UPDATING_PREFIX,
    AbortReport,
    EngineUpdate,
    Phase,
)
from p2pweights.errors import EngineError, EngineUnreachable
from p2pweights.replica.speculative import has_model_draft
from p2pweights.report import EngineRankKey, EngineReport, Verification
from p2pweights.transport_registry import publication_backend
from p2pweights.wire.publication import RankPublication, require_backend

logger = logging.getLogger(__name__)

_PUBLISH_FLAGS = {
    "mooncake": "start sglang with --remote-instance-weight-loader-start-seed-via-transfer-engine",
    "nixl": "start sglang with the p2pweights NIXL plugin (SGLANG_PLUGINS=p2pweights_nixl) "
    "or --remote-instance-weight-loader-start-seed-via-nixl",
    "cuda_ipc": "start sglang on a GPU of the trainer's host with the p2pweights CUDA IPC "
    "plugin (SGLANG_PLUGINS=p2pweights_cuda_ipc), or a local engine with "
    "p2pweights engine --transport cuda_ipc --device cuda:N",
}


@dataclass
class ConnectedEngine:
    """One engine as this session sees it after connect."""

    index: int
    endpoint: EngineEndpoint
    client: EngineClient
    server_info: dict[str, Any]
    publications: list[RankPublication]
    draft_publications: list[RankPublication] = field(default_factory=list)
    """Per rank, its same-model speculative draft runner's (empty without a draft)."""
    update: EngineUpdate = field(init=False)
    """Its update-session state (driven by the trainer rank that leads)."""

    def __post_init__(self) -> None:
        self.update = EngineUpdate(self.client)

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def num_ranks(self) -> int:
        return len(self.publications)

    def check_not_restarted(self) -> None:
        """Refuse the engine if another process answers at its URL than at ``connect``
        (restarted without a new ``connect``): its rank 0 now publishes through another
        transport peer or at other addresses; for a live publication (which the same
        process republishes through a new peer, with a later epoch, when its weights
        move), an epoch below the one connected, or the same epoch through another peer.
        Asked before any engine is paused: writes to the old registration could only
        fail, after the pause."""
        if not self.publications:
            return
        before = self.publications[0]
        now = self.client.publication(0)
        why = None
        if before.live:  # republished in place: a new peer too, but with a later epoch
            if now.epoch < before.epoch:
                why = f"its publication went back to epoch {now.epoch} (connected: {before.epoch})"
            elif now.epoch == before.epoch and now.reached_through != before.reached_through:
                why = (
                    f"it now publishes epoch {now.epoch} through {now.peer} "
                    f"(connected: {before.peer})"
                )
        elif now.reached_through != before.reached_through:
            why = f"it now publishes through {now.peer} (connected: {before.peer})"
        elif now.regions != before.regions:
            why = "its rank 0 now publishes other weight addresses"
        if why is not None:
            raise EngineError(
                f"engine {self.url} was restarted since connect() ({why}): call connect() "
                f"again with it before update(); no engine was paused or written"
            )

    def published_bytes(self, rank: int) -> int:
        """Bytes engine rank ``rank`` published for writing (its draft runner's included)."""
        pubs = [self.publications[rank]]
        if self.draft_publications:
            pubs.append(self.draft_publications[rank])
        return sum(region.num_bytes for pub in pubs for region in pub.regions.values())


def num_engine_ranks(url: str, server_info: dict[str, Any]) -> int:
    """The TP ranks; pipeline stages and in-server DP replicas cannot be told apart."""
    pp_size = int(server_info.get("pp_size") or 1)
    if pp_size > 1:
        raise EngineError(
            f"engine {url}: pp_size={pp_size}; sglang publishes weights keyed by TP rank only "
            f"(sglang issue #37216), so pipeline stages cannot be written. Use pp_size 1."
        )
    dp_size = int(server_info.get("dp_size") or 1)
    if dp_size > 1 and not server_info.get("enable_dp_attention"):
        raise EngineError(
            f"engine {url}: dp_size={dp_size} without DP attention runs {dp_size} model replicas "
            f"in one server, but sglang publishes weights keyed by TP rank only, so only one "
            f"replica's would be written while the update reports success. Start one server per "
            f"replica (dp_size 1) and connect each, or use --enable-dp-attention."
        )
    return int(server_info["tp_size"])


def check_sglang_version(url: str, server_info: dict[str, Any], allow_mismatch: bool) -> None:
    """The replica runs the trainer's sglang model code: it must be the engine's release."""
    import importlib.metadata

    try:
        mine: str | None = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        mine = None
    theirs = server_info.get("version")
    if mine is not None and theirs == mine:
        return
    problem = (
        f"engine {url} runs sglang {theirs or '(version not reported)'}, this trainer has "
        f"{mine or 'no sglang'}; the replica runs the trainer's copy of sglang's model code, so "
        f"a different release may lay bytes out differently"
    )
    if not allow_mismatch:
        fix = f"install sglang=={theirs} here, or pass" if theirs else "run one sglang release, or"
        raise EngineError(
            f"{problem}. To connect, {fix} SyncConfig(allow_sglang_mismatch=True) if you know "
            f"both lay weights out alike"
        )
    logger.warning("%s (allowed by allow_sglang_mismatch)", problem)


def check_mooncake_writable(url: str, server_info: dict[str, Any], transport_kind: str) -> None:
    """Refuse Mooncake into an sglang server on the CPU: its publication is never registered.

    sglang registers with Mooncake the allocator blocks it finds in
    ``torch.cuda.memory.memory_snapshot()`` (``register_memory_region_v2``); on a CPU
    server that is empty, so it publishes addresses no transfer engine registered and
    refuses every write ("not within any registered buffer"). The p2pweights local
    engine registers its own memory and is not refused.
    """
    if transport_kind != "mooncake" or str(server_info.get("device") or "") != "cpu":
        return
    if "p2pweights_engine_state" in server_info:  # the local engine
        return
    raise EngineError(
        f"engine {url} is an sglang server on the CPU (device='cpu'): sglang registers with "
        f"Mooncake only memory it finds in the CUDA allocator, so there it publishes weight "
        f"addresses it never registered and every Mooncake write would be refused. Write "
        f"over NIXL instead: SyncConfig(transport=NixlConfig(...)) with the engine started "
        f"under SGLANG_PLUGINS=p2pweights_nixl (docs/nixl-plugin.md)."
    )


@dataclass(frozen=True)
class ConnectOptions:
    """What connecting needs from ``SyncConfig``."""

    transport_kind: str
    timeout_s: float
    control_timeout_s: float
    api_key: SecretStr | None = None
    allow_sglang_mismatch: bool = False
    end_update_timeout_s: float | None = None
    """Bound on ``end_weight_update``; None: ``timeout_s``."""


def connect_engine(
    index: int, endpoint: EngineEndpoint, options: ConnectOptions
) -> ConnectedEngine:
    transport_kind = options.transport_kind
    backend = publication_backend(transport_kind)  # what the engines must publish for it
    client = EngineClient(
        endpoint.url,
        timeout_s=options.timeout_s,
        control_timeout_s=options.control_timeout_s,
        end_update_timeout_s=options.end_update_timeout_s,
        api_key=endpoint.api_key or options.api_key,
    )
    try:
        server_info = client.server_info()
        check_sglang_version(endpoint.url, server_info, options.allow_sglang_mismatch)
        check_mooncake_writable(endpoint.url, server_info, backend)
        ranks = range(num_engine_ranks(endpoint.url, server_info))
        publications = [client.publication(rank) for rank in ranks]
        drafts = (
            [client.publication(rank, role="draft") for rank in ranks]
            if has_model_draft(endpoint.url, server_info)
            else []
        )
    except Exception:
        client.close()
        raise
    try:
        for pub in publications + drafts:
            require_backend(pub, backend)
    except EngineError as exc:
        client.close()
        how = _PUBLISH_FLAGS.get(backend, f"start the engine with the {backend} publisher")
        raise EngineError(f"{exc}. To publish for {backend}: {how}.") from None
    engine = ConnectedEngine(index, endpoint, client, server_info, publications, drafts)
    try:
        engine.update.adopt()
    except Exception:
        client.close()
        raise
    return engine


class Fleet:
    """The connected engines, driven together through their update sessions.

    Each step runs on every engine it concerns at once and raises, after all of
    them returned, one error naming every engine that failed; each engine's
    ``EngineUpdate`` keeps what it answered.
    """

    def __init__(self, engines: list[ConnectedEngine]):
        self.engines = engines

    @classmethod
    def connect(cls, endpoints: Sequence[EngineEndpoint], options: ConnectOptions) -> Fleet:
        """Connect every engine; if any fails, close the ones that did and raise."""
        connected: list[ConnectedEngine | None] = [None] * len(endpoints)

        def one(index: int) -> None:
            connected[index] = connect_engine(index, endpoints[index], options)

        try:
            concurrently(one, range(len(endpoints)))
        except BaseException:
            for engine in connected:
                if engine is not None:
                    engine.client.close()
            raise
        return cls([e for e in connected if e is not None])

    def each(self, call: Callable[[ConnectedEngine], object]) -> None:
        concurrently(call, self.engines)

    def open(self, pause_mode: str, version: str, snapshot: bool) -> None:
        """Open an update session on every engine (those already open stay open).

        Every engine must answer first: an engine that died since the last update fails
        the update before any engine is paused (a retry would otherwise pause the
        healthy ones, then stop at the dead one). With ``pause_mode="caller"`` every engine
        must then say it is paused (where it reports its state), before any is marked.

        The check also readies (opens, or finds kept alive) as many connections per
        engine as the update later uses at once, so no call in the pause opens one:
        sglang's server closes a connection idle for 5 s (``SGLANG_TIMEOUT_KEEP_ALIVE``),
        less than a training step."""
        for engine in self.engines:  # what follows is this update's
            engine.client.calls.clear()
            engine.update.new_update()
        connections = 1 if pause_mode == "in_place" else 2  # the marker and the flush
        try:
            self.each(lambda e: e.client.check_reachable(connections))
        except EngineUnreachable as exc:
            raise EngineUnreachable(
                f"{exc} (before the update: no engine was paused or written; restart or drop "
                f"it and connect() again)"
            ) from exc
        self.each(lambda e: e.check_not_restarted())  # before any engine changes
        if pause_mode == "caller":  # refuse a generating engine before any engine changes
            self.each(lambda e: e.update.check_paused_by_caller())
        self.each(lambda e: e.update.open(pause_mode, version, snapshot=snapshot))

    def mark_written(self) -> None:
        for engine in self.engines:
            engine.update.mark_written()

    def writes_sent(self, complete: Callable[[str], bool]) -> None:
        """``complete(url)``: whether every write of this update into the engine landed
        (still unverified: ``writes_verified``)."""
        for engine in self.engines:
            if complete(engine.url):
                engine.update.writes_sent()

    def writes_verified(self, wrong: Collection[str] = ()) -> list[str]:
        """The engines whose writes all landed and whose end answered in this update
        (closed), except ``wrong`` (their write check failed or could not run): whole
        at the new version. Returns their URLs; the others stay torn."""
        whole = []
        for engine in self.engines:
            update = engine.update
            if update.unverified and update.phase is Phase.CLOSED and engine.url not in wrong:
                update.writes_landed()
                whole.append(engine.url)
        return whole

    def unended(self) -> list[str]:
        """The engines written in this update whose end has not answered (not closed)."""
        return [
            e.url
            for e in self.engines
            if e.update.unverified and e.update.phase is not Phase.CLOSED
        ]

    def close_only(self, urls: Collection[str]) -> None:
        """End the update sessions of these engines (each one's error kept in its state)."""
        concurrently(lambda e: e.update.close(), [e for e in self.engines if e.url in urls])

    def close(self) -> None:
        """End every open update session."""
        self.each(lambda e: e.update.close())

    def compare(self) -> None:
        """The engines' own weight check of this update against their snapshot."""
        self.each(lambda e: e.update.compare())

    def writes_wrong(self, urls: Collection[str]) -> None:
        """These engines' write check failed: they stay torn (``EngineUpdate.writes_wrong``)."""
        for engine in self.engines:
            if engine.url in urls:
                engine.update.writes_wrong()

    def finish(self, version: str) -> None:
        """Give every engine the new version and resume it."""
        self.each(lambda e: e.update.finish(version))

    def abort(self, resume_incomplete: bool = False) -> AbortReport:
        """End open sessions and resume what this session paused (see ``EngineUpdate.abort``)."""
        report = AbortReport()

        def one(engine: ConnectedEngine) -> None:
            try:
                report.outcomes[engine.url] = engine.update.abort(resume_incomplete)
            except EngineUnreachable as exc:
                report.outcomes[engine.url] = f"unreachable: {exc}"
            except Exception as exc:  # abort reports, it does not raise
                report.outcomes[engine.url] = f"failed: {exc}"

        concurrently(one, self.engines)
        return report

    def engine_reports(
        self,
        bytes_by_target: Mapping[EngineRankKey, int],
        transport: str,
        protocol: str,
        verification: Callable[[str], tuple[tuple[Verification, ...], str | None]],
        drives: bool,
    ) -> dict[str, EngineReport]:
        """What the last update did to each engine: the bytes this trainer rank wrote there,
        over what, ``verification(url)`` (how its writes were checked, and why not by write
        digests) and, where this rank ``drives`` the update sessions, its pause."""
        reports = {}
        for engine in self.engines:
            written = [n for (url, _), n in bytes_by_target.items() if url == engine.url]
            verified_by, why = verification(engine.url)
            update = engine.update
            resumed = drives and update.paused_s is not None
            reports[engine.url] = EngineReport(
                url=engine.url,
                transport=transport,
                protocol=protocol,
                num_ranks_written=len(written),
                bytes_written=sum(written),
                verified_by=verified_by,
                unverified_reason=why,
                paused_s=update.paused_s if resumed else None,
                pause_made=update.pause_made if resumed else None,
            )
        return reports

    def control_calls(self) -> ControlCalls:
        """Every HTTP call to the engines since the last update opened (its abort's too)."""
        return ControlCalls(tuple(call for e in self.engines for call in e.client.calls.calls()))

    def next_numeric_version(self) -> int:
        """One past the largest numeric weight version the engines report (1 if none is)."""
        versions = []
        for engine in self.engines:
            try:
                version = engine.client.weight_version()
                versions.append(int(version.removeprefix(UPDATING_PREFIX)))
            except (ValueError, EngineError):
                continue
        return max(versions, default=0) + 1

    def close_clients(self) -> None:
        for engine in self.engines:
            engine.client.close()
        self.engines = []
