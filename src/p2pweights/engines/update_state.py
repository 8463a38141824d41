"""Each engine's weight-update state, recorded from the answers it actually gave.

sglang's rules (0.5.21 - 0.5.23): ``begin_weight_update`` is refused while a session
is open, ``end_weight_update`` and direct writes belong inside one, and generation
stays paused from ``pause_generation`` to ``continue_generation``. An update drives
every engine through::

    running --pause--> paused --"updating" version + flush (at once), begin--> open
            --writes, end--> closed --(compare)--> version, continue --> running

and a failure can stop it anywhere (with ``pause_mode="caller"`` the caller pauses
before and resumes after; the steps between are the same). So the session never keeps
one flag for all engines: each ``EngineUpdate`` records its own phase from what its
engine answered, and each step acts only where it is needed (open only engines that are
not open, close only those that are). A call that got no answer at all leaves the phase
``UNKNOWN``; the engine is asked (``p2pweights_engine_state`` where served) or
handled by tolerant calls before it is written again.

Within one engine, calls that do not depend on each other's effect run at once
(``_flush_with_marker``); the others wait for the answer before them, for the reasons
written there and in ``finish``. ``pause_began`` and ``paused_s`` time the pause each
update costs: from the pause it made, or from when it began with an engine it found
paused (``pause_made`` says which), never from an earlier update's or session's pause.

Torn weights are made visible. Once an engine is open, its weight version is set to
``p2pweights-updating:<version>`` and stays so until the update completed there
(every write landed, ``end_weight_update`` ran, the check passed); only then does it
get ``<version>`` and resume. An engine whose writes did not all land is never
resumed by p2pweights on its own (``abort(resume_incomplete=True)`` overrides), and
a later session that connects to an engine whose version still says
``p2pweights-updating:`` adopts it as incomplete and rewrites it whole before
resuming it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2pweights.engines.client import EngineClient
from p2pweights.engines.concurrency import at_once
from p2pweights.errors import EngineError, EngineStateError, EngineUnreachable
from p2pweights.wire.sglang_texts import ALREADY_OPEN, NOT_OPEN

logger = logging.getLogger(__name__)

__all__ = ["UPDATING_PREFIX", "Phase", "EngineUpdate", "AbortReport", "updating_version"]

UPDATING_PREFIX = "p2pweights-updating:"
"""An engine's weight version while an update to it has not completed."""

_ALREADY_OPEN = ALREADY_OPEN.text  # sglang's refusal of a second begin_weight_update
_NOT_OPEN = NOT_OPEN.text  # its refusal of end without begin


def updating_version(version: str) -> str:
    """The weight version an engine shows while ``version`` is being written into it."""
    return f"{UPDATING_PREFIX}{version}"


class Phase(enum.Enum):
    RUNNING = "running"
    """Generating (as far as this session knows)."""
    PAUSED = "paused"
    """Generation paused; no update session open."""
    OPEN = "open"
    """Paused inside an update session (begin answered)."""
    CLOSED = "closed"
    """Paused; the update session was ended (end answered)."""
    UNKNOWN = "unknown"
    """A call got no answer: it may or may not have taken effect."""


