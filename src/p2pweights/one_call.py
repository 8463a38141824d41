"""One call of a ``WeightSyncSession`` at a time, whatever thread makes it.

``connect``, ``update``, ``abort`` and ``close`` read and replace the same state (the
engines, the plan, the writers), so at most one of them runs. What a call does when
another runs:

* ``update()`` and ``connect()`` are refused with ``SessionBusyError`` naming the call
  that runs, having done nothing (a second update, or a reconnect under a running one,
  would tear down what the running call reads), also while an ``abort()`` or
  ``close()`` waits for the running call (so a loop of updates cannot starve it);
* ``abort()`` and ``close()`` never refuse: they cancel a running ``update()`` (it raises
  ``TransferError`` at its next check) and wait for whatever runs to return, then do
  their work;
* on the running call's own thread (its input iterator, a signal handler) every call is
  refused with ``SessionBusyError`` (waiting would never end); ``abort()`` and
  ``close()`` still cancel an ``update()`` running there.

Costs one uncontended lock per call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from p2pweights.errors import SessionBusyError

__all__ = ["OneCall"]


class OneCall:
    """The lock every session call holds, and which call holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Guards who holds ``_lock`` (taking it and naming the holder are one step) and the
        # waiters, so ``abort()`` never misses the update it must cancel.
        self._state = threading.Lock()
        self._name: str | None = None
        self._thread: int | None = None
        # ``abort()`` / ``close()`` calls waiting for ``_lock``: new updates are refused
        # meanwhile, so a loop of updates cannot starve them.
        self._waiters = 0
        # Set by ``abort()`` / ``close()`` while an update runs: it stops at its next check.
        self.cancel = threading.Event()

    @property
    def running(self) -> str | None:
        """The call running now (``"update"``, ...), or None."""
        with self._state:
            return self._name

    @contextmanager
    def refusing(self, name: str) -> Iterator[None]:
        """Run ``name`` alone, or raise ``SessionBusyError`` if another call runs or an
        ``abort()`` / ``close()`` waits to."""
        with self._state:
            if self._waiters or not self._lock.acquire(blocking=False):
                raise self._busy(name)
            self._name, self._thread = name, threading.get_ident()
        with self._held():
            yield

    @contextmanager
    def waiting(self, name: str) -> Iterator[None]:
        """Run ``name`` alone, once the running call returned (a running update is
        cancelled first)."""
        with self._state:
            if self._name == "update":
                self.cancel.set()
            if self._thread == threading.get_ident():
                raise self._busy(name)
            self._waiters += 1
        try:
            self._lock.acquire()
        finally:
            with self._state:
                self._waiters -= 1
        with self._state:
            self.cancel.clear()  # meant for the update just waited for
            self._name, self._thread = name, threading.get_ident()
        with self._held():
            yield

    @contextmanager
    def _held(self) -> Iterator[None]:
        try:
            yield
        finally:
            with self._state:
                self._name = self._thread = None
                self.cancel.clear()
                self._lock.release()

    def _busy(self, name: str) -> SessionBusyError:
        """(Under ``_state``.)"""
        if self._name is None and self._waiters:
            return SessionBusyError(
                f"{name}() refused: abort() or close() waits to run in another thread of "
                f"this session; nothing was done"
            )
        running = self._name or "another call"
        if self._thread == threading.get_ident():
            cancelled = name in ("abort", "close") and running == "update"
            return SessionBusyError(
                f"{name}() refused: {running}() is running on its own thread (called from "
                f"inside it: its input iterator, a signal handler?)"
                + (
                    "; the update is cancelled and raises TransferError: call abort() once "
                    "it returned"
                    if cancelled
                    else "; call it once that returned"
                )
            )
        return SessionBusyError(
            f"{name}() refused: {running}() is running in another thread of this session; "
            f"nothing was done. Call it once {running}() returned"
            + (", or abort() the update first" if running == "update" else "")
        )
