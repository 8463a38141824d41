"""One writer thread per engine rank: a stuck engine rank delays only its own writes.

A ``WriteBatch`` is what one flush sends one runner of an engine rank (its target
model, or its speculative draft, each published with its own transport handle):
(source, destination, length) triples plus the parameter each write carries, so a
failure names it.
Writers of different ranks of one engine run at the same time (several NICs, or
NVLink to several GPUs). Once a batch to a rank failed, later batches to that rank
are skipped rather than sent (each would wait out its own timeout on a dead peer).
A writer whose write was given up on while still in flight (``UnsettledWrite``)
refuses every later batch, of any update, until that write settled: a new write into
the rank could otherwise be overwritten by the stale one landing after it.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from p2pweights.errors import TransferError, UnsettledWrite, some_of
from p2pweights.report import EngineRankKey
from p2pweights.transports.base import Transport, Write
from p2pweights.wire.publication import RankPublication

TargetKey = EngineRankKey
"""The engine rank one writer serves."""


@dataclass
class WriteBatch:
    target: RankPublication
    writes: list[Write] = field(default_factory=list)
    params: list[str] = field(default_factory=list)

    @property
    def key(self) -> TargetKey:
        return self.target.key

    @property
    def num_bytes(self) -> int:
        return sum(w.num_bytes for w in self.writes)

    def add(self, write: Write, param: str) -> None:
        self.writes.append(write)
        self.params.append(param)

    def describe(self) -> str:
        """``engine URL rank R parameters a, b, ... (and N more)`` for error messages."""
        return f"{self.target.where} parameters {some_of(self.params, ', ')}"


def closed_writer(batch: WriteBatch) -> TransferError:
    """A batch its writer never ran: the writer was closed (the session reconnected or
    closed while the update ran)."""
    return TransferError(
        f"write to {batch.describe()} was not made: its writer was closed before it ran "
        f"(the session reconnected or closed while the update ran)"
    )


class FailedTargets:
    """The engine ranks whose writes failed in this update, with the first error of each."""

    def __init__(self) -> None:
        self._errors: dict[TargetKey, BaseException] = {}
        self._lock = threading.Lock()

    def record(self, key: TargetKey, error: BaseException) -> None:
        with self._lock:
            self._errors.setdefault(key, error)

    def get(self, key: TargetKey) -> BaseException | None:
        with self._lock:
            return self._errors.get(key)

    def errors(self) -> dict[TargetKey, BaseException]:
        with self._lock:
            return dict(self._errors)


class RankWriter:
    """Runs one engine rank's write batches in order on its own thread."""

    def __init__(self, key: TargetKey, transport: Transport, timeout_s: float):
        self.key = key
        self._transport = transport
        self._timeout_s = timeout_s
        url, rank = key
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"p2pw-writer-{url}-r{rank}")
        # Batches submitted and maybe not run yet (pruned at each submit).
        self._queued: list[Future[None]] = []
        # This rank's last write given up on while in flight, until it settled.
        self._unsettled: UnsettledWrite | None = None

    def submit(self, batch: WriteBatch, failed: FailedTargets) -> Future[None]:
        """Queue ``batch``; once the writer was closed, a future failed with
        ``TransferError`` (recorded in ``failed``) instead."""
        try:
            future = self._thread.submit(self._run, batch, failed)
        except RuntimeError:  # shut down: closed by a reconnect or close under a run
            error = closed_writer(batch)
            failed.record(self.key, error)
            refused: Future[None] = Future()
            refused.set_exception(error)
            return refused
        self._queued = [f for f in self._queued if not f.done()]
        self._queued.append(future)
        return future

    def _run(self, batch: WriteBatch, failed: FailedTargets) -> None:
        earlier = failed.get(self.key)
        if earlier is not None:
            raise TransferError(f"write to {batch.describe()} skipped: an earlier write failed")
        if self._unsettled is not None and not self._unsettled.settle(0.0):
            error = TransferError(
                f"write to {batch.describe()} refused: an earlier write to this engine rank "
                f"was given up on and may still land ({self._unsettled}); close() the "
                f"session and connect a new one if it never ends"
            )
            failed.record(self.key, error)
            raise error
        self._unsettled = None
        try:
            self._transport.write(batch.target, batch.writes, self._timeout_s)
        except UnsettledWrite as exc:
            unsettled = UnsettledWrite(f"write to {batch.describe()} failed: {exc}", exc.settle)
            self._unsettled = unsettled
            failed.record(self.key, unsettled)
            raise unsettled from exc
        except Exception as exc:  # a transport bug must still fail the update, named
            error = TransferError(f"write to {batch.describe()} failed: {exc}")
            error.__cause__ = exc
            failed.record(self.key, error)
            raise error from exc

    def close(self) -> None:
        """Cancel queued batches and wait for the running one (transports bound it by
        ``timeout_s``); a write it gave up on unsettled is the executor's to keep track of.

        A cancelled batch's future is marked done for ``concurrent.futures.wait`` (which a
        plain cancel does not wake: a run waiting for it would wait out its timeout and
        take it for a write still in flight)."""
        self._thread.shutdown(wait=True, cancel_futures=True)
        for future in self._queued:
            if future.cancelled():
                with contextlib.suppress(RuntimeError):  # already notified
                    future.set_running_or_notify_cancel()
        self._queued = []
