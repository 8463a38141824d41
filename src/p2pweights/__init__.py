"""p2pweights: point-to-point weight sync from RL trainers into sglang rollout engines.

::

    from p2pweights import WeightSyncSession, SyncConfig, MooncakeConfig

    with WeightSyncSession(SyncConfig(transport=MooncakeConfig(protocol="tcp"))) as session:
        session.connect(["http://127.0.0.1:30000"])
        report = session.update(hf_named_tensors(model))  # p2pweights.adapters

Importing this package imports neither torch, sglang nor a transport: each public name
is imported from its module when first used (``__getattr__`` below), and a module loads
its heavy dependencies when it needs them.

The public API is ``__all__`` here and in these modules (each pinned by a test):

- ``p2pweights``: the session, its configs (``DeltaConfig`` too), the reports
  (``UpdateReport``, ``EngineReport``, ``DeltaReport``, ``AbortReport``), the errors, and
  ``EngineClient`` / ``verify_engine`` (an engine's HTTP API; bit-exact verification);
- ``p2pweights.verify``: ``verify_engine`` and the checksums it compares;
- ``p2pweights.adapters``: trainer glue such as ``torch_agree``;
- ``p2pweights.local_engine``: ``LocalEngine``, a CPU engine for tests and demos;
- ``p2pweights.testing``: shipped model configs and ``synthetic_weights``, the tensors
  a ``p2pweights engine --seed S`` engine starts from.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pweights.config import (
        CudaIpcConfig,
        DeltaConfig,
        MooncakeConfig,
        NixlConfig,
        SyncConfig,
    )
    from p2pweights.engines.client import EngineClient
    from p2pweights.engines.endpoint import EngineEndpoint
    from p2pweights.engines.update_session import AbortReport
    from p2pweights.errors import (
        ConfigError,
        EngineError,
        EngineStateError,
        EngineUnreachable,
        InputChangedError,
        LayoutMismatchError,
        P2PWeightsError,
        PlanError,
        SessionBusyError,
        TransferError,
        TransportError,
        UnsettledWrite,
    )
    from p2pweights.report import DeltaReport, EngineReport, UpdateReport
    from p2pweights.session import WeightSyncSession
    from p2pweights.verify import verify_engine

__version__ = "0.1.0"

__all__ = [
    "AbortReport",
    "ConfigError",
    "CudaIpcConfig",
    "DeltaConfig",
    "DeltaReport",
    "EngineClient",
    "EngineEndpoint",
    "EngineError",
    "EngineReport",
    "EngineStateError",
    "EngineUnreachable",
    "InputChangedError",
    "LayoutMismatchError",
    "MooncakeConfig",
    "NixlConfig",
    "P2PWeightsError",
    "PlanError",
    "SessionBusyError",
    "SyncConfig",
    "TransferError",
    "TransportError",
    "UnsettledWrite",
    "UpdateReport",
    "WeightSyncSession",
    "__version__",
    "verify_engine",
]

_WHERE = {
    "AbortReport": "p2pweights.engines.update_session",
    "ConfigError": "p2pweights.errors",
    "CudaIpcConfig": "p2pweights.config",
    "DeltaConfig": "p2pweights.config",
    "DeltaReport": "p2pweights.report",
    "EngineClient": "p2pweights.engines.client",
    "EngineEndpoint": "p2pweights.engines.endpoint",
    "EngineError": "p2pweights.errors",
    "EngineReport": "p2pweights.report",
    "EngineStateError": "p2pweights.errors",
    "EngineUnreachable": "p2pweights.errors",
    "InputChangedError": "p2pweights.errors",
    "LayoutMismatchError": "p2pweights.errors",
    "MooncakeConfig": "p2pweights.config",
    "NixlConfig": "p2pweights.config",
    "P2PWeightsError": "p2pweights.errors",
    "PlanError": "p2pweights.errors",
    "SessionBusyError": "p2pweights.errors",
    "SyncConfig": "p2pweights.config",
    "TransferError": "p2pweights.errors",
    "TransportError": "p2pweights.errors",
    "UnsettledWrite": "p2pweights.errors",
    "UpdateReport": "p2pweights.report",
    "WeightSyncSession": "p2pweights.session",
    "verify_engine": "p2pweights.verify",
}
"""Public name -> the module that defines it (imported on first use of the name)."""


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then kept here)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pweights' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
