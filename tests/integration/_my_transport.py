"""A transport of a user's own, registered as docs/architecture.md says: its config class
and its Transport, here a team's wrapper around Mooncake over TCP (standing in for their
own RDMA library) that writes into engines publishing for Mooncake."""

from __future__ import annotations

from typing import Literal

from p2pweights.config import TransportConfigBase
from p2pweights.transports.mooncake import MooncakeTransport


class LoopbackRdmaConfig(TransportConfigBase):
    """The team's transport: Mooncake's TCP path, on this host."""

    kind: Literal["loopback_rdma"] = "loopback_rdma"
    protocol: Literal["tcp"] = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"


class LoopbackRdmaTransport(MooncakeTransport):
    name = "loopback_rdma"

    def __init__(self, config: LoopbackRdmaConfig) -> None:
        type(self).built += 1
        super().__init__(config)  # type: ignore[arg-type]  # the same fields

    built = 0
