"""Connecting to engines: read what each serves and publishes, refuse what cannot be written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pweights.engines.client import EngineClient
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.published import RankPublication
from p2pweights.errors import EngineError

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
        publications = [
            client.publication(rank) for rank in range(num_engine_ranks(endpoint.url, server_info))
        ]
    except Exception:
        client.close()
        raise
    for pub in publications:
        if pub.backend != transport_kind:
            client.close()
            raise EngineError(
                f"engine {endpoint.url} rank {pub.engine_rank} published its weights for "
                f"{pub.backend}, but this session writes over {transport_kind}. Either set "
                f"SyncConfig(transport={_config_name(pub.backend)}(...)) or "
                f"{_PUBLISH_FLAGS[transport_kind]}."
            )
    return ConnectedEngine(index, endpoint, client, server_info, publications)


def _config_name(backend: str) -> str:
    return {"mooncake": "MooncakeConfig", "nixl": "NixlConfig"}.get(backend, backend)
