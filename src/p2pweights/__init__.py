"""p2pweights: point-to-point weight sync from RL trainers into sglang rollout engines.

::

    from p2pweights import WeightSyncSession, SyncConfig, MooncakeConfig

    with WeightSyncSession(SyncConfig(transport=MooncakeConfig(protocol="tcp"))) as session:
        session.connect(["http://127.0.0.1:30000"])
        report = session.update(model.named_parameters_in_hf_names())

Importing this package imports neither sglang nor a transport; they load when used.
"""

from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.errors import (
    ConfigError,
    EngineError,
    LayoutMismatchError,
    P2PWeightsError,
    PlanError,
    TransferError,
    TransportError,
)
from p2pweights.report import UpdateReport
from p2pweights.session import WeightSyncSession

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "EngineEndpoint",
    "EngineError",
    "LayoutMismatchError",
    "MooncakeConfig",
    "NixlConfig",
    "P2PWeightsError",
    "PlanError",
    "SyncConfig",
    "TransferError",
    "TransportError",
    "UpdateReport",
    "WeightSyncSession",
    "__version__",
]
