"""One ``WeightSyncSession.update`` fed bucket by bucket, for trainers handing over weights by call.

Frameworks such as miles produce an update's tensors in buckets, one call per bucket
(gather, convert, hand over), while ``session.update`` reads one iterator.
``StreamedUpdate`` runs the update on a worker thread and feeds it the buckets as they
come:

* ``send(bucket)`` hands a bucket over and returns once the update has taken every
  pair of it (the session holds the tensors from then on; the trainer must not change
  them until the update ends, which a trainer building each bucket afresh never does);
* ``finish()`` ends the stream, waits for the update and returns its ``UpdateReport``;
* ``cancel(reason)`` makes the stream raise ``TransferError`` into the update (the
  trainer stopped sending) and waits a bounded time for it to end.

An error the update raised surfaces from the ``send`` or ``finish`` running when it
ended, else from the next one: never swallowed. With several trainer ranks the session
reads a failed update's stream to its end before all ranks fail together, so there the
error surfaces from ``finish`` on every rank.

A first update whose iterator cannot say what it will yield is read whole before it is
planned (``WeightSyncSession.update``): ``send`` then returns at once and the session
holds every bucket until the update ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from p2pweights.errors import ConfigError, TransferError
from p2pweights.report import UpdateReport

logger = logging.getLogger(__name__)

__all__ = ["StreamedUpdate"]

Bucket = Sequence[tuple[str, torch.Tensor]]


class _Session(Protocol):
    def update(
        self, named_tensors: Iterator[tuple[str, torch.Tensor]], *, version: str | None = ...
    ) -> UpdateReport: ...


class StreamedUpdate:
    """``session.update(<the buckets>, version=version)`` on a worker thread, started now."""

    def __init__(
        self, session: _Session, *, version: str | None = None, name: str = "p2pweights-update"
    ):
        self._lock = threading.Condition()
        # The bucket handed over and not yet taken whole by the update.
        self._bucket: list[tuple[str, torch.Tensor]] | None = None
        self._closed = False
        self._cancelled: BaseException | None = None
        self._done = False
        self._error: BaseException | None = None
        self._report: UpdateReport | None = None
        # the worker allocates on the caller's GPU (the current device is per thread)
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._thread = threading.Thread(
            target=self._run, args=(session, version, device), name=name, daemon=True
        )
        self._thread.start()

    # -- the trainer's side -------------------------------------------------------------------

    def send(self, bucket: Bucket) -> None:
        """Hand ``bucket`` over; return once the update took all of it. Raises the
        update's error if it failed (before or while taking it)."""
        with self._lock:
            self._raise_if_ended()
            self._bucket = list(bucket)  # our own list: the caller may clear theirs
            self._lock.notify_all()
            self._lock.wait_for(lambda: self._bucket is None or self._done)
            if self._error is not None:
                self._bucket = None
                raise self._error
            if self._bucket is not None:  # ended without an error, bucket not taken
                self._bucket = None
                raise _ended_early()

    def finish(self) -> UpdateReport:
        """End the stream; wait for the update (every rank's collectives) and return its
        report, or raise its error."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report

    def cancel(self, reason: BaseException, *, wait_s: float) -> None:
        """The trainer stops sending (``reason`` is why): the update fails at its next
        read of the stream. Waits up to ``wait_s`` for it to end (with several trainer
        ranks it waits for the others in its collectives); never raises."""
        with self._lock:
            self._cancelled = reason
            self._lock.notify_all()
        self._thread.join(wait_s)
        if self._thread.is_alive():
            logger.warning(
                "p2pweights: the update still runs %.0f s after the trainer stopped sending "
                "(waiting for other trainer ranks?); the session stays busy until it ends",
                wait_s,
            )

    @property
    def running(self) -> bool:
        return not self._done

    def _raise_if_ended(self) -> None:
        if self._error is not None:
            raise self._error
        if self._done:
            raise _ended_early()

    # -- the worker thread --------------------------------------------------------------------

    def _run(self, session: _Session, version: str | None, device: int | None) -> None:
        if device is not None:
            torch.cuda.set_device(device)
        try:
            report = session.update(self._pairs(), version=version)
        except BaseException as exc:  # handed to the trainer's thread, raised there
            with self._lock:
                self._error, self._done = exc, True
                self._lock.notify_all()
            return
        with self._lock:
            self._report, self._done = report, True
            self._lock.notify_all()

    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            with self._lock:
                self._lock.wait_for(
                    lambda: self._bucket is not None or self._closed or self._cancelled is not None
                )
                if self._cancelled is not None:
                    raise TransferError(
                        f"the trainer stopped sending this update's tensors: "
                        f"{type(self._cancelled).__name__}: {self._cancelled}"
                    ) from self._cancelled
                bucket = self._bucket
                if bucket is None:  # closed, every bucket taken
                    return
                if not bucket:
                    self._taken()
                    continue
            last = len(bucket) - 1
            for index, pair in enumerate(bucket):
                if index == last:
                    with self._lock:
                        self._taken()  # the send returns while the update works on it
                yield pair

    def _taken(self) -> None:
        self._bucket = None
        self._lock.notify_all()


def _ended_early() -> ConfigError:
    return ConfigError(
        "the p2pweights update ended before the trainer's last bucket (it read fewer "
        "tensors than were sent); send() must come before finish()"
    )
