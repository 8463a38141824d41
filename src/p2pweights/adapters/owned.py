"""Owned inputs: the HF tensors a trainer rank holds alone, declared to ``update()``.

Under expert parallelism a rank holds its own experts only. It hands ``update()`` what
it holds, wrapped with ``owned_tensors(pairs, owned=names)``: ``owned`` names the tensors
no other rank sends (its experts); the others are replicated, sent whole by every rank
of its pipeline stage. The wrapper is an iterator that also says what it will yield
(``specs()``) and what it owns (``owned()``); the session gathers every rank's claim at
the first update (``plan.owners``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from p2pweights.errors import ConfigError

__all__ = ["OwnedTensors", "Shard", "owned_names", "owned_tensors", "shard_ranges"]


Shard = tuple[int, int, int]
"""(dim, start, full size): a rank's slice ``[start, start + its size)`` along ``dim`` of a
tensor of ``full size`` there (``Shard(0)`` / ``Shard(1)`` of FSDP2 or torch TP)."""


class OwnedTensors(Iterator[tuple[str, torch.Tensor]]):
    """(HF name, tensor) pairs, with the names this rank owns (``owned()``) and the slices
    it holds of sharded ones (``shards()``).

    A slice is yielded as it is held, not in its tensor's full shape: only the session,
    which reads ``shards()``, asks for full tensors (``whole_tensors()``: each slice at its
    place, zero elsewhere, as the loaders take them). So a plain generator wrapped around
    this (a filter, a rename), which drops what says the tensors are slices, hands the
    session tensors of the wrong shape, refused before any byte, instead of full-shaped
    ones that would be written as if every rank held them whole."""

    def __init__(
        self,
        named_tensors: Any,
        owned: Iterable[str],
        shards: Mapping[str, Shard] | None = None,
    ):
        if isinstance(named_tensors, Mapping):
            named_tensors = list(named_tensors.items())
        self._owned = frozenset(owned)
        self._shards = dict(shards or {})
        self._ranges: dict[str, tuple[int, int, int]] = {}
        specs = getattr(named_tensors, "specs", None)
        if callable(specs):
            self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = dict(specs())
        elif isinstance(named_tensors, Iterator):
            raise ConfigError(
                "owned_tensors() needs the pairs as a list or mapping, or an iterator with "
                "specs() (hf_named_tensors' answer): the first update plans from what it "
                "will yield"
            )
        else:
            named_tensors = list(named_tensors)
            self._specs = {
                name: (tuple(tensor.shape), tensor.dtype)  # the session checks the pairs
                for name, tensor in named_tensors
                if isinstance(tensor, torch.Tensor)
            }
        unknown = sorted((self._owned | self._shards.keys()) - self._specs.keys())
        if unknown:
            raise ConfigError(f"owned_tensors(): owned HF tensors {unknown[:4]} are not sent")
        for name, (dim, start, full) in self._shards.items():
            shape, dtype = self._specs[name]
            if name in self._owned or not 0 <= dim < len(shape) or start < 0:
                raise ConfigError(
                    f"owned_tensors(): shard {(dim, start, full)} of HF tensor {name!r} "
                    f"{list(shape)} is not a slice along one of its dims (or is owned whole too)"
                )
            stop = start + shape[dim]
            if stop > full:
                raise ConfigError(
                    f"owned_tensors(): HF tensor {name!r}'s slice {start}..{stop} along dim "
                    f"{dim} passes its full size {full}"
                )
            self._ranges[name] = (dim, start, stop)
            self._specs[name] = ((*shape[:dim], full, *shape[dim + 1 :]), dtype)
        self._pairs = iter(named_tensors)
        self._whole = False

    def whole_tensors(self) -> OwnedTensors:
        """From now on yield each slice in its tensor's full shape, zero elsewhere (what the
        session, which knows they are slices, stages); this same iterator."""
        self._whole = True
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        name, tensor = next(self._pairs)
        found = self._ranges.get(name)
        if found is None or not self._whole:
            return name, tensor
        dim, start, stop = found
        full = torch.zeros(self._specs[name][0], dtype=tensor.dtype, device=tensor.device)
        full.narrow(dim, start, stop - start).copy_(tensor)  # the loaders take whole tensors
        return name, full

    def shards(self) -> dict[str, tuple[int, int, int]]:
        """HF name -> (dim, start, stop) of the slice this rank holds of a sharded tensor."""
        return dict(self._ranges)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (shape, dtype) of every pair this will yield."""
        return dict(self._specs)

    def owned(self) -> frozenset[str]:
        """The HF names this rank owns: no other trainer rank sends them."""
        return self._owned


def owned_tensors(
    named_tensors: Any,
    owned: Iterable[str] = (),
    *,
    shards: Mapping[str, Shard] | None = None,
) -> OwnedTensors:
    """``named_tensors`` (pairs, a mapping, or an iterator with ``specs()``) with the
    names of those this trainer rank owns alone (its experts under expert parallelism)
    and, in ``shards``, name -> (dim, start, full size) for those it holds a slice of
    (its tensors are that slice); the others must be sent whole by every rank of its
    pipeline stage."""
    return OwnedTensors(named_tensors, owned, shards)


def shard_ranges(named_tensors: object) -> dict[str, tuple[int, int, int]]:
    """What an input says this rank holds slices of (its ``shards()``); none if it does not say."""
    shards = getattr(named_tensors, "shards", None)
    return dict(shards()) if callable(shards) else {}


def owned_names(named_tensors: object) -> frozenset[str]:
    """What an input says this rank owns (its ``owned()``); none if it does not say."""
    owned = getattr(named_tensors, "owned", None)
    if not callable(owned):
        return frozenset()
    names = owned()
    if not all(isinstance(name, str) for name in names):
        raise ConfigError("owned() must return HF tensor names (str)")
    return frozenset(names)
