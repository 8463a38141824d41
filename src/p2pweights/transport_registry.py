"""Transports by name: what ``SyncConfig(transport=...)`` may name, and what each name needs.

An entry holds a transport's config class (its ``kind`` is the name), its trainer-side
``Transport`` class, its engine-side ``Publisher`` class (optional) and the publication
backend its transport writes into (what an engine rank publishes under ``backend``; by
default the name itself). Each may be a class or a ``"module:attribute"`` string,
imported only when first used, as vLLM's weight-transfer factory does: a registry entry
costs no import. The built-in transports are registered below exactly as a user's is::

    from p2pweights.transports import register_transport

    register_transport(
        "my_rdma",
        config="my_pkg.p2p:MyRdmaConfig",        # a TransportConfigBase with kind "my_rdma"
        transport="my_pkg.p2p:MyRdmaTransport",  # a p2pweights.transports.Transport
        publication="mooncake",                  # writes into Mooncake-published engines
    )

A name registers once (``replace=True`` to register it again); an unknown name is refused
with the known ones listed.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any

from p2pweights.errors import ConfigError

__all__ = [
    "TransportEntry",
    "config_class",
    "entry",
    "load",
    "publication_backend",
    "publication_backends",
    "register_transport",
    "transport_names",
]


@dataclass(frozen=True)
class TransportEntry:
    """What one transport name stands for."""

    name: str
    config: type | str
    """The config class (``kind`` equal to ``name``), or ``"module:Class"``."""
    transport: type | str
    """The trainer-side ``Transport`` class, built as ``transport(config)``."""
    publisher: type | str | None = None
    """The engine-side ``Publisher`` class (the local engine builds it), if any."""
    publication: str = ""
    """The publication backend the transport writes into; empty: ``name``."""

    @property
    def backend(self) -> str:
        return self.publication or self.name


_LOCK = threading.Lock()
_ENTRIES: dict[str, TransportEntry] = {}


def register_transport(
    name: str,
    *,
    config: type | str,
    transport: type | str,
    publisher: type | str | None = None,
    publication: str | None = None,
    replace: bool = False,
) -> None:
    """Make ``name`` a transport ``SyncConfig(transport=...)`` takes (a config instance
    whose ``kind`` is ``name``, or a mapping with ``"kind": name``). Classes may be given
    as ``"module:attribute"`` strings, imported when first used. ``publication``: the
    backend engines publish for it (default ``name``). Raises ``ConfigError`` for a name
    registered already (unless ``replace``)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a transport name must be a non-empty string, got {name!r}")
    new = TransportEntry(name, config, transport, publisher, publication or "")
    with _LOCK:
        if name in _ENTRIES and not replace and _ENTRIES[name] != new:
            raise ConfigError(
                f"transport {name!r} is registered already; pass replace=True to register it again"
            )
        _ENTRIES[name] = new


def transport_names() -> list[str]:
    """Every registered transport name, sorted."""
    with _LOCK:
        return sorted(_ENTRIES)


def entry(name: str) -> TransportEntry:
    """The entry of ``name``; ``ConfigError`` listing the known names where there is none."""
    with _LOCK:
        found = _ENTRIES.get(name)
    if found is None:
        raise ConfigError(
            f"unknown transport {name!r}; known: {', '.join(transport_names())} (register "
            "one with p2pweights.transports.register_transport)"
        )
    return found


def load(spec: type | str, what: str) -> Any:
    """``spec`` itself, or the attribute a ``"module:attribute"`` string names (imported
    now); ``ConfigError`` naming ``what`` and the package to install where it does not
    import."""
    if not isinstance(spec, str):
        return spec
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} needs its package ({spec}): {exc}") from exc
    try:
        return getattr(module, attribute)
    except AttributeError as exc:
        raise ConfigError(f"{what}: {module_name} has no {attribute!r} ({spec})") from exc


def config_class(name: str) -> type:
    """The config class registered for ``name``."""
    cls: type = load(entry(name).config, f"transport {name!r}'s config")
    return cls


def publication_backend(name: str) -> str:
    """The publication backend transport ``name`` writes into (``name`` where unknown)."""
    with _LOCK:
        found = _ENTRIES.get(name)
    return name if found is None else found.backend


def publication_backends() -> set[str]:
    """Every publication backend some registered transport writes into."""
    with _LOCK:
        return {found.backend for found in _ENTRIES.values()}


for _name, _module, _stem in (
    ("mooncake", "p2pweights.transports.mooncake", "Mooncake"),
    ("nixl", "p2pweights.transports.nixl", "Nixl"),
    ("cuda_ipc", "p2pweights.transports.cuda_ipc", "CudaIpc"),
):
    register_transport(
        _name,
        config=f"p2pweights.config:{_stem}Config",
        transport=f"{_module}:{_stem}Transport",
        publisher=f"{_module}:{_stem}Publisher",
    )
