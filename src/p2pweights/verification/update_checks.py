"""One update's write checks on one trainer rank, and what their outcome leaves the engines in.

``UpdateAttempt`` sequences an update and calls these at their places in it; each check
runs inside a collective step (``step``, ``Collective.step``) so that every sending
trainer rank agrees on its outcome:

- ``before_end`` (step ``verify_checker``): after every rank's writes and before any end,
  the ``/weights_checker`` checksums of what this rank wrote into the engines that record
  no write digests, compared with its hashes of the staged bytes (``checker``);
- ``after_end`` (step ``verify_writes``): the records every engine rank took right before
  its end, compared with this rank's digests of the staged bytes (``check``);
- ``settle``: the engines the checks passed become whole and verified;
- ``after_failed_writes``: a lone rank whose writes failed elsewhere ends and checks the
  engines that got every byte, so that only the failed ones stay torn.

The policy on a failure: an engine found wrong stays paused and torn (the next update
rewrites it whole). Only a lone sending rank knows which engines were wrong: with several,
a failure on any rank leaves every engine the failed check covered torn, since no rank
can tell which one another rank found wrong. Only the rank that drives the engines
(``leader``) changes their state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from p2pweights.engines.fleet import Fleet
from p2pweights.verification.check import Mismatch, WriteCheck
from p2pweights.verification.checker import CheckerShare
from p2pweights.wire.publication import Runner

logger = logging.getLogger(__name__)

__all__ = ["Step", "UpdateChecks"]

Step = Callable[[str, Callable[[], None]], None]
"""Runs a named check so that every trainer rank agrees on it (``Collective.step``)."""

LEFT_OPEN = ", their update session still open (abort() ends it)"
"""What a failed check before the end adds to its error: the sessions were not ended."""

Staged = Mapping[Runner, Mapping[str, str]]
"""Runner -> parameter -> this rank's hash of the bytes it staged for it."""


class UpdateChecks:
    """The write checks of one update on one trainer rank."""

    def __init__(
        self,
        write_check: WriteCheck,
        fleet: Fleet,
        marker: str,
        *,
        leader: bool,
        alone: bool,
        weight_check_pending: bool,
    ) -> None:
        self.write_check = write_check
        self.fleet = fleet
        self.marker = marker  # the weight version the engines hold while torn
        self.leader = leader  # this rank drives the engines' update sessions
        self.alone = alone  # the only sending trainer rank: it knows which engines failed
        # a first update the engines' own weight check (``verify_with_weight_checker``)
        # still has to pass: no engine is whole before it did
        self.weight_check_pending = weight_check_pending
        self.wrong: set[str] = set()  # the engines whose digest check failed, or may have

    def before_end(self, staged: Staged, step: Step, share: CheckerShare | None = None) -> None:
        """Every rank compares the ``/weights_checker`` checksums of what it wrote
        (``staged``: its hashes of the staged bytes) after every rank's writes and before
        any end; with ``share`` the ranks ask each engine's checker once between them and
        hand its answer to each other (``checker.check``). An engine found wrong stays
        open, paused and torn (``abort`` ends its session; the next update rewrites it
        whole); a lone rank ends the engines the checker passed, which are then whole."""
        write_check = self.write_check
        found: list[Mismatch] = []

        def check() -> None:
            found.extend(write_check.check_before_end(staged, share))
            WriteCheck.raise_if_wrong(found, left=LEFT_OPEN)

        try:
            step("verify_checker", check)
        except BaseException:
            if self.leader:
                knows = self.alone and bool(found)
                wrong = {m.runner.engine_url for m in found} if knows else set(write_check.checker)
                self.fleet.writes_wrong(wrong)
                if knows and not self.weight_check_pending:
                    self._end_the_verified(set(write_check.checker) - wrong, wrong)
            raise

    def _end_the_verified(self, passed: set[str], wrong: set[str]) -> None:
        """After the checker found some engines wrong (one sending rank: it knows which):
        end the sessions of those whose checksums all agreed, which makes them whole at
        the new version, as a digest check leaves the engines it passed. The others stay
        open and torn; an end that fails leaves its engine unverified."""
        try:
            self.fleet.close_only(passed)
        except Exception:  # each engine's outcome is in its state; the update fails anyway
            logger.warning("p2pweights: ending the engines the checker passed", exc_info=True)
        self.fleet.writes_verified(wrong | set(self.write_check.engines))

    def after_end(self, staged: Callable[[], Staged], step: Step) -> None:
        """Every rank compares the digests its engine ranks took before their end with
        ``staged()`` (its digests of the bytes it staged for them, taken inside the step),
        and all agree. An engine found wrong stays torn (``incomplete``, ``check_failed``);
        where another rank failed, every checked engine does."""
        write_check = self.write_check
        found: list[Mismatch] = []
        self.wrong = set(write_check.engines)  # until the check says which

        def check() -> None:
            found.extend(write_check.check(staged(), self.marker))
            WriteCheck.raise_if_wrong(found)

        try:
            step("verify_writes", check)
        except BaseException:
            if self.leader:
                knows = self.alone and bool(found)
                wrong = {m.runner.engine_url for m in found} if knows else set(write_check.engines)
                # an engine whose end did not answer was not checked: it stays unverified
                wrong -= set(self.fleet.unended())
                self.fleet.writes_wrong(wrong)
                self.wrong = wrong
            raise

    def settle(self, *, failed: bool, all_ended: bool) -> None:
        """After the checks (``failed``: the digest check raised; ``all_ended``: every
        engine's end answered): the engines they passed are whole and verified, those
        found wrong stay torn, and an engine whose end failed stays torn; none is whole
        while the engines' own weight check, which runs only after every end answered,
        is still to come."""
        if not self.leader:
            return
        if failed:
            if not self.weight_check_pending:  # the others passed: whole
                self.fleet.writes_verified(self.wrong)
        elif all_ended or not self.weight_check_pending:
            self.fleet.writes_verified()

    def after_failed_writes(self, digests: Callable[[], Staged] | None) -> None:
        """After a failed write step, on a lone trainer rank (``digests``: its digests of
        what it staged; None if its run never started): end the sessions of the engines
        that received every byte and check their writes, so that they are whole at the
        new version (``abort()`` resumes them) while the failed ones stay torn, as do
        engines verified by their ``/weights_checker``: it can only look before the end,
        which this update never reached for them."""
        fleet, write_check = self.fleet, self.write_check
        whole = [
            e.url for e in fleet.engines if e.update.unverified and e.url not in write_check.checker
        ]
        if digests is None or not whole or self.weight_check_pending:
            return  # a first update's weight check never ran: none is verified whole
        try:
            fleet.close_only(whole)
        except Exception:  # those stay torn (unverified); the write error is the one raised
            logger.warning(
                "p2pweights: ending the engines that got every byte failed", exc_info=True
            )
        wrong: set[str] = set()
        if write_check:
            staged = {r: d for r, d in digests().items() if r.engine_url in whole}
            try:
                found = write_check.check(staged, self.marker)
            except Exception:
                logger.warning(
                    "p2pweights: checking the engines that got every byte failed", exc_info=True
                )
                found = [Mismatch(Runner(url, -1, "target"), "not checked") for url in whole]
            for mismatch in found:
                logger.warning("p2pweights: write verification failed: %s", mismatch)
            wrong = {m.runner.engine_url for m in found}
        fleet.writes_verified(wrong)
