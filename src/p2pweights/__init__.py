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

- ``p2pweights``: what a trainer uses: the session, its configs (``DeltaConfig`` too, and
  ``TransportConfigBase``, the base of a transport's config; a transport of your own
  registers with ``p2pweights.transports.register_transport``),
  ``TrainerTopology`` (where a process stands among the sending ranks), the reports
  (``UpdateReport``, ``EngineReport``, ``DeltaReport``, ``AbortReport``) and the errors;
- ``p2pweights.verify``: ``verify_engine``, the checksums it compares and ``EngineClient``
  (an engine's HTTP API), for checking an engine bit-exactly (tests, demos); both were
  top-level names in 0.1 and import from ``p2pweights`` with a ``DeprecationWarning``
  for one more release;
- ``p2pweights.adapters``: trainer glue such as ``torch_agree``;
- ``p2pweights.local_engine``: ``LocalEngine``, a CPU engine for tests and demos;
- ``p2pweights.testing``: shipped model configs and ``synthetic_weights``, the tensors
  a ``p2pweights engine --seed S`` engine starts from.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pweights.config import (
        CudaIpcConfig,
        DeltaConfig,
        MooncakeConfig,
        NixlConfig,
        SyncConfig,
        Timeouts,
        TrainerTopology,
        TransportConfigBase,
    )
    from p2pweights.engines.endpoint import EngineEndpoint
    from p2pweights.engines.update_state import AbortReport
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
    from p2pweights.report import DeltaReport, EngineRankKey, EngineReport, UpdateReport
    from p2pweights.sync_session import WeightSyncSession

__version__ = "0.1.0"

__all__ = [
    "AbortReport",
    "ConfigError",
    "CudaIpcConfig",
    "DeltaConfig",
    "DeltaReport",
    "EngineEndpoint",
    "EngineError",
    "EngineRankKey",
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
    "Timeouts",
    "TransferError",
    "TrainerTopology",
    "TransportConfigBase",
    "TransportError",
    "UnsettledWrite",
    "UpdateReport",
    "WeightSyncSession",
    "__version__",
]

_WHERE = {
    "AbortReport": "p2pweights.engines.update_state",
    "ConfigError": "p2pweights.errors",
    "CudaIpcConfig": "p2pweights.config",
    "DeltaConfig": "p2pweights.config",
    "DeltaReport": "p2pweights.report",
    "EngineEndpoint": "p2pweights.engines.endpoint",
    "EngineError": "p2pweights.errors",
    "EngineRankKey": "p2pweights.report",
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
    "Timeouts": "p2pweights.config",
    "TransferError": "p2pweights.errors",
    "TrainerTopology": "p2pweights.config",
    "TransportConfigBase": "p2pweights.config",
    "TransportError": "p2pweights.errors",
    "UnsettledWrite": "p2pweights.errors",
    "UpdateReport": "p2pweights.report",
    "WeightSyncSession": "p2pweights.sync_session",
}
"""Public name -> the module that defines it (imported on first use of the name)."""

_MOVED = {
    "EngineClient": "p2pweights.verify",
    "verify_engine": "p2pweights.verify",
}
"""Former top-level names -> where they live now; the old name warns until the release
after the move (checking an engine is not what a trainer does every step)."""


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then kept here)."""
    if name in _MOVED:
        warnings.warn(
            f"p2pweights.{name} moved to {_MOVED[name]}.{name}; import it from there "
            "(the top-level name goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)  # not cached: warns each time
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pweights' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
