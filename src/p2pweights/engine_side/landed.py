"""An engine rank digests each parameter once the sender says its writes landed.

``RankSide.after_begin`` zeroes the rank's flags region (``wire.landed``) and starts an
``EarlyDigests`` thread; it polls the flags while the update session is open and digests
every newly flagged parameter (``wire.digest.digests``, on the parameter's device),
while the sender's other writes still arrive. ``RankSide.before_end`` stops it: the
parameters it digested need no read inside ``end_weight_update``, only the rest do
(those of the last flush, and every parameter of a sender that flags nothing).

What a digest taken early cannot see: bytes a parameter gets after its flag and before
the end (a write that lands late, or memory changed behind the writes). A delta applied
at the end changes parameters after their flags, so a rank that applies one digests
everything again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import torch

from p2pweights.wire.landed import flag_names

logger = logging.getLogger(__name__)

__all__ = ["EarlyDigests"]

POLL_S = 0.001
"""How often the flags are read while none is new."""


class EarlyDigests:
    """A thread digesting the flagged parameters of one update session."""

    def __init__(self, params: Mapping[str, torch.Tensor], flags: torch.Tensor) -> None:
        self._names = flag_names(params)
        self._params = {name: params[name] for name in self._names}
        self._flags = flags
        self.found: dict[str, str] = {}
        self.error: str | None = None
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="p2pweights-early-digests", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        from p2pweights.wire.digest import digests

        done = torch.zeros(len(self._names), dtype=torch.bool)
        try:
            with torch.no_grad():
                while True:
                    stopping = self._stop.is_set()  # one last read after the stop
                    flagged = self._flags[: len(self._names)].cpu() != 0
                    new = (flagged & ~done).nonzero().flatten().tolist()
                    if new:
                        started = time.perf_counter()
                        batch = {self._names[i]: self._params[self._names[i]] for i in new}
                        self.found.update(digests(batch))
                        self.seconds += time.perf_counter() - started
                        done[new] = True
                        if bool(done.all()):  # every parameter digested: nothing to wait for
                            return
                    elif stopping:
                        return
                    else:
                        self._stop.wait(POLL_S)
        except Exception as exc:  # the end digests everything instead
            logger.exception("p2pweights: digests taken as writes landed failed")
            self.error = f"{type(exc).__name__}: {exc}"

    def finish(self) -> dict[str, str]:
        """Stop (after one last read of the flags); the digests taken, by parameter
        (none if the thread failed)."""
        self._stop.set()
        self._thread.join()
        return {} if self.error is not None else self.found
