"""Moved to ``p2pweights.sync_session`` (import ``WeightSyncSession`` from ``p2pweights``);
this name re-exports it for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings

from p2pweights.sync_session import WeightSyncSession

warnings.warn(
    "p2pweights.session is now p2pweights.sync_session; import WeightSyncSession from "
    "p2pweights (this name goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["WeightSyncSession"]