@dataclass
class EngineUpdate:
    """One engine's update state and the update steps that move it."""

    client: EngineClient
    phase: Phase = Phase.RUNNING
    paused_by_us: bool = False
    """This session (or one it took over from) paused the engine, so it resumes it."""
    incomplete: bool = False
    """Writes went into the engine since its last complete update: its weights may be torn."""
    holds: str | None = None
    """The version its weights are, while they are whole (None: not known)."""
    snapshot_taken: bool = False
    """Its weight checker holds the snapshot the first update is compared with."""
    reset_done: bool = False
    """Its weights were reset to noise for the check (so unwritten ones cannot pass)."""
    shows_updating: bool = False
    """Its weight version says ``p2pweights-updating:`` (set by this session or found)."""
    check_failed: bool = False
    """Its last weight check failed or went unanswered (``incomplete`` is set with it)."""
    unverified: bool = False
    """Every write of the update landed, but its ``end_weight_update`` did not answer or
    its write check has not passed yet: the new bytes are unchecked (``incomplete`` is
    set with it), so it is not resumed on its own (``writes_sent``)."""
    paused_since: float | None = None
    """``clock()`` when its pause answered, or when this session found it paused
    (adopted, or left paused by an earlier failed update); None while running."""
    pause_began: float | None = None
    """``clock()`` the current update's pause counts from: the answer to the pause it made,
    or, where the engine was paused already, when the update began with it (``open``)."""
    pause_made: bool | None = None
    """Whether the last update to ``open`` the engine paused it (False: it was paused
    already; None: no update opened it since ``new_update``)."""
    paused_s: float | None = None
    """Seconds from ``pause_began`` (``paused_since`` for a resume outside an update) to
    the answer of its last resume (None: not resumed since ``new_update``)."""
    caller_pauses: bool = False
    """The last update ran with ``pause_mode="caller"``: the caller pauses and resumes the
    engine, so this session neither pauses nor resumes it (nor aborts to resume it)."""
    end_records: dict[tuple[int, str], dict[str, Any]] = field(default_factory=dict, repr=False)
    """The write-digest records the answer to this update's ``end_weight_update`` carried,
    by (engine rank, runner) (``EngineClient.end_weight_update``; empty where the engine
    sends none, or before the end answered)."""
    last_error: str | None = field(default=None, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    """Monotonic seconds (injectable for tests)."""
    _version: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.client.url

    # -- connect -------------------------------------------------------------------------------

    def adopt(self) -> None:
        """Read the state a previous session may have left the engine in."""
        version = self.client.weight_version()
        self.holds = version or None
        if version.startswith(UPDATING_PREFIX):
            self.incomplete = self.paused_by_us = self.shows_updating = True
            self.holds = None
            logger.warning(
                "engine %s was left mid-update (weight version %r): its weights may be torn; "
                "the next update rewrites it whole before resuming it",
                self.url,
                version,
            )
        reported = self.client.engine_state()
        if reported is not None:
            self._set_reported(reported)
        elif self.incomplete:
            self.phase = Phase.UNKNOWN  # paused, and maybe still open
        if self.phase is not Phase.RUNNING:
            self._note_paused()

    def take_over(self, before: EngineUpdate) -> None:
        """Carry what an earlier connection to the same engine knew (a reconnect): who
        paused it, whether its weights may be torn, the weight check's progress. A state
        the engine reports itself wins over the one remembered."""
        reported = self.phase is not Phase.RUNNING or self.incomplete
        if not reported and before.phase is not Phase.RUNNING:
            self.phase = before.phase
        self.paused_by_us = self.paused_by_us or before.paused_by_us
        self.incomplete = self.incomplete or before.incomplete
        self.shows_updating = self.shows_updating or before.shows_updating
        if not self.incomplete and before.holds is not None:
            self.holds = before.holds
        self.snapshot_taken, self.reset_done = before.snapshot_taken, before.reset_done
        self._version = before._version
        if self.phase is not Phase.RUNNING and before.paused_since is not None:
            # paused since the earlier connection paused it, not since this one saw it
            self.paused_since = min(self.paused_since or before.paused_since, before.paused_since)

    # -- the update steps ----------------------------------------------------------------------

    def new_update(self) -> None:
        """An update begins: forget the last one's pause figures."""
        self.paused_s = self.pause_began = self.pause_made = None

    def open(self, pause_mode: str, version: str, snapshot: bool = False) -> None:
        """Pause (if running), show ``p2pweights-updating:<version>`` until the update
        completes here, optionally snapshot and reset for the weight check (once per
        engine), flush, begin.

        The version says "updating" before anything changes the weights or opens a
        session, so an engine a failure leaves open or reset always shows it.
        """
        began = self.clock()
        self._probe_if_unknown()
        self.caller_pauses = pause_mode == "caller"
        self.pause_made = not self.caller_pauses and self.phase in (Phase.RUNNING, Phase.UNKNOWN)
        if self.caller_pauses:  # the fleet checked that the caller paused it
            self.pause_began = began
        elif self.pause_made:
            self._pause(pause_mode)
        else:  # paused by an earlier update or session: this update's pause starts now
            self.pause_began = began
        self._version = version
        self.shows_updating = True  # even if the answer is lost, it may show it
        # sglang refuses to flush while requests run, as they do after an in_place pause
        flush = self.phase is not Phase.OPEN and pause_mode != "in_place"
        self._flush_with_marker(version, flush)
        if snapshot and not self.snapshot_taken:
            self._call(lambda c: c.weights_checker("snapshot"))
            self.snapshot_taken = True
        if snapshot and not self.reset_done:
            self._reset_for_check()
        if self.phase is not Phase.OPEN:
            self._begin()

    def mark_written(self) -> None:
        """Writes are about to go into the engine: its weights are torn until they all land."""
        self.incomplete = True
        self.unverified = False

    def writes_sent(self) -> None:
        """Every write of this update landed; the weights stay torn until the engine's end
        answered and its writes passed the write check (``writes_landed``)."""
        if self.incomplete:
            self.unverified = True

    def writes_landed(self) -> None:
        """This update's writes landed, its end answered and its write check (where the
        engine is checked) passed: the weights are whole again (until a weight check
        says otherwise)."""
        self.incomplete = self.check_failed = self.unverified = False
        self.holds = self._version

    def close(self) -> None:
        """End the update session (the engine re-derives and re-lays its weights)."""
        self._probe_if_unknown()
        if self.phase in (Phase.OPEN, Phase.UNKNOWN):
            self._end()

    def compare(self) -> None:
        """The engine's own weight check against the snapshot its first update took.

        A check that failed, or whose answer never came, leaves the weights torn: the
        engine is not resumed on its own until a later update's check passes."""
        try:
            self._call(lambda c: c.weights_checker("compare"))
        except EngineError:
            self.incomplete = self.check_failed = True
            raise
        self.check_failed = False

    def writes_wrong(self) -> None:
        """The engine's digests of this update's writes disagreed with what was staged
        (or could not be read): torn, and not resumed on its own until an update passes."""
        self.incomplete = self.check_failed = True
        self.unverified = False

    def finish(self, version: str) -> None:
        """Show the new version and resume generation (the weights are whole).

        One after the other, not at once: sglang tags every token with the weight
        version current when it was generated (``record_weight_version_change``), so a
        resume that overtook the version would tag tokens of the new weights
        ``p2pweights-updating:``; and a version that failed while the resume went
        through would leave whole weights serving under it."""
        if self.incomplete:
            raise EngineStateError(
                f"engine {self.url}: not resumed, its writes did not all land (internal error: "
                "finish() before a complete close())"
            )
        self._call(lambda c: c.update_weight_version(version))
        self.holds, self.shows_updating = version, False
        if self.caller_pauses:  # the caller resumes it
            self.phase = Phase.RUNNING
            return
        self._resume()

    def abort(self, resume_incomplete: bool = False) -> str:
        """End an open update session and resume the engine if this session paused it.

        An engine whose writes did not all land stays paused (its weight version says
        ``p2pweights-updating:``) unless ``resume_incomplete``. Returns what happened.
        """
        self._probe_if_unknown()
        if self.phase in (Phase.OPEN, Phase.UNKNOWN):
            self._end()
        if self.shows_updating and not self.incomplete and self.holds is not None:
            # whole weights: show what they are (the old version if nothing was written)
            holds = self.holds
            self._call(lambda c: c.update_weight_version(holds))
            self.shows_updating = False
        if self.caller_pauses:
            if self.incomplete:  # the caller resumes it: say it must not
                return (
                    f"left paused by the caller: {self._why_torn()}; it must not be resumed "
                    "before an update to it completes (pause_mode caller)"
                )
            return "left as the caller paused it, for the caller to resume (pause_mode caller)"
        if not self.paused_by_us:
            return "left as it was (not paused by this session)"
        if self.incomplete and not resume_incomplete:
            return f"left paused: {self._why_torn()}"
        self._resume()
        if self.incomplete:
            return "resumed with incomplete weights"
        return f"resumed (weight version {self.holds})"

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, action: Callable[[EngineClient], object]) -> None:
        """Run one call; a call without an answer leaves the engine's state unknown."""
        try:
            action(self.client)
        except EngineUnreachable as exc:
            self.phase = Phase.UNKNOWN
            self.last_error = str(exc)
            raise
        except EngineError as exc:
            self.last_error = str(exc)
            raise

    def _pause(self, pause_mode: str) -> None:
        self.paused_by_us = True  # even if the answer is lost: resuming is then ours
        try:
            self._call(lambda c: c.pause_generation(pause_mode))
        except EngineUnreachable:
            self._note_paused()  # it may have paused: from here on, as far as we can tell
            self.pause_began = self.clock()
            raise
        self._note_paused()
        self.pause_began = self.clock()
        if self.phase is Phase.RUNNING:
            self.phase = Phase.PAUSED

    def _flush_with_marker(self, version: str, flush: bool) -> None:
        """Show ``p2pweights-updating:<version>`` and, with ``flush``, flush the cache, at once.

        What may overlap, from sglang 0.5.23's own code: neither call changes a weight
        or opens a session, and neither depends on the other (the version is a label
        the scheduler records, ``flush_cache`` drops the radix cache the old weights
        filled; the tokenizer manager sends each through its own communicator). A
        failure of either leaves the engine paused and not open, as it did when they
        ran one after the other; a flush that went through beside a failed marker only
        dropped a cache. What may not: the marker waits for the pause (tokens generated
        before it must keep the old version) and ``begin`` waits for the marker (an
        open engine always shows "updating"). ``begin_weight_update`` and
        ``end_weight_update`` do not flush (they only restore and re-process the
        weights), so the flush is still needed.
        """
        marker = updating_version(version)

        def mark() -> None:
            self._call(lambda c: c.update_weight_version(marker))

        if flush:
            at_once(mark, lambda: self._call(lambda c: c.flush_cache()))
        else:
            mark()

    def _why_torn(self) -> str:
        if self.check_failed:
            return (
                "its write check or weight check failed or went unanswered (weights may be wrong)"
            )
        if self.unverified:
            return (
                "its end_weight_update did not answer or its write check did not complete, "
                "so its new bytes were not verified (weights may be wrong)"
            )
        return "its writes did not all land (weights may be torn)"

    def check_paused_by_caller(self) -> None:
        """Refuse an engine that says it is generating (engines that do not report their
        state are trusted to be paused); ``Fleet.open`` asks every engine before any
        changes."""
        reported = self.client.engine_state()
        if reported is not None and not reported["paused"]:
            raise EngineStateError(
                f"engine {self.url} is generating: pause_mode='caller' leaves the pause to the "
                "caller, which has not paused it; pause it before update() (sglang's "
                "/pause_generation) or let p2pweights pause it (another pause_mode)"
            )

    def _note_paused(self) -> None:
        if self.paused_since is None:
            self.paused_since = self.clock()

    def _reset_for_check(self) -> None:
        """reset_tensors overwrites every weight with noise: torn until rewritten, unless
        the engine answered that it did not reset."""
        was_incomplete, self.incomplete = self.incomplete, True
        try:
            self._call(lambda c: c.weights_checker("reset_tensors"))
        except EngineUnreachable:
            raise
        except EngineError:
            self.incomplete = was_incomplete
            raise
        self.reset_done = True

    def _begin(self) -> None:
        self.end_records = {}  # a record from before this session is never this one's
        try:
            self._call(lambda c: c.begin_weight_update("all"))
        except EngineError as exc:
            if _ALREADY_OPEN not in str(exc):
                raise
            # Open already: our earlier begin whose answer was lost, or a session someone
            # (a trainer that died before marking it) left open. Its weights may be torn.
            if self.phase is not Phase.UNKNOWN:
                self.incomplete = True
        self.phase = Phase.OPEN

    def _end(self) -> None:
        self.end_records = {}  # only this end's answer is ever compared

        def end(client: EngineClient) -> None:
            self.end_records = client.end_weight_update()

        try:
            self._call(end)
        except EngineError as exc:
            if _NOT_OPEN not in str(exc):
                raise  # closed already: our earlier end whose answer was lost
        self.phase = Phase.CLOSED

    def _resume(self) -> None:
        self._call(lambda c: c.continue_generation())
        began = self.pause_began if self.pause_began is not None else self.paused_since
        if began is not None:
            self.paused_s = self.clock() - began
        self.paused_since = self.pause_began = None
        self.phase = Phase.RUNNING
        self.paused_by_us = False

    def _probe_if_unknown(self) -> None:
        """Ask an engine in an unknown state what it is doing, where it can say."""
        if self.phase is not Phase.UNKNOWN:
            return
        reported = self.client.engine_state()  # raises EngineUnreachable if still silent
        if reported is not None:
            self._set_reported(reported)

    def _set_reported(self, reported: dict[str, bool]) -> None:
        if reported["update_open"]:
            self.phase = Phase.OPEN
        elif reported["paused"]:
            self.phase = Phase.CLOSED if self.incomplete else Phase.PAUSED
        else:
            self.phase = Phase.RUNNING
            self.paused_since = None


@dataclass
class AbortReport:
    """What ``WeightSyncSession.abort`` did to each engine."""

    outcomes: dict[str, str] = field(default_factory=dict)
    """Engine URL -> "resumed", "left paused: ...", "left paused by the caller: ..." (torn,
    with ``pause_mode="caller"``), "left as ..." or "unreachable: ..."."""

    @property
    def left_paused(self) -> list[str]:
        """URLs of the engines not running again (paused, torn or unreachable)."""
        return [
            url
            for url, what in self.outcomes.items()
            if not what.startswith(("resumed", "left as"))
        ]

    @property
    def ok(self) -> bool:
        """Every engine this session paused runs again, and none the caller paused
        (``pause_mode="caller"``) is left with torn weights."""
        return not self.left_paused

    def raise_if_not_ok(self) -> None:
        """Raise where ``ok`` is False.

        Raises:
            EngineStateError: Naming each engine left paused and what was found.
        """
        if not self.ok:
            raise EngineStateError(
                "engines not resumed: "
                + "; ".join(f"{url}: {self.outcomes[url]}" for url in self.left_paused)
            )

    def __str__(self) -> str:
        return "; ".join(f"{url}: {what}" for url, what in self.outcomes.items()) or "no engines"
