"""Transports by name, imported only when used (none of them is a hard dependency).

The names are ``p2pweights.transport_registry``'s: the built-ins (mooncake, nixl,
cuda_ipc) and any a user registers with ``register_transport`` (a config class deriving
from ``p2pweights.config.TransportConfigBase``, a ``Transport``, optionally a
``Publisher``).
"""

from __future__ import annotations

from typing import Any

from p2pweights.errors import ConfigError
from p2pweights.transport_registry import entry, load, register_transport, transport_names
from p2pweights.transports.base import Publisher, Transport, Write

__all__ = [
    "Publisher",
    "Transport",
    "Write",
    "create_publisher",
    "create_transport",
    "register_transport",
    "transport_names",
]

_BUILT_IN = ("mooncake", "nixl", "cuda_ipc")


_EXTRAS = {"mooncake": ("mooncake", "mooncake"), "nixl": ("nixl", "nixl")}
"""Built-in transport -> (the package it needs, the p2pweights extra that installs it);
CUDA IPC needs no package beyond torch."""


def _load(spec: type | str, name: str, side: str) -> Any:
    try:
        return load(spec, f"transport {name!r} ({side})")
    except ConfigError as exc:
        cause = exc.__cause__
        if not isinstance(cause, ImportError):
            raise
        package, extra = _EXTRAS.get(name, (None, None))
        missing = (getattr(cause, "name", None) or "").split(".")[0]
        if package is None or not isinstance(cause, ModuleNotFoundError) or missing != package:
            if name in _BUILT_IN:
                raise cause from None  # not the transport's own package: the error as it is
            raise
        raise ConfigError(
            f"transport {name!r} needs the {package!r} package: pip install "
            f"'p2pweights[{extra}]' ({cause})"
        ) from cause


def create_transport(config: Any) -> Transport:
    """The trainer-side transport for ``config`` (a ``MooncakeConfig``, ``NixlConfig``,
    ``CudaIpcConfig`` or a registered transport's config), as ``Transport(config)``."""
    found = entry(config.kind)
    transport: Transport = _load(found.transport, found.name, "trainer side")(config)
    return transport


def create_publisher(kind: str, **options: Any) -> Publisher:
    """The engine-side publisher for transport ``kind`` (used by the local engine)."""
    found = entry(kind)
    if found.publisher is None:
        raise ConfigError(f"transport {kind!r} registered no engine-side publisher")
    publisher: Publisher = _load(found.publisher, found.name, "engine side")(**options)
    return publisher
