"""Transports by name, imported only when used (none of them is a hard dependency)."""

from __future__ import annotations

import importlib
from typing import Any

from p2pweights.errors import ConfigError
from p2pweights.transports.base import Publisher, Transport, Write

_TRANSPORTS = {
    "mooncake": "p2pweights.transports.mooncake:MooncakeTransport",
    "nixl": "p2pweights.transports.nixl:NixlTransport",
    "cuda_ipc": "p2pweights.transports.cuda_ipc:CudaIpcTransport",
}
_PUBLISHERS = {
    "mooncake": "p2pweights.transports.mooncake:MooncakePublisher",
    "nixl": "p2pweights.transports.nixl:NixlPublisher",
    "cuda_ipc": "p2pweights.transports.cuda_ipc:CudaIpcPublisher",
}

__all__ = ["Publisher", "Transport", "Write", "create_publisher", "create_transport"]


_EXTRAS = {"mooncake": ("mooncake", "mooncake"), "nixl": ("nixl", "nixl")}
"""Transport -> (the package it needs, the p2pweights extra that installs it); CUDA IPC
needs no package beyond torch."""


def _load(table: dict[str, str], name: str) -> Any:
    if name not in table:
        raise ConfigError(f"unknown transport {name!r}; known: {sorted(table)}")
    module_name, _, attr = table[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        package, extra = _EXTRAS.get(name, (None, None))
        if package is None or (exc.name or "").split(".")[0] != package:
            raise  # not the transport's own package: an error to show as it is
        raise ConfigError(
            f"transport {name!r} needs the {package!r} package: pip install "
            f"'p2pweights[{extra}]' ({exc})"
        ) from exc
    return getattr(module, attr)


def create_transport(config: Any) -> Transport:
    """The trainer-side transport for ``config`` (a ``MooncakeConfig``, ``NixlConfig``
    or ``CudaIpcConfig``)."""
    return _load(_TRANSPORTS, config.kind)(config)


def create_publisher(kind: str, **options: Any) -> Publisher:
    """The engine-side publisher for transport ``kind`` (used by the local engine)."""
    return _load(_PUBLISHERS, kind)(**options)
