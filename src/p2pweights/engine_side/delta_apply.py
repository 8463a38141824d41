"""Engine side: apply one rank's delta payload to its parameters, or refuse it whole.

Every entry is checked before any byte is written (the header's magic and sequence,
each entry's parameter, size and element indices), so a refused payload leaves the
parameters as they were. The checks read each entry's header from the payload (one
host read each) and the extremes of every entry's indices (one host read for all);
the writes are ``index_copy_`` on each parameter's flat view, on its own device.

``DeltaReceiver`` is one engine rank's state: the sequence of the last update it took
whole. A payload of an update already taken, or one changing the bytes of an update
this rank does not hold (``base_sequence``), is refused; a payload without entries
(a full update, from a sender with or without deltas) only records its sequence,
whatever it is (senders' clocks differ; a full update depends on nothing before it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from p2pweights.errors import TransferError
from p2pweights.wire.delta import (
    ALIGN,
    ENTRY_HEADER_BYTES,
    HEADER_BYTES,
    PayloadHeader,
    entry_bytes,
    read_entry_header,
    read_header,
    typed,
)

__all__ = ["AppliedDelta", "DeltaReceiver", "apply"]


@dataclass(frozen=True)
class AppliedDelta:
    """What one payload changed."""

    sequence: int
    num_entries: int
    num_elements: int
    payload_bytes: int


@dataclass(frozen=True)
class _Checked:
    param: str
    elem_size: int
    indices: torch.Tensor
    values: torch.Tensor
    num_elements: int


def apply(
    payload: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    *,
    last_sequence: int = 0,
    where: str = "this engine rank",
) -> AppliedDelta | None:
    """Apply the payload at the start of ``payload`` (flat uint8) to ``params`` (the
    rank's published parameters by name; entries index their sorted names). None where
    no payload is there. Raises ``TransferError`` naming ``where`` and, where it applies,
    the parameter, before writing anything, for a payload of an update already taken
    (``sequence <= last_sequence``), one based on bytes this rank does not hold, or one
    that would write outside a parameter."""
    header = read_header(payload)
    if header is None:
        return None
    _check_header(header, payload, last_sequence, where)
    names = sorted(params)
    checked = [
        _check_entry(payload, offset, entry_header, names, params, where)
        for offset, entry_header in _entry_headers(header, payload, len(names), where)
    ]
    _check_indices(checked, where)
    num_elements = 0
    for entry in checked:
        flat = typed(params[entry.param].detach().view(-1).view(torch.uint8), entry.elem_size)
        device = flat.device
        flat.index_copy_(
            0,
            entry.indices.to(device, torch.int64),
            typed(entry.values.to(device), entry.elem_size),
        )
        num_elements += entry.indices.numel()
    return AppliedDelta(header.sequence, header.num_entries, num_elements, header.payload_bytes)


def _check_header(header: PayloadHeader, payload: torch.Tensor, last: int, where: str) -> None:
    if not HEADER_BYTES <= header.payload_bytes <= payload.numel():
        raise TransferError(
            f"{where}: delta payload of {header.payload_bytes} bytes does not fit the "
            f"{payload.numel()}-byte scratch region; refused"
        )
    if header.num_entries == 0 and header.base_sequence == 0:
        return  # a full update: it changes nothing here, only what the rank holds
    if header.sequence <= last:
        raise TransferError(
            f"{where}: delta payload of update {header.sequence} refused: this rank already "
            f"took update {last}; the sender must write it in full (a new session does)"
        )
    if header.base_sequence and header.base_sequence != last:
        raise TransferError(
            f"{where}: delta payload of update {header.sequence} changes the bytes of update "
            f"{header.base_sequence}, but this rank holds those of update {last or 'none'}; "
            f"refused before any byte was written: the next update must be written in full"
        )


def _entry_headers(
    header: PayloadHeader, payload: torch.Tensor, num_params: int, where: str
) -> list[tuple[int, tuple[int, int, int, int, int]]]:
    """Each entry's offset and header (one host read each: an entry's size locates the
    next). The payload is untrusted: its entry count is bounded first (one entry per
    published parameter, each at least an entry header), and each entry's size is checked
    before it locates the next, so no count or size makes this loop long, walk backwards
    or read outside the payload."""
    fit = (header.payload_bytes - HEADER_BYTES) // ENTRY_HEADER_BYTES
    if header.num_entries > min(num_params, fit):
        raise TransferError(
            f"{where}: delta payload of update {header.sequence} says {header.num_entries} "
            f"entries; its {header.payload_bytes} bytes hold at most {fit} and this rank "
            f"publishes {num_params} parameters; refused before any byte was written"
        )
    found: list[tuple[int, tuple[int, int, int, int, int]]] = []
    offset = HEADER_BYTES
    for number in range(header.num_entries):
        if offset + ENTRY_HEADER_BYTES > header.payload_bytes:
            raise TransferError(
                f"{where}: delta payload of update {header.sequence} ends inside its entry "
                f"{number}; refused"
            )
        entry_header = read_entry_header(payload, offset)
        size = entry_header[4]
        if size < ENTRY_HEADER_BYTES or size % ALIGN or offset + size > header.payload_bytes:
            raise TransferError(
                f"{where}: delta payload of update {header.sequence}: its entry {number} says "
                f"{size} bytes at offset {offset} of {header.payload_bytes} (an entry takes a "
                f"multiple of {ALIGN} bytes, at least {ENTRY_HEADER_BYTES}, inside the "
                f"payload); refused before any byte was written"
            )
        found.append((offset, entry_header))
        offset += size
    if offset != header.payload_bytes:
        raise TransferError(
            f"{where}: delta payload of update {header.sequence} says {header.payload_bytes} "
            f"bytes, its entries take {offset}; refused"
        )
    return found


def _check_entry(
    payload: torch.Tensor,
    offset: int,
    entry_header: tuple[int, int, int, int, int],
    names: list[str],
    params: Mapping[str, torch.Tensor],
    where: str,
) -> _Checked:
    index, elem_size, count, param_bytes, size = entry_header
    if not 0 <= index < len(names):
        raise TransferError(
            f"{where}: delta entry for parameter index {index} of {len(names)}; refused"
        )
    name = names[index]
    param = params[name]
    held = param.numel() * param.element_size()
    problem = None
    if elem_size not in (1, 2, 4, 8) or count < 0 or size != entry_bytes(count, elem_size):
        problem = f"a malformed entry (elem_size {elem_size}, count {count}, {size} bytes)"
    elif param_bytes != held or held % elem_size:
        problem = f"{param_bytes} bytes of elements of {elem_size}, the rank holds {held}"
    elif count > held // elem_size:
        problem = f"{count} changed elements of the parameter's {held // elem_size}"
    elif not param.is_contiguous():
        problem = "a parameter that is not contiguous"
    if problem is not None:
        raise TransferError(f"{where} parameter {name!r}: delta entry refused: {problem}")
    start = offset + ENTRY_HEADER_BYTES
    indices = payload[start : start + 4 * count].view(torch.int32)
    start += -(-4 * count // ALIGN) * ALIGN
    values = payload[start : start + count * elem_size]
    return _Checked(name, elem_size, indices, values, held // elem_size)


def _check_indices(checked: list[_Checked], where: str) -> None:
    """Every entry's indices inside its parameter: each entry's extremes, read in one
    host copy for all entries (not two waits per entry)."""
    ranged = [entry for entry in checked if entry.indices.numel()]
    if not ranged:
        return
    extremes = torch.stack([torch.stack(torch.aminmax(e.indices)) for e in ranged]).cpu()
    for entry, (low, high) in zip(ranged, extremes.tolist(), strict=True):
        if low < 0 or high >= entry.num_elements:
            raise TransferError(
                f"{where} parameter {entry.param!r}: delta entry indexes outside its "
                f"{entry.num_elements} elements; refused before any byte was written"
            )


class DeltaReceiver:
    """One engine rank's delta state: the last update it took, and taking the next."""

    def __init__(self, where: str = "this engine rank") -> None:
        self.where = where
        # The update whose bytes the rank holds as far as deltas know (0: none yet).
        self.sequence = 0

    def take(
        self, payload: torch.Tensor, params: Mapping[str, torch.Tensor]
    ) -> AppliedDelta | None:
        """Apply the payload in ``payload`` (the scratch region) if there is one, then
        clear its magic so it is never taken twice. A refused payload is cleared too, and
        the rank then holds no known update: later deltas are refused until a full one."""
        try:
            applied = apply(payload, params, last_sequence=self.sequence, where=self.where)
        except TransferError:
            self.sequence = 0
            payload[:HEADER_BYTES].zero_()
            raise
        if applied is not None:
            self.sequence = applied.sequence
            payload[:HEADER_BYTES].zero_()
        return applied
