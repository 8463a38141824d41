"""What an engine rank does around its update session, in one place for every engine kind.

The p2pweights sglang plugin (hooks on sglang's ``WeightUpdater`` in every TP rank) and
the local engine (its begin / end handlers) both keep one ``RankSide`` per model
runner and call:

- ``after_begin(scratch)`` once ``begin_weight_update`` ran: returns the record to
  publish for this update session before any byte is written (no digests yet), so a
  record of an earlier session is never read as this one's, and clears a delta payload
  an earlier session left in the rank's scratch region.
- ``before_end(params)`` after the writes, right before ``end_weight_update``
  re-processes the weights (sglang's postprocess may repack or move them): runs
  ``BEFORE_END_STEPS`` in order on the rank's published parameters (name -> the tensor
  the writers wrote) and returns the record to publish.

A step takes the ``BeforeEnd`` context and may change the parameters' bytes (a step
that applies a delta must come before the digest step) or add to ``record``. The
record is JSON: ``{"update": n, "role": ..., "digests": {param: hex} | None,
"error": str | None, ...}``, ``update`` counting this runner's sessions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from p2pweights.engine_side.before_end import BeforeEnd
from p2pweights.engine_side.delta_scratch import apply_delta as apply_payload
from p2pweights.engine_side.delta_scratch import clear_payload
from p2pweights.engine_side.landed import EarlyDigests
from p2pweights.wire.landed import LANDED_NAME

logger = logging.getLogger(__name__)

__all__ = ["BEFORE_END_STEPS", "BeforeEnd", "RankSide", "record_digests"]


def record_digests(context: BeforeEnd) -> None:
    """The digest of every published parameter, as the writes left it (where the engine
    digests at all: it costs time inside its pause)."""
    from p2pweights.wire.digest import SCHEME, digests

    if not context.write_digests:
        return
    started = time.perf_counter()
    # a delta applied at this end changed parameters after they were digested early (a
    # full update's header, which carries no entries, changes none)
    applied = context.record.get("delta")
    early = {} if applied and applied.get("entries") else context.early
    rest = {name: t for name, t in context.params.items() if name not in early}
    with torch.no_grad():
        found = digests(rest)
    context.record["digests"] = {
        name: early[name] if name in early else found[name] for name in context.params
    }
    context.record["digest_scheme"] = SCHEME
    context.record["digest_s"] = time.perf_counter() - started
    context.record["digested_early"] = len(context.params) - len(rest)


def apply_delta(context: BeforeEnd) -> None:
    """A delta payload the sender wrote into the rank's scratch region, applied to the
    parameters (``engine_side.delta_scratch``); later steps see them without the region."""
    apply_payload(context)


BEFORE_END_STEPS: list[Callable[[BeforeEnd], None]] = [apply_delta, record_digests]
"""Run in order by ``RankSide.before_end``; the digest comes last (it sees the final bytes)."""


class RankSide:
    """One engine rank's model runner: its update-session count and before-end steps."""

    def __init__(self, engine_rank: int, role: str = "target", *, write_digests: bool) -> None:
        self.engine_rank = engine_rank
        self.role = role
        self.write_digests = write_digests
        self.update = 0
        self._early: EarlyDigests | None = None

    def after_begin(
        self,
        scratch: torch.Tensor | None = None,
        landed: tuple[torch.Tensor, Mapping[str, torch.Tensor]] | None = None,
    ) -> dict[str, Any]:
        """A new update session opened: the record that replaces the last one's. A delta
        payload still in the rank's ``scratch`` region belongs to no session of this one's
        (an end that failed before clearing it, a header write that landed late): it is
        cleared, never applied over this session's writes (a sender writes its payload
        after the engine's begin). A sender that died leaving the session open is another
        case: the trainer taking over writes its own header (``delta.sender.FullHeaders``)."""
        self.update += 1
        self._stop_early()  # an earlier session's, if its end never came
        if landed is not None and self.write_digests:
            flags, params = landed
            flags.zero_()  # before any write of this session: no earlier flag counts
            self._early = EarlyDigests(params, flags)
        if scratch is not None:
            clear_payload(scratch, f"engine rank {self.engine_rank} ({self.role})")
        return self._record(digests=None, error=None)

    def before_end(self, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Run every before-end step; the record to publish. A step that raises is
        recorded (``error``; no digests) and not raised: the caller is an engine whose
        end must still run, and a writer that reads the record fails the update."""
        stopping = time.perf_counter()
        early = self._stop_early()  # its last read of the flags is inside the end, too
        stop_s = time.perf_counter() - stopping
        params = {name: t for name, t in params.items() if name != LANDED_NAME}
        context = BeforeEnd(
            self.engine_rank,
            self.role,
            params,
            self.update,
            self.write_digests,
            early,
            self._record(),
        )
        try:
            for step in BEFORE_END_STEPS:
                step(context)
        except Exception as exc:
            logger.exception(
                "p2pweights: engine rank %d (%s): a before-end step failed",
                self.engine_rank,
                self.role,
            )
            context.record.update(digests=None, error=f"{type(exc).__name__}: {exc}")
        if "digest_s" in context.record:
            context.record["digest_s"] += stop_s
        return context.record

    def _stop_early(self) -> dict[str, str]:
        """Stop the session's early digests; those taken (none if there were none)."""
        early, self._early = self._early, None
        return {} if early is None else early.finish()

    def _record(self, **fields: Any) -> dict[str, Any]:
        return {"update": self.update, "role": self.role, "digests": None, "error": None, **fields}
