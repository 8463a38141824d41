"""The exceptions p2pweights raises.

::

    P2PWeightsError
    ├── ConfigError            bad configuration or bad input: raised before any byte is written,
    │                          except for a streamed input's tensor found bad as it arrives
    │                          (the message then says what the engines were left in)
    │   ├── SessionBusyError     another call of the session runs in another thread: nothing done
    │   └── InputChangedError    an input tensor changed after update() received it
    ├── PlanError              no valid assignment of trainer ranks to engine ranks
    ├── EngineError            an engine's HTTP API failed or answered something unusable
    │   ├── EngineUnreachable    no answer at all (refused connection, timeout): state unknown
    │   ├── EngineStateError     an engine was left mid-update (paused, weights incomplete)
    │   └── LayoutMismatchError  the replica's bytes do not fit what the engine published
    ├── TransportError         a transport could not be set up or connected
    └── TransferError          a write failed, timed out or was refused; fails the update
        └── UnsettledWrite       one gave up at its deadline, may still land: settle() it

Every message names what it can of engine URL, engine rank and parameter, and
what to do next. Lower-level exceptions are chained with ``raise ... from``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class P2PWeightsError(Exception):
    """Base class of every error p2pweights raises on purpose."""


class ConfigError(P2PWeightsError, ValueError):
    """The configuration or the input tensors are not usable."""


class SessionBusyError(ConfigError):
    """``update()`` or ``connect()`` was called while another call of the same session
    (``update``, ``connect``, ``abort``, ``close``) runs; nothing was done. The message
    names the running call."""


class InputChangedError(ConfigError):
    """An input tensor changed after ``update()`` received it and before its bytes were
    loaded (its version counter moved, or its data pointer did); the message names it.
    Raised while the update writes, before any engine resumes under the new version:
    engines already opened stay paused and torn until an update completes."""


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


class UnsettledWrite(TransferError):
    """A write gave up at its deadline while some of its transfers were neither confirmed
    finished nor cancelled: they may still read its source memory and land in the engine.

    Until ``settle`` returns True that memory must not be refilled, deregistered or freed,
    and the engine rank counts as torn (a later write into it could be overwritten by the
    stale one).
    """

    def __init__(self, message: str, settle: Callable[[float], bool] | None = None) -> None:
        super().__init__(message)
        self._settle = settle
        # rebuilt from its message alone (another trainer rank's, gathered): the transfer
        # is not this process's to watch, and may still land, so it never reads as settled
        self._settled = False

    @property
    def settled(self) -> bool:
        """Whether the transfers were seen finished or failed (by an earlier ``settle``)."""
        return self._settled

    def settle(self, timeout_s: float) -> bool:
        """Check at least once, and up to ``timeout_s``, whether the transfers finished or
        failed; True once they did (the transport then released what they held). Always
        False for one without a way to check (rebuilt from a message)."""
        if not self._settled and self._settle is not None:
            self._settled = self._settle(timeout_s)
        return self._settled


def some_of(items: Sequence[object], sep: str = "; ", limit: int = 4) -> str:
    """The first ``limit`` of ``items`` joined by ``sep``, then how many more, for error
    messages: ``a; b; c; d (and 3 more)``."""
    named = sep.join(str(item) for item in items[:limit])
    more = len(items) - limit
    return f"{named} (and {more} more)" if more > 0 else named


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
