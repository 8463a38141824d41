"""One engine rank's NIXL publication: register the loaded weights, hand the info to sglang.

``publish_model`` does what sglang PR #35712 does per TP rank: one agent
``nixl_weight_tp{rank}_<uuid>``, the merged blocks holding ``model.named_parameters()``
registered (VRAM with the GPU id on a GPU engine, DRAM on a CPU one), and the agent
metadata taken after registration. ``put_publication`` PUTs it to the instance's
engine info bootstrap server, the way sglang's ``RemoteInstanceWeightTransporter``
PUTs Mooncake info. Nothing here imports sglang.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import httpx

from p2pweights.errors import ConfigError, EngineError
from p2pweights.transfer.transports.nixl import NixlPublisher

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)


def publish_model(
    model: nn.Module, engine_rank: int, backend: str
) -> tuple[NixlPublisher, dict[str, Any]]:
    """Register ``model``'s parameters with a new NIXL agent; return it and its publication.

    The publisher must stay alive (and unclosed) as long as writers may write: it
    owns the agent and the registrations.
    """
    params = {name: p.data for name, p in model.named_parameters()}
    if not params:
        raise ConfigError(f"tp rank {engine_rank}: the model has no parameters to publish")
    publisher = NixlPublisher(backend=backend, engine_rank=engine_rank)
    try:
        publisher.register(params)
        info = publisher.publication(params)
    except ConfigError as exc:
        publisher.close()
        raise ConfigError(
            f"tp rank {engine_rank}: cannot publish the weights over NIXL ({exc}); all "
            f"parameters must live on one device (CPU offload is not supported)"
        ) from exc
    except BaseException:
        publisher.close()
        raise
    return publisher, info


def put_publication(
    bootstrap_url: str, engine_rank: int, info: dict[str, Any], timeout_s: float = 60.0
) -> None:
    """PUT one rank's info to the bootstrap server, retrying until it answers.

    The server starts before the ranks on the head node, but ranks on other nodes
    may finish loading first; so connection failures are retried for ``timeout_s``.
    A refusal (4xx / 5xx) is not retried.
    """
    url = f"{bootstrap_url}/register_transfer_engine_info"
    payload = {"tp_rank": engine_rank, "transfer_engine_info": info}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = httpx.put(url, json=payload, timeout=10.0)
        except httpx.TransportError as exc:
            if time.monotonic() > deadline:
                raise EngineError(
                    f"tp rank {engine_rank}: the engine info bootstrap server at {bootstrap_url} "
                    f"did not answer within {timeout_s:g} s ({exc!r}); check "
                    f"--engine-info-bootstrap-port and that the head node's launcher runs the "
                    f"p2pweights_nixl plugin too"
                ) from exc
            time.sleep(0.5)
            continue
        if response.status_code != 200:
            raise EngineError(
                f"tp rank {engine_rank}: the engine info bootstrap server at {bootstrap_url} "
                f"refused the NIXL publication ({response.status_code}: {response.text[:300]}); "
                f"is SGLANG_PLUGINS=p2pweights_nixl set for the launching process too?"
            )
        return
