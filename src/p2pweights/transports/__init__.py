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


def _load(spec: type | str, name: str, side: str) -> Any:
    try:
        return load(spec, f"transport {name!r} ({side})")
    except ConfigError as exc:
        if name in _BUILT_IN and isinstance(exc.__cause__, ImportError):
            raise ConfigError(
                f"transport {name!r} needs its package: pip install 'p2pweights[{name}]' "
                f"({exc.__cause__})"
            ) from exc.__cause__
        raise


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
