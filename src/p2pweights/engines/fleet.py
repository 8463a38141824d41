"""Connecting to engines: read what each serves and publishes, refuse what cannot be written."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from p2pweights.engines.client import EngineClient
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.published import RankPublication
from p2pweights.engines.speculative import has_model_draft
from p2pweights.errors import EngineError

T = TypeVar("T")

_PUBLISH_FLAGS = {
    "mooncake": "start sglang with --remote-instance-weight-loader-start-seed-via-transfer-engine",
    "nixl": "start sglang with the p2pweights NIXL plugin (SGLANG_PLUGINS=p2pweights_nixl) "
    "or --remote-instance-weight-loader-start-seed-via-nixl",
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

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def num_ranks(self) -> int:
        return len(self.publications)


def num_engine_ranks(url: str, server_info: dict[str, Any]) -> int:
    """The TP ranks; pipeline stages cannot be told apart (sglang #37216)."""
    pp_size = int(server_info.get("pp_size") or 1)
    if pp_size > 1:
        raise EngineError(
            f"engine {url}: pp_size={pp_size}; sglang publishes weights keyed by TP rank only "
            f"(sglang issue #37216), so pipeline stages cannot be written. Use pp_size 1."
        )
    return int(server_info["tp_size"])


def connect_engine(
    index: int,
    endpoint: EngineEndpoint,
    transport_kind: str,
    timeout_s: float,
    api_key: str | None,
) -> ConnectedEngine:
    client = EngineClient(endpoint.url, timeout_s=timeout_s, api_key=endpoint.api_key or api_key)
    try:
        server_info = client.server_info()
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
    for pub in publications + drafts:
        if pub.backend != transport_kind:
            client.close()
            raise EngineError(
                f"engine {endpoint.url} rank {pub.engine_rank} published its weights for "
                f"{pub.backend}, but this session writes over {transport_kind}. Either set "
                f"SyncConfig(transport={_config_name(pub.backend)}(...)) or "
                f"{_PUBLISH_FLAGS[transport_kind]}."
            )
    return ConnectedEngine(index, endpoint, client, server_info, publications, drafts)


def _config_name(backend: str) -> str:
    return {"mooncake": "MooncakeConfig", "nixl": "NixlConfig"}.get(backend, backend)


def concurrently(call: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
    """``call`` on every item at once; after all finished, raise naming every failure."""
    if len(items) <= 1:
        return [call(item) for item in items]
    with ThreadPoolExecutor(min(len(items), 16)) as pool:
        futures = [pool.submit(call, item) for item in items]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if len(errors) == 1:
        raise errors[0]  # type: ignore[misc]
    if errors:
        raise EngineError("; ".join(str(e) for e in errors)) from errors[0]
    return [f.result() for f in futures]


class Fleet:
    """The connected engines, driven together through their update session."""

    def __init__(self, engines: list[ConnectedEngine]):
        self.engines = engines

    @classmethod
    def connect(
        cls,
        endpoints: Sequence[EngineEndpoint],
        transport_kind: str,
        timeout_s: float,
        api_key: str | None,
    ) -> Fleet:
        """Connect every engine; if any fails, close the ones that did and raise."""
        connected: list[ConnectedEngine | None] = [None] * len(endpoints)

        def one(index: int) -> None:
            connected[index] = connect_engine(
                index, endpoints[index], transport_kind, timeout_s, api_key
            )

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

    def open_update(self, pause_mode: str, snapshot: bool) -> None:
        """Pause, optionally snapshot + reset for the weight check, flush, begin."""
        self.each(lambda e: e.client.pause_generation(pause_mode))
        if snapshot:
            self.each(lambda e: e.client.weights_checker("snapshot"))
            self.each(lambda e: e.client.weights_checker("reset_tensors"))
        if pause_mode != "in_place":
            self.each(lambda e: e.client.flush_cache())
        self.each(lambda e: e.client.begin_weight_update("all"))

    def close_update(self, version: str) -> None:
        self.each(lambda e: e.client.update_weight_version(version))
        self.each(lambda e: e.client.end_weight_update())

    def compare(self) -> None:
        """The engines' own weight check of this update against their snapshot."""
        self.each(lambda e: e.client.weights_checker("compare"))

    def resume(self) -> None:
        self.each(lambda e: e.client.continue_generation())

    def next_numeric_version(self) -> int:
        """One past the largest numeric weight version the engines report (1 if none is)."""
        versions = []
        for engine in self.engines:
            try:
                versions.append(int(engine.client.weight_version()))
            except (ValueError, EngineError):
                continue
        return max(versions, default=0) + 1

    def close(self) -> None:
        for engine in self.engines:
            engine.client.close()
        self.engines = []
