"""A stand-in for miles' ``DistBucketedWeightUpdateMixin`` where miles is not installed.

miles (radixark/miles) is not on PyPI. ``p2pweights.integrations.miles`` derives its
updater from miles' own mixin
(``miles/backends/megatron_utils/update_weight/update_weight_from_distributed/mixin.py``)
when miles imports, else from this class, which has the members the updater relies on,
as read at miles ``31f1ca961``: ``update_weights`` calls the hooks in miles' order
(version, pause-and-prepare, non-expert buckets, expert buckets, finalize-and-resume;
miles' gloo barriers between them are left out), and ``pop_metrics`` drains
``update_weight_metrics``. Gathering Megatron's parameters into buckets needs miles:
here it raises. It lets the module import, type-check and be unit-tested without miles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from p2pweights.errors import ConfigError

__all__ = ["DistBucketedWeightUpdateMixin"]

BucketFunc = Callable[[list[tuple[str, torch.Tensor]], Any], None]


class DistBucketedWeightUpdateMixin:
    """miles' bucketed weight-update pipeline, as far as p2pweights' updater uses it."""

    weight_version: int

    def _init_lora(
        self,
        *,
        args: Any,
        model: Sequence[torch.nn.Module],
        model_name: str,
        quantization_config: dict | None,
        is_lora: bool,
    ) -> None:
        self.is_lora = is_lora

    def _gather_and_update_non_expert_weights(self, func: BucketFunc, pbar: Any = None) -> None:
        raise ConfigError(
            "gathering Megatron's parameters into buckets needs miles (radixark/miles); "
            "this is p2pweights' stand-in for its DistBucketedWeightUpdateMixin"
        )

    def _gather_and_update_expert_weights(self, func: BucketFunc, pbar: Any = None) -> None:
        raise ConfigError(
            "gathering Megatron's expert parameters into buckets needs miles (radixark/miles)"
        )

    def _pause_and_prepare_engines(self) -> None:
        raise NotImplementedError

    def _finalize_and_resume_engines(self) -> None:
        raise NotImplementedError

    def _update_weight_implementation(
        self, converted_named_tensors: list[tuple[str, torch.Tensor]], pbar: Any = None
    ) -> None:
        raise NotImplementedError

    def pop_metrics(self) -> dict[str, float]:
        out: dict[str, float] = self.__dict__.pop("update_weight_metrics", {})
        return out

    def update_weights(self) -> None:
        self.weight_version += 1
        self._pause_and_prepare_engines()
        self._gather_and_update_non_expert_weights(self._update_weight_implementation, None)
        self._gather_and_update_expert_weights(self._update_weight_implementation, None)
        self._finalize_and_resume_engines()
