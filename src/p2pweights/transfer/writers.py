"""One writer thread per engine: a stuck engine delays only its own writes.

A ``WriteBatch`` is what one flush sends one engine rank: (source, destination,
length) triples plus the parameter each write carries, so a failure names it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from p2pweights.engines.published import RankPublication
from p2pweights.errors import TransferError
from p2pweights.transfer.transports.base import Transport, Write

_MAX_NAMED = 4


@dataclass
class WriteBatch:
    target: RankPublication
    writes: list[Write] = field(default_factory=list)
    params: list[str] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return sum(w.num_bytes for w in self.writes)

    def add(self, write: Write, param: str) -> None:
        self.writes.append(write)
        self.params.append(param)

    def describe(self) -> str:
        """``engine URL rank R parameters a, b, ... (+N more)`` for error messages."""
        names = ", ".join(self.params[:_MAX_NAMED])
        more = len(self.params) - _MAX_NAMED
        suffix = f" (+{more} more)" if more > 0 else ""
        return f"{self.target.where} parameters {names}{suffix}"


class EngineWriter:
    """Runs one engine's write batches in order on its own thread."""

    def __init__(self, engine_url: str, transport: Transport, timeout_s: float):
        self.engine_url = engine_url
        self._transport = transport
        self._timeout_s = timeout_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"p2pw-writer-{engine_url}")

    def submit(self, batch: WriteBatch) -> Future[None]:
        return self._thread.submit(self._run, batch)

    def _run(self, batch: WriteBatch) -> None:
        try:
            self._transport.write(batch.target, batch.writes, self._timeout_s)
        except TransferError as exc:
            raise TransferError(f"write to {batch.describe()} failed: {exc}") from exc
        except Exception as exc:  # a transport bug must still fail the update, named
            raise TransferError(f"write to {batch.describe()} failed: {exc!r}") from exc

    def close(self) -> None:
        """Cancel queued batches and wait for the running one; transports bound it by
        ``timeout_s``, so memory is never deregistered under a running write."""
        self._thread.shutdown(wait=True, cancel_futures=True)
