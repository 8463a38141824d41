"""The HF tensors of one update: checked against the first update, grouped as the loaders need them.

Parameters that share HF inputs (``qkv_proj`` from q, k and v; a tied embedding and
lm head) form one group, and a group is loaded only when all its inputs arrived. A
tensor is held only until every group that reads it has been loaded.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from p2pweights.errors import ConfigError

if TYPE_CHECKING:
    from p2pweights.source.checkpoint_format import CheckpointFormat


@dataclass(frozen=True)
class InputSpec:
    """What the first update sent under one HF name; later updates must send the same."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ParamGroup:
    """Parameters loaded together, and the HF names they are loaded from."""

    hf_names: frozenset[str]
    param_names: tuple[str, ...]


def describe_inputs(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, InputSpec]:
    """Name -> shape and dtype; rejects duplicate names and non-tensors up front."""
    specs: dict[str, InputSpec] = {}
    for name, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(
                f"HF tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor"
            )
        if name in specs:
            raise ConfigError(f"HF tensor {name!r} was given twice in one update")
        specs[name] = InputSpec(tuple(tensor.shape), tensor.dtype)
    return specs


def check_input(name: str, tensor: torch.Tensor, known: Mapping[str, InputSpec]) -> None:
    """Raise ``ConfigError`` unless ``tensor`` matches what the first update sent as ``name``."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"HF tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    spec = known.get(name)
    if spec is None:
        raise ConfigError(
            f"HF tensor {name!r} was not part of the first update; the HF-name-to-parameter "
            f"mapping is probed once, so every update must send the same names"
        )
    if tensor.dtype != spec.dtype:
        raise ConfigError(
            f"HF tensor {name!r} is {tensor.dtype}, the first update sent {spec.dtype}"
        )
    if tuple(tensor.shape) != spec.shape:
        raise ConfigError(
            f"HF tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the first update sent {spec.shape}"
        )


class GroupCollector:
    """Collects one update's HF tensors and releases each group once its inputs are complete."""

    def __init__(self, groups: Mapping[Hashable, Sequence[ParamGroup]]):
        self._groups = groups
        self._waiting: dict[tuple[Hashable, int], set[str]] = {}
        self._readers: dict[str, list[tuple[Hashable, int]]] = {}
        for key, key_groups in groups.items():
            for index, group in enumerate(key_groups):
                self._waiting[(key, index)] = set(group.hf_names)
                for hf_name in group.hf_names:
                    self._readers.setdefault(hf_name, []).append((key, index))
        self._open_reads = {name: len(readers) for name, readers in self._readers.items()}
        self._held: dict[str, torch.Tensor] = {}
        self._seen: set[str] = set()

    def add(
        self, name: str, tensor: torch.Tensor
    ) -> list[tuple[Hashable, ParamGroup, list[tuple[str, torch.Tensor]]]]:
        """Take one tensor; return the groups it completes, each with all its inputs."""
        if name in self._seen:
            raise ConfigError(f"HF tensor {name!r} was given twice in one update")
        self._seen.add(name)
        readers = self._readers.get(name, [])
        if readers:
            self._held[name] = tensor
        ready = []
        for key, index in readers:
            waiting = self._waiting[(key, index)]
            waiting.discard(name)
            if not waiting:
                group = self._groups[key][index]
                inputs = [(n, self._held[n]) for n in sorted(group.hf_names)]
                ready.append((key, group, inputs))
                for n in group.hf_names:
                    self._open_reads[n] -= 1
                    if self._open_reads[n] == 0:
                        del self._held[n]
        return ready

    def missing(self) -> dict[str, list[str]]:
        """For each incomplete group (by its first parameter): the HF names it still waits for."""
        return {
            self._groups[key][index].param_names[0]: sorted(names)
            for (key, index), names in self._waiting.items()
            if names
        }

    def raise_if_incomplete(self) -> None:
        missing = self.missing()
        if missing:
            lines = [
                f"{param} (needs {', '.join(names)})" for param, names in sorted(missing.items())
            ]
            raise ConfigError(
                "the update ended before every input of these parameters arrived: "
                + "; ".join(lines[:8])
                + (f"; and {len(lines) - 8} more" if len(lines) > 8 else "")
            )


class ConvertingCollector:
    """Group collection for layouts whose loaders read different checkpoint formats.

    Layouts sharing a format share one ``GroupCollector``, and each trainer tensor is
    converted once per format (e.g. quantized to fp8 once for every fp8 rank), right
    before the groups it completes are handed on.
    """

    def __init__(
        self,
        groups: Mapping[Hashable, Sequence[ParamGroup]],
        formats: Mapping[Hashable, CheckpointFormat],
    ):
        by_format: dict[Hashable, dict[Hashable, Sequence[ParamGroup]]] = {}
        converters: dict[Hashable, CheckpointFormat] = {}
        for key, key_groups in groups.items():
            fmt = formats[key]
            by_format.setdefault(fmt.key, {})[key] = key_groups
            converters[fmt.key] = fmt
        self._collectors = [
            (converters[fmt_key], GroupCollector(layouts)) for fmt_key, layouts in by_format.items()
        ]
        self.convert_s = 0.0
        """Seconds spent converting tensors (e.g. fp8 quantization)."""

    def add(
        self, name: str, tensor: torch.Tensor
    ) -> list[tuple[Hashable, ParamGroup, list[tuple[str, torch.Tensor]]]]:
        ready = []
        for fmt, collector in self._collectors:
            if fmt.converts(name):
                started = time.perf_counter()
                converted = fmt.convert(name, tensor)
                self.convert_s += time.perf_counter() - started
            else:
                converted = [(name, tensor)]
            for converted_name, converted_tensor in converted:
                ready += collector.add(converted_name, converted_tensor)
        return ready

    def raise_if_incomplete(self) -> None:
        for _, collector in self._collectors:
            collector.raise_if_incomplete()
