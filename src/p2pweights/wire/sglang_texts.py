"""The texts of sglang's answers and errors that p2pweights matches on.

sglang states some outcomes only in words: a second ``begin_weight_update`` is refused
with a message, not a code. p2pweights recognises those by a piece of the text, so a
release that rewords one would silently change what p2pweights does. Each text is
kept here with the sglang function that emits it; ``compat.check_sglang`` (and so
``p2pweights doctor``) finds each in the installed sglang's source of that function
and names the ones it no longer finds.

This module imports no sglang: the engine client uses the texts without it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SglangText", "ALREADY_OPEN", "NOT_OPEN", "REDACTED", "TEXTS"]


@dataclass(frozen=True)
class SglangText:
    """A piece of text sglang's ``module.function`` emits, which p2pweights matches on."""

    text: str
    module: str
    function: str
    """A dotted path inside ``module`` (``Class.method`` for a method)."""
    used_by: str
    """Where p2pweights matches on it, for the error message."""

    def __str__(self) -> str:
        return f"{self.text!r} of {self.module}.{self.function}"


_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"

ALREADY_OPEN = SglangText(
    "already open",
    _UPDATER,
    "SchedulerWeightUpdaterManager.begin_weight_update",
    "engines.update_state (a begin_weight_update answered for a session left open)",
)
NOT_OPEN = SglangText(
    "no weight-update session is open",
    _UPDATER,
    "SchedulerWeightUpdaterManager.end_weight_update",
    "engines.update_state (an end_weight_update answered for a session already closed)",
)
REDACTED = SglangText(
    "<redacted>",
    "sglang.srt.sampling.watermarking.core",
    "redact_watermark_secrets",
    "replica.sglang.env (secrets left out of an engine's /server_info)",
)

TEXTS: tuple[SglangText, ...] = (ALREADY_OPEN, NOT_OPEN, REDACTED)
"""Every sglang text p2pweights matches on."""
