"""The exceptions p2pweights raises.

::

    P2PWeightsError
    ├── ConfigError            bad configuration or bad input, raised before any byte is written
    ├── PlanError              no valid assignment of trainer ranks to engine ranks
    ├── EngineError            an engine's HTTP API failed or answered something unusable
    │   ├── EngineUnreachable    no answer at all (refused connection, timeout): state unknown
    │   ├── EngineStateError     an engine was left mid-update (paused, weights incomplete)
    │   └── LayoutMismatchError  the replica's bytes do not fit what the engine published
    ├── TransportError         a transport could not be set up or connected
    └── TransferError          a write failed, timed out or was refused; fails the update

Every message names what it can of engine URL, engine rank and parameter, and
what to do next. Lower-level exceptions are chained with ``raise ... from``.
"""

from __future__ import annotations


class P2PWeightsError(Exception):
    """Base class of every error p2pweights raises on purpose."""


class ConfigError(P2PWeightsError, ValueError):
    """The configuration or the input tensors are not usable."""


class PlanError(P2PWeightsError):
    """Trainer ranks cannot be assigned to engine ranks as asked."""


class EngineError(P2PWeightsError):
    """A rollout engine's API failed or answered something p2pweights cannot use."""


class EngineUnreachable(EngineError):
    """The engine gave no answer (connection refused, reset or timed out).

    Unlike an answered refusal, the call may or may not have taken effect, so the
    engine's update state is unknown until it is asked again.
    """


class EngineStateError(EngineError):
    """Engines were left paused or mid-update; the message says which and why."""


class LayoutMismatchError(EngineError):
    """The replica's layout of a parameter differs from what the engine published."""


class TransportError(P2PWeightsError):
    """A transport could not be initialised, register memory or reach a peer."""


class TransferError(P2PWeightsError):
    """A write failed, did not finish in time, or would leave a published region."""


def where(url: str | None = None, rank: int | None = None, param: str | None = None) -> str:
    """``engine http://h:p rank 1 parameter model.x`` for error messages."""
    parts = []
    if url is not None:
        parts.append(f"engine {url}")
    if rank is not None:
        parts.append(f"rank {rank}")
    if param is not None:
        parts.append(f"parameter {param!r}")
    return " ".join(parts)
