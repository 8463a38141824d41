"""The sender side of verified writes: the digest of every staged slot, per runner.

Called by the executor once per flushed staging buffer, after its writes were handed
to the writers (the writers and this only read the buffer, which is not refilled
until every write reading it returned): each slot is digested once and filed under
every runner (engine URL, rank, role) it is written to.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

import torch

from p2pweights.integrity.digest import digests

__all__ = ["file_digests"]

Runner = tuple[str, int, str]


def file_digests(
    slots: Iterable[tuple[str, torch.Tensor, Iterable[Runner]]],
    into: MutableMapping[Runner, dict[str, str]],
) -> None:
    """``slots``: (parameter name, its staged bytes, the runners it goes to)."""
    listed = list(slots)
    sums = digests({str(i): view for i, (_, view, _) in enumerate(listed)})
    for i, (param, _, runners) in enumerate(listed):
        for runner in runners:
            into.setdefault(runner, {})[param] = sums[str(i)]
