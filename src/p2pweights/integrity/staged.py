"""The sender side of verified writes: the digest of every staged slot, per runner.

The executor calls ``StagedDigests.add`` once per flushed staging buffer, after its
writes were handed to the writers (the writers and this only read the buffer): each
slot is digested once and filed under every runner (engine URL, rank, role) it is
written to. On a GPU the sums are left on the device, in the stream's order (before
any later load refills the buffer), and copied to the host and hashed once, by
``into`` at the end of the update (``digest.lane_sums`` says what still waits: a
layout's first use, and small regions where the kernel does not run).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

import torch

from p2pweights.wire.digest import Lanes, hex_digests, lane_sums
from p2pweights.wire.publication import Runner

__all__ = ["StagedDigests"]


class StagedDigests:
    """The slots digested so far in one update, and the runners each one went to."""

    def __init__(self) -> None:
        self._sums: dict[str, Lanes] = {}
        self._filed: list[tuple[str, str, Iterable[Runner]]] = []

    def add(self, slots: Iterable[tuple[str, torch.Tensor, Iterable[Runner]]]) -> None:
        """``slots``: (parameter name, its staged bytes, the runners it goes to)."""
        listed = list(slots)
        first = len(self._filed)
        keys = [str(first + i) for i in range(len(listed))]
        regions = {key: view for key, (_, view, _) in zip(keys, listed, strict=True)}
        self._sums.update(lane_sums(regions))
        for key, (param, _, runners) in zip(keys, listed, strict=True):
            self._filed.append((key, param, runners))

    def into(self, out: MutableMapping[Runner, dict[str, str]]) -> None:
        """Every digest so far, under each runner its slot went to (waits for the device)."""
        found = hex_digests(self._sums)
        for key, param, runners in self._filed:
            for runner in runners:
                out.setdefault(runner, {})[param] = found[key]
        self._sums, self._filed = {}, []
