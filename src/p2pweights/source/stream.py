"""One update's tensors, checked against what the first update established, as ready groups.

The first update fixes the contract: the HF names, shapes and dtypes the loaders were
probed with (after it was itself checked against the engine's checkpoint). Every
later update must send the same. A sequence or mapping is checked whole before any
byte moves; an iterator is checked tensor by tensor as it streams (the first bad
tensor then stops the update after some bytes were written; the engines stay paused
and show the update as incomplete until a later update completes).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

import torch

from p2pweights.errors import ConfigError
from p2pweights.plan.byte_plan import BytePlan, GroupPlan
from p2pweights.source.collect import ConvertingCollector
from p2pweights.source.finite import check_finite
from p2pweights.source.inputs import InputSpec, check_input

__all__ = ["UpdateSource"]

ReadyGroup = tuple[GroupPlan, Sequence[tuple[str, torch.Tensor]]]


class UpdateSource:
    """Trainer tensors -> (planned group, loader inputs), converted and checked."""

    def __init__(
        self,
        known: Mapping[str, InputSpec],
        groups: Mapping[Hashable, Sequence[Iterable[str]]],
        formats: Mapping[Hashable, object],
        *,
        finite: bool = False,
    ):
        """``known``: the first update's specs; ``groups[key]``: each replica's groups'
        HF names, in plan order; ``formats[key]``: its checkpoint format;
        ``finite``: refuse NaN / Inf."""
        self.known = dict(known)
        self._groups = groups
        self._formats = formats
        self._finite = finite
        self.convert_s = 0.0

    def check_whole(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Every tensor matches the contract and none of it is missing (before any write)."""
        seen = set()
        for name, tensor in tensors:
            check_input(name, tensor, self.known)
            if name in seen:
                raise ConfigError(f"HF tensor {name!r} was given twice in one update")
            seen.add(name)
            if self._finite:
                check_finite(name, tensor)
        missing = sorted(set(self.known) - seen)
        if missing:
            raise ConfigError(
                f"this update lacks {len(missing)} HF tensor(s) the first update sent: "
                f"{', '.join(missing[:8])}"
            )

    def ready(
        self, tensors: Iterable[tuple[str, torch.Tensor]], plan: BytePlan, *, checked: bool
    ) -> Iterator[ReadyGroup]:
        """The planned groups with their inputs, as the tensors complete them.

        ``checked``: the tensors went through ``check_whole`` already.
        """
        collector = ConvertingCollector(self._groups, self._formats)  # type: ignore[arg-type]
        try:
            for name, tensor in tensors:
                if not checked:
                    check_input(name, tensor, self.known)
                    if self._finite:
                        check_finite(name, tensor)
                for key, index, inputs in collector.add(name, tensor):
                    yield plan.group(key, index), inputs
            for key, index, inputs in collector.flush():
                yield plan.group(key, index), inputs
            collector.raise_if_incomplete()
        finally:
            self.convert_s = collector.convert_s
