"""Which bytes of its parameters a subset of HF tensors writes, found on meta.

Owner sends (``plan.owners``) let each trainer rank stage only the HF tensors it owns;
where a parameter is fed by tensors of several owners (the fused experts of a layer on
a TP engine rank), each owner writes only the bytes its own tensors' loaders write.
``written_spans`` runs the replica's ``load_weights`` on meta placeholders of those
tensors alone, as the loader probe does, and records the element range every write
into a parameter covers (the hull of a strided view): byte ranges per parameter,
sorted and merged. No storage is allocated and no byte is computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from p2pweights.errors import ConfigError
from p2pweights.replica.base import merged
from p2pweights.replica.sglang.compat import api_error
from p2pweights.replica.sglang.probe import Probed, written_arguments
from p2pweights.source.inputs import InputSpec

__all__ = ["Spans", "written_spans"]

Spans = dict[str, tuple[tuple[int, int], ...]]
"""Parameter name -> sorted, disjoint ``[start, end)`` byte ranges written in it."""


def written_spans(replica: Probed, inputs: Mapping[str, InputSpec]) -> Spans:
    """The byte ranges of each parameter that loading ``inputs`` (alone) writes."""
    params = dict(replica.model.named_parameters())
    watcher = _SpanWatcher(params)
    placeholders = [
        (name, torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
        for name, spec in inputs.items()
    ]
    try:
        with replica.loading_scope(), watcher:
            replica.model.load_weights(iter(placeholders))  # type: ignore[operator]
    except Exception as exc:
        doing = f"finding the bytes {len(inputs)} owned HF tensor(s) write"
        moved = api_error(exc, doing)
        if moved is not None:
            raise moved from exc
        raise ConfigError(
            f"{doing} on engine rank {replica.spec.world_rank} failed "
            f"(first: {sorted(inputs)[:3]}): {exc}"
        ) from exc
    return {name: merged(ranges) for name, ranges in watcher.ranges.items()}


class _SpanWatcher(TorchDispatchMode):
    """Records, per parameter, the byte range every in-place write into it covers."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        self._by_storage: dict[int, list[tuple[int, int, str, int]]] = {}
        for name, param in params.items():
            start = int(param.storage_offset())
            self._by_storage.setdefault(param.untyped_storage()._cdata, []).append(
                (start, start + _elements_spanned(param), name, param.element_size())
            )

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for target in written_arguments(func, args, kwargs):
            self._record(target)
        return func(*args, **kwargs)

    def _record(self, target: torch.Tensor) -> None:
        candidates = self._by_storage.get(target.untyped_storage()._cdata)
        if not candidates or target.numel() == 0:
            return
        start = int(target.storage_offset())
        end = start + _elements_spanned(target)
        for first, last, name, size in candidates:
            if first < end and start < last:
                lo, hi = max(start, first) - first, min(end, last) - first
                self.ranges.setdefault(name, []).append((lo * size, hi * size))


def _elements_spanned(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    return 1 + sum(
        int(size - 1) * step for size, step in zip(tensor.shape, tensor.stride(), strict=True)
    )
