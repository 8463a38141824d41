"""A ``Loader`` (``transfer.executor``) made of a function: the executor alone, in tests."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

__all__ = ["FnLoader"]

HfInput = tuple[str, torch.Tensor]


class FnLoader:
    """``load(key, inputs, views)`` as replica ``key``'s loader."""

    def __init__(
        self,
        key: Hashable,
        load: Callable[[Hashable, list[HfInput], dict[str, torch.Tensor]], None],
    ):
        self._key = key
        self._load = load

    def load_into(self, inputs: Sequence[HfInput], views: Mapping[str, torch.Tensor]) -> None:
        self._load(self._key, list(inputs), dict(views))
