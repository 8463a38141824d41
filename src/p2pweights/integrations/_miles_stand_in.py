"""Stand-ins for miles' seams where miles is not installed.

``WeightTransferProtocol``: the base class of miles' transports after PR 2752
(``miles/backends/training_utils/weight_update/protocol.py``), with the members
``p2pweights.integrations.miles_protocol`` relies on: the class attributes, the
attributes ``__init__`` sets and the optional hooks. miles' factory checks
``isinstance(protocol, WeightTransferProtocol)`` against its own class, so where miles
is installed the protocol derives from miles' class, never from this one.

``DistBucketedWeightUpdateMixin``: miles' mixin before the protocol.

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
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from p2pweights.errors import ConfigError

__all__ = ["DistBucketedWeightUpdateMixin", "WeightTransferProtocol", "WeightUpdatePlacement"]

BucketFunc = Callable[[list[tuple[str, torch.Tensor]], Any], None]


@dataclass(frozen=True)
class WeightUpdatePlacement:
    """miles' ``WeightUpdatePlacement``: whether the weight iterator gathers pipeline
    stages onto every rank (``gather_pp``)."""

    gather_pp: bool = False


class WeightTransferProtocol:
    """miles' transport base class, as far as p2pweights' protocol uses it."""

    required_placement: ClassVar[WeightUpdatePlacement] = WeightUpdatePlacement(gather_pp=False)
    supports_lora: ClassVar[bool] = False
    use_weight_update_session: ClassVar[bool] = True
    needs_base_resync_for_lora: bool = False

    def __init__(self, args: Any) -> None:
        self.args = args
        self.rollout_engines: Sequence[Any] | None = None
        self.is_sender: bool | None = None
        self.group_name = "miles"
        self.update_weight_metrics: dict[str, float] = {}

    def begin_sync(
        self, weight_version: int, iter_buckets: Callable[..., Any], rollout_id: int | None = None
    ) -> bool:
        return True

    def after_base_weights(self) -> None:
        pass

    def finalize(self, weight_version: int) -> None:
        pass

    def after_engines_resumed(self) -> None:
        pass

    def pop_metrics(self) -> dict[str, float]:
        metrics, self.update_weight_metrics = self.update_weight_metrics, {}
        return metrics


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
