"""One update's trainer tensors -> parameter groups whose inputs are all there.

Parameters that share HF inputs (``qkv_proj`` from q, k and v; a tied embedding and
lm head) form one group, and a group is released only when all its inputs arrived.
A tensor is held only until every group that reads it has been released, so a
streamed update holds little more than the groups being completed, and, per format
that converts in batches, the tensors of one batch (up to 128 of them or 1 GiB: GPU
weights waiting for one fp8 kernel launch).

Layouts whose loaders read different checkpoint formats (a bf16 engine beside an
fp8 one) get one collector per format, and each trainer tensor is converted once
per format (e.g. quantized to fp8 once for every fp8 rank) right before the groups
it completes are released.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from p2pweights.errors import ConfigError

if TYPE_CHECKING:
    from p2pweights.source.checkpoint_format import CheckpointFormat

__all__ = ["GroupCollector", "ConvertingCollector", "Released"]

Released = tuple[Hashable, int, list[tuple[str, torch.Tensor]]]
"""(replica key, group index, the group's inputs in name order)."""


class GroupCollector:
    """Collects one update's HF tensors and releases each group once its inputs are complete."""

    def __init__(self, groups: Mapping[Hashable, Sequence[Iterable[str]]]):
        """``groups[key][index]``: the HF names group ``index`` of replica ``key`` reads."""
        self._names = {
            (key, index): frozenset(names)
            for key, key_groups in groups.items()
            for index, names in enumerate(key_groups)
        }
        self._waiting = {group: set(names) for group, names in self._names.items()}
        self._readers: dict[str, list[tuple[Hashable, int]]] = {}
        for group, names in self._names.items():
            for hf_name in names:
                self._readers.setdefault(hf_name, []).append(group)
        self._open_reads = {name: len(readers) for name, readers in self._readers.items()}
        self._held: dict[str, torch.Tensor] = {}
        self._seen: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> list[Released]:
        """Take one tensor; return the groups it completes, each with all its inputs."""
        if name in self._seen:
            raise ConfigError(f"HF tensor {name!r} was given twice in one update")
        self._seen.add(name)
        readers = self._readers.get(name, [])
        if readers:
            self._held[name] = tensor
        ready: list[Released] = []
        for key, index in readers:
            waiting = self._waiting[(key, index)]
            waiting.discard(name)
            if waiting:
                continue
            names = sorted(self._names[(key, index)])
            ready.append((key, index, [(n, self._held[n]) for n in names]))
            for n in names:
                self._open_reads[n] -= 1
                if self._open_reads[n] == 0:
                    del self._held[n]
        return ready

    def missing(self) -> dict[tuple[Hashable, int], list[str]]:
        """For each incomplete group: the HF names it still waits for."""
        return {group: sorted(names) for group, names in self._waiting.items() if names}


_BATCH_TENSORS = 128
_BATCH_BYTES = 1 << 30
"""A batch of tensors converted together (``CheckpointFormat.batches``) is converted
once it holds this many tensors or bytes, or when the update's tensors end."""


@dataclass
class _Lane:
    """One checkpoint format's conversion and collection, with the tensors held for a batch."""

    fmt: CheckpointFormat
    collector: GroupCollector
    held: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    held_bytes: int = 0


class ConvertingCollector:
    """Group collection per checkpoint format, converting each tensor once per format.

    Tensors a format converts more cheaply in batches (fp8 quantization of GPU weights:
    one kernel launch for a layer's experts) are held until a batch is full, then
    converted together; their groups are released then.
    """

    def __init__(
        self,
        groups: Mapping[Hashable, Sequence[Iterable[str]]],
        formats: Mapping[Hashable, CheckpointFormat],
        *,
        before_read: Callable[[str, torch.Tensor], None] | None = None,
    ):
        """``before_read(name, tensor)`` is called right before a tensor's bytes are
        converted (it may raise: the input changed since it arrived)."""
        self._before_read = before_read
        by_format: dict[Hashable, dict[Hashable, Sequence[Iterable[str]]]] = {}
        converters: dict[Hashable, CheckpointFormat] = {}
        for key, key_groups in groups.items():
            fmt = formats[key]
            by_format.setdefault(fmt.key, {})[key] = key_groups
            converters[fmt.key] = fmt
        self._lanes = [
            _Lane(converters[fmt_key], GroupCollector(layouts))
            for fmt_key, layouts in by_format.items()
        ]
        # Seconds spent converting tensors (e.g. fp8 quantization).
        self.convert_s = 0.0

    def add(self, name: str, tensor: torch.Tensor) -> list[Released]:
        ready: list[Released] = []
        for lane in self._lanes:
            if lane.fmt.batches(name, tensor):
                lane.held.append((name, tensor))
                lane.held_bytes += tensor.numel() * tensor.element_size()
                if len(lane.held) >= _BATCH_TENSORS or lane.held_bytes >= _BATCH_BYTES:
                    ready += self._convert_held(lane)
                continue
            if lane.fmt.converts(name):
                if self._before_read is not None:
                    self._before_read(name, tensor)
                started = time.perf_counter()
                converted = lane.fmt.convert(name, tensor)
                self.convert_s += time.perf_counter() - started
            else:
                converted = [(name, tensor)]
            for converted_name, converted_tensor in converted:
                ready += lane.collector.add(converted_name, converted_tensor)
        return ready

    def flush(self) -> list[Released]:
        """Convert the tensors held for batches: the groups they complete."""
        return [released for lane in self._lanes for released in self._convert_held(lane)]

    def _convert_held(self, lane: _Lane) -> list[Released]:
        held, lane.held, lane.held_bytes = lane.held, [], 0
        if not held:
            return []
        if self._before_read is not None:
            for name, tensor in held:
                self._before_read(name, tensor)
        started = time.perf_counter()
        converted = lane.fmt.convert_many(held)
        self.convert_s += time.perf_counter() - started
        return [r for name, tensor in converted for r in lane.collector.add(name, tensor)]

    def collect(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Released]:
        """Every group of every layout, as the tensors complete them; raises at the end if
        some group never got all its inputs."""
        for name, tensor in tensors:
            yield from self.add(name, tensor)
        yield from self.flush()
        self.raise_if_incomplete()

    def raise_if_incomplete(self) -> None:
        missing = {
            g: names for lane in self._lanes for g, names in lane.collector.missing().items()
        }
        if not missing:
            return
        lines = sorted({f"{', '.join(names)}" for names in missing.values()})
        raise ConfigError(
            f"the update ended before every input of {len(missing)} parameter group(s) arrived; "
            f"missing HF tensors: {'; '.join(lines[:8])}"
            + (f"; and {len(lines) - 8} more" if len(lines) > 8 else "")
        )
