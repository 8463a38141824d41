"""What the rest of the library needs from a replica of one engine rank.

A replica knows how one engine rank lays out its parameters and can produce their
bytes from the trainer's HF tensors. The sglang replica (``replica.sglang``) builds
the rank's own sglang model on meta and runs its loaders; another engine could
provide its own ``Replica`` without touching planning, staging or transfer code.
No sglang import here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from p2pweights.source.checkpoint_format import CheckpointFormat
    from p2pweights.source.fp8_regions import Read
    from p2pweights.source.inputs import InputSpec, ParamGroup

__all__ = ["ParamLayout", "Replica", "bytes_spanned", "merged"]


@dataclass(frozen=True)
class ParamLayout:
    """How one engine parameter lies in the engine's memory while an update is open."""

    name: str
    """The engine's parameter name, as the engine publishes it."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    num_bytes: int
    """Bytes from the first element to the end of the last one (``bytes_spanned``)."""


def bytes_spanned(shape: Sequence[int], stride: Sequence[int], element_size: int) -> int:
    """Bytes a tensor spans from its first element, holes included; 0 if it is empty."""
    if any(size == 0 for size in shape):
        return 0
    last = sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    return (last + 1) * element_size


def merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted ranges with overlapping or touching ones joined; empty ones dropped."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)


class Replica(Protocol):
    """One engine rank's parameter layout and the loader that fills it.

    Inputs are the trainer's HF (checkpoint-named) tensors, described by name ->
    ``InputSpec`` before the first update and given as ``(name, tensor)`` pairs
    when staging.
    """

    @property
    def layouts(self) -> Mapping[str, ParamLayout]:
        """Every parameter of the rank, in the engine's order."""
        ...

    @property
    def optional_params(self) -> frozenset[str]:
        """Parameters an update need not feed and the engine need not publish."""
        ...

    def checkpoint_format(self, inputs: Mapping[str, InputSpec]) -> CheckpointFormat:
        """How this rank's loader wants the trainer's tensors (e.g. quantized to fp8)."""
        ...

    def feeds(self, inputs: Mapping[str, InputSpec]) -> Mapping[str, frozenset[str]]:
        """Per input (checkpoint format), the parameters its loader writes."""
        ...

    def groups(self, inputs: Mapping[str, InputSpec]) -> list[ParamGroup]:
        """Parameters loaded together and the HF names they come from.

        ``inputs`` are in the checkpoint format (``checkpoint_format(...).engine_specs``).
        Raises ``ConfigError`` if a non-optional parameter is fed by none of them.
        """
        ...

    def written_spans(
        self, inputs: Mapping[str, InputSpec]
    ) -> dict[str, tuple[tuple[int, int], ...]]:
        """Per parameter, the ``[start, end)`` byte ranges loading ``inputs`` alone
        writes (sorted, merged): what an owner of only these inputs writes."""
        ...

    def load_into(
        self, inputs: Sequence[tuple[str, torch.Tensor]], views: Mapping[str, torch.Tensor]
    ) -> None:
        """Write the bytes of whole groups fed by ``inputs`` into ``views``.

        ``views`` maps parameter names to flat ``torch.uint8`` tensors of exactly
        ``layouts[name].num_bytes``.
        """
        ...

    def input_reads(self) -> Mapping[str, list[Read] | None]:
        """Per loader input loaded so far, the views (element offset, shape, stride) its
        loads' checked recordings read of it; None while a load of it runs the loader."""
        ...

    @property
    def replays_changed(self) -> int:
        """A count that moves whenever the recordings behind ``input_reads`` change."""
        ...
