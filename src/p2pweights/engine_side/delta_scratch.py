"""Engine side of delta updates: the scratch region a rank publishes, and applying it.

Each engine rank (the local engine's, or an sglang TP rank with the p2pweights plugin)
publishes, beside its weights and registered with the same transport publisher, a
scratch region under the reserved name ``SCRATCH_NAME``. A sender writing a delta puts
the rank's payload there (``wire.delta``); ``apply_delta`` is a before-end step
(``engine_side.steps.BEFORE_END_STEPS``, ahead of the digest) that applies it to the rank's
parameters right before ``end_weight_update`` re-processes them, so the write check
digests the applied bytes. The scratch region is never a parameter: it is taken out of
what the later steps see.

Its size: ``$P2PWEIGHTS_DELTA_SCRATCH`` (``512MiB``, ``0`` for none), else, in the local
engine, 1/8 of the rank's weight bytes, at most 1 GiB (the sglang plugin takes none
unasked). What does not fit is written in full.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from p2pweights import environment
from p2pweights.config import parse_bytes
from p2pweights.engine_side.before_end import BeforeEnd
from p2pweights.engine_side.delta_apply import DeltaReceiver
from p2pweights.errors import ConfigError
from p2pweights.wire.delta import HEADER_BYTES, SCRATCH_NAME, read_header

logger = logging.getLogger(__name__)

__all__ = ["SCRATCH_NAME", "apply_delta", "clear_payload", "new_scratch", "scratch_bytes"]

_DEFAULT_SHARE = 8
_DEFAULT_CAP_BYTES = 2**30

_receivers: dict[tuple[int, str, int], DeltaReceiver] = {}
"""(engine rank, runner, scratch address) -> that runner's delta state."""


def scratch_bytes(weight_bytes: int, *, by_default: bool = True) -> int:
    """The scratch region's size for a rank holding ``weight_bytes`` of weights; without
    ``P2PWEIGHTS_DELTA_SCRATCH``, none unless ``by_default`` (the sglang plugin: its
    engine's memory is sized before the plugin runs, so it takes none unasked)."""
    given = environment.delta_scratch()
    if given is None:
        if not by_default:
            return 0
        num_bytes = min(weight_bytes // _DEFAULT_SHARE, _DEFAULT_CAP_BYTES) // 16 * 16
        return num_bytes if num_bytes >= HEADER_BYTES else 0  # no header would fit
    try:
        num_bytes = parse_bytes(given) // 16 * 16
    except ValueError as exc:
        raise ConfigError(f"P2PWEIGHTS_DELTA_SCRATCH: {exc}") from exc
    if 0 < num_bytes < HEADER_BYTES:
        raise ConfigError(
            f"P2PWEIGHTS_DELTA_SCRATCH={given!r} gives a {num_bytes}-byte scratch region, too "
            f"small for the {HEADER_BYTES}-byte delta header; set 0 for none, or at least "
            f"{HEADER_BYTES} bytes (deltas that do not fit are written in full)"
        )
    return num_bytes


def new_scratch(
    params: Mapping[str, torch.Tensor], device: torch.device, *, by_default: bool = True
) -> torch.Tensor | None:
    """A zeroed scratch region for a rank publishing ``params`` (None: size 0)."""
    weight_bytes = sum(t.numel() * t.element_size() for t in params.values())
    num_bytes = scratch_bytes(weight_bytes, by_default=by_default)
    if num_bytes == 0:
        return None
    return torch.zeros(num_bytes, dtype=torch.uint8, device=device)


def clear_payload(scratch: torch.Tensor, where: str) -> None:
    """At an update session's begin: a payload in ``scratch`` is an earlier session's that
    was never taken (its end did not run); its header is cleared so no end applies it."""
    if read_header(scratch) is not None:
        logger.warning(
            "p2pweights: %s: a delta payload an earlier update session wrote was never "
            "applied; cleared (its update did not end)",
            where,
        )
        scratch[:HEADER_BYTES].zero_()


def apply_delta(context: BeforeEnd) -> None:
    """Before-end step: apply the payload in the rank's scratch region, if any; the
    steps after this one see the parameters without the scratch region."""
    params = context.params
    scratch = params.get(SCRATCH_NAME)
    if scratch is None:
        return
    weights = {name: t for name, t in params.items() if name != SCRATCH_NAME}
    context.params = weights
    rank, role = context.engine_rank, context.role
    key = (rank, role, scratch.data_ptr())
    receiver = _receivers.get(key)
    if receiver is None:
        receiver = _receivers[key] = DeltaReceiver(f"engine rank {rank} ({role})")
    with torch.no_grad():
        applied = receiver.take(scratch, weights)
    if applied is not None:
        context.record["delta"] = {
            "sequence": applied.sequence,
            "entries": applied.num_entries,
            "elements": applied.num_elements,
            "bytes": applied.payload_bytes,
        }
        logger.debug("engine rank %d (%s): delta applied %s", rank, role, applied)
