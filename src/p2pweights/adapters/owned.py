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

__all__ = ["OwnedTensors", "owned_names", "owned_tensors"]


class OwnedTensors(Iterator[tuple[str, torch.Tensor]]):
    """(HF name, tensor) pairs, with the names this rank owns (``owned()``)."""

    def __init__(self, named_tensors: Any, owned: Iterable[str]):
        if isinstance(named_tensors, Mapping):
            named_tensors = list(named_tensors.items())
        self._owned = frozenset(owned)
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
        unknown = sorted(self._owned - self._specs.keys())
        if unknown:
            raise ConfigError(f"owned_tensors(): owned HF tensors {unknown[:4]} are not sent")
        self._pairs = iter(named_tensors)

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._pairs)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (shape, dtype) of every pair this will yield."""
        return dict(self._specs)

    def owned(self) -> frozenset[str]:
        """The HF names this rank owns: no other trainer rank sends them."""
        return self._owned


def owned_tensors(named_tensors: Any, owned: Iterable[str]) -> OwnedTensors:
    """``named_tensors`` (pairs, a mapping, or an iterator with ``specs()``) with the
    names of those this trainer rank owns alone (its experts under expert parallelism);
    the others must be sent whole by every rank of its pipeline stage."""
    return OwnedTensors(named_tensors, owned)


def owned_names(named_tensors: object) -> frozenset[str]:
    """What an input says this rank owns (its ``owned()``); none if it does not say."""
    owned = getattr(named_tensors, "owned", None)
    if not callable(owned):
        return frozenset()
    names = owned()
    if not all(isinstance(name, str) for name in names):
        raise ConfigError("owned() must return HF tensor names (str)")
    return frozenset(names)
