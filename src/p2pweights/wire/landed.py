"""Which parameters' writes have landed: a flag per parameter an engine rank publishes.

With ``SyncConfig.digest_as_written`` the engine ranks digest each parameter as soon as
its writes landed, while the others are still being written, so only the last flush's
parameters are digested inside ``end_weight_update``. The sender tells a rank which
parameters landed through a region the rank publishes beside its weights, under
``LANDED_NAME``: one byte per parameter, in the sorted order of the rank's published
parameter names (``flag_names``), zeroed by the rank when an update session opens. Once
every write of a parameter into the rank has completed, the sender writes ``1`` into its
byte (never ``0``: several trainer ranks may write one engine rank, each flagging only
its own parameters). The rank reads the flags while its session is open and digests each
parameter once it is flagged (``engine_side.landed``).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["LANDED_NAME", "flag_bytes", "flag_names"]

LANDED_NAME = "__p2pweights_landed__"
"""The name an engine rank publishes its flags under (never a parameter's)."""

_SPECIAL = "__p2pweights_"
"""Published regions that are not parameters start with this (the flags, the delta
scratch region)."""


def flag_names(published: Iterable[str]) -> list[str]:
    """The parameters a rank flags, in flag order: its published names, sorted, without
    the regions that are not parameters."""
    return sorted(name for name in published if not name.startswith(_SPECIAL))


def flag_bytes(num_params: int) -> int:
    """Bytes of the flags region for ``num_params`` parameters (whole 64-byte lines)."""
    return max(64, -(-num_params // 64) * 64)
