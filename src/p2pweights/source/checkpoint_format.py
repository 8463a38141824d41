"""The engine's checkpoint format, and turning the trainer's tensors into it.

An engine's loaders read tensors in the format of the checkpoint it was started
from. A trainer sends what it holds: for a bf16 engine the same thing, for an fp8
block-quantized engine bf16 weights where the checkpoint has an fp8 weight plus its
``_scale_inv``. Each replica handle answers with one of:

* ``AS_GIVEN``: the loaders read the trainer's tensors unchanged;
* ``QuantizeToBlockFp8``: the named weights are quantized on the sender, on each
  tensor's own device, into the engine's block size and scale format, before the
  loaders run (so the loaders see exactly what they read from the checkpoint).

A format is chosen once, at the first update: a weight is quantized when the
engine's own loader writes it into fp8 parameters only, as the probe of that
rank's replica shows, and the trainer did not send it quantized already.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from p2pweights.errors import ConfigError
from p2pweights.source import fp8_fused
from p2pweights.source.fp8_block import (
    FP8,
    SCALE_SUFFIX,
    BlockFp8Format,
    Box,
    quantize,
    quantize_many,
)
from p2pweights.source.inputs import InputSpec

__all__ = ["CheckpointFormat", "AS_GIVEN", "AsGiven", "QuantizeToBlockFp8", "unify"]

Named = list[tuple[str, torch.Tensor]]
K = TypeVar("K", bound=Hashable)


class CheckpointFormat(Protocol):
    """How one layout's loaders want the trainer's tensors."""

    @property
    def key(self) -> Hashable:
        """Equal for formats that convert every tensor the same way."""

    def engine_specs(self, specs: Mapping[str, InputSpec]) -> dict[str, InputSpec]:
        """What the loaders receive for the trainer's ``specs``."""

    def converts(self, name: str) -> bool:
        """Whether ``convert`` changes this trainer tensor (else it passes unchanged)."""

    def convert(self, name: str, tensor: torch.Tensor) -> Named:
        """The loader inputs for one trainer tensor."""

    def batches(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether converting this tensor together with others (``convert_many``) is
        cheaper than alone, so it is worth holding until a batch is full."""

    def convert_many(self, named: Sequence[tuple[str, torch.Tensor]]) -> Named:
        """The loader inputs for several trainer tensors, the same as ``convert`` of each."""


@dataclass(frozen=True)
class AsGiven:
    """The loaders read the trainer's tensors unchanged."""

    @property
    def key(self) -> Hashable:
        return "as-given"

    def engine_specs(self, specs: Mapping[str, InputSpec]) -> dict[str, InputSpec]:
        return dict(specs)

    def converts(self, name: str) -> bool:
        return False

    def convert(self, name: str, tensor: torch.Tensor) -> Named:
        return [(name, tensor)]

    def batches(self, name: str, tensor: torch.Tensor) -> bool:
        return False

    def convert_many(self, named: Sequence[tuple[str, torch.Tensor]]) -> Named:
        return list(named)


AS_GIVEN = AsGiven()


@dataclass(frozen=True)
class QuantizeToBlockFp8:
    """Quantize ``names`` into ``fmt`` (weight + ``_scale_inv``); others pass unchanged."""

    fmt: BlockFp8Format
    names: frozenset[str]
    kept: frozenset[str] = frozenset()
    """Names this layout's loader reads in high precision (they must not be quantized)."""
    regions: Mapping[str, Box] = field(default_factory=dict, compare=False)
    """Per name, the only blocks quantized (``fp8_regions``: all that this sender's
    loaders read, learned from their recorded copies); the others are left unset."""

    @property
    def key(self) -> Hashable:
        return ("block-fp8", self.fmt, self.names)

    def engine_specs(self, specs: Mapping[str, InputSpec]) -> dict[str, InputSpec]:
        out: dict[str, InputSpec] = {}
        for name, spec in specs.items():
            if name not in self.names:
                out[name] = spec
                continue
            out[name] = InputSpec(spec.shape, FP8)
            out[name + SCALE_SUFFIX] = InputSpec(self.fmt.scale_shape(spec.shape), torch.float32)
        return out

    def converts(self, name: str) -> bool:
        return name in self.names

    def convert(self, name: str, tensor: torch.Tensor) -> Named:
        if name not in self.names:
            return [(name, tensor)]
        with torch.no_grad():
            weight, scale_inv = quantize(tensor, self.fmt, self.regions.get(name))
        return [(name, weight), (name + SCALE_SUFFIX, scale_inv)]

    def batches(self, name: str, tensor: torch.Tensor) -> bool:
        return name in self.names and fp8_fused.available(tensor, self.fmt.block)

    def convert_many(self, named: Sequence[tuple[str, torch.Tensor]]) -> Named:
        ours = [(name, tensor) for name, tensor in named if name in self.names]
        with torch.no_grad():
            pairs = quantize_many(
                [tensor for _, tensor in ours],
                self.fmt,
                [self.regions.get(name) for name, _ in ours],
            )
        out: Named = [(name, tensor) for name, tensor in named if name not in self.names]
        for (name, _), (weight, scale_inv) in zip(ours, pairs, strict=True):
            out += [(name, weight), (name + SCALE_SUFFIX, scale_inv)]
        return out

    @classmethod
    def choose(
        cls,
        fmt: BlockFp8Format,
        specs: Mapping[str, InputSpec],
        feeds: Mapping[str, frozenset[str]],
        param_dtypes: Mapping[str, torch.dtype],
    ) -> QuantizeToBlockFp8:
        """Quantize the high-precision inputs whose loader writes fp8 parameters only.

        ``feeds`` is the probe of the trainer's names (name -> parameters it writes);
        ``param_dtypes`` the replica's parameter dtypes. An input that writes fp8 and
        non-fp8 parameters at once cannot be converted one way, and is refused.
        """
        names, kept = set(), set()
        for name, spec in specs.items():
            fed = feeds.get(name, frozenset())
            fp8 = {param for param in fed if param_dtypes[param] == FP8}
            if not fp8 or spec.dtype == FP8:
                if fed:
                    kept.add(name)
                continue
            if fp8 != fed:
                raise ConfigError(
                    f"HF tensor {name!r} feeds fp8 parameters {sorted(fp8)} and others "
                    f"{sorted(fed - fp8)}; p2pweights cannot quantize it for this engine"
                )
            if name + SCALE_SUFFIX in specs:
                raise ConfigError(
                    f"HF tensor {name!r} comes with {name + SCALE_SUFFIX!r} but is "
                    f"{spec.dtype}; send both quantized or send the weight alone"
                )
            if not spec.dtype.is_floating_point:
                raise ConfigError(f"HF tensor {name!r} is {spec.dtype}; expected a float weight")
            names.add(name)
        return cls(fmt, frozenset(names), frozenset(kept))


def unify(formats: Mapping[K, CheckpointFormat]) -> dict[K, CheckpointFormat]:
    """One conversion per block format across layouts, so each tensor is quantized once.

    A rank quantizes only what its own loader reads (an EP rank reads its own
    experts); the union covers every rank, and a rank's loader skips the names it
    does not read, quantized or not. A name one layout reads in fp8 and another in
    high precision under the same format is refused.
    """
    merged: dict[BlockFp8Format, QuantizeToBlockFp8] = {}
    for fmt in formats.values():
        if isinstance(fmt, QuantizeToBlockFp8):
            seen = merged.get(fmt.fmt)
            names = fmt.names | (seen.names if seen else frozenset())
            kept = fmt.kept | (seen.kept if seen else frozenset())
            merged[fmt.fmt] = QuantizeToBlockFp8(fmt.fmt, names, kept)
    for fmt in merged.values():
        both = sorted(fmt.names & fmt.kept)
        if both:
            raise ConfigError(
                f"engines of one fp8 format read {both[:4]} in fp8 on some ranks and in high "
                "precision on others; p2pweights cannot convert them one way"
            )
    return {
        key: merged[fmt.fmt] if isinstance(fmt, QuantizeToBlockFp8) else fmt
        for key, fmt in formats.items()
    }
