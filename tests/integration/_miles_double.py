"""A test double of miles' weight-update path, written from radixark/miles at
31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (2026-08-21).

``register()`` puts it in ``sys.modules`` under miles' own module paths, so
``p2pweights.integrations.miles`` finds "miles" and derives its updater from this
``DistBucketedWeightUpdateMixin``, and ``install`` rebinds ``UpdateWeightP2P`` here.

What is kept from miles' source, in miles' order:

* ``MegatronTrainRayActor.init`` (``miles/backends/megatron_utils/actor.py``): the
  ``--custom-megatron-init-path`` hook runs inside Megatron's ``init(args)``, before
  ``update_weight_cls`` is picked from ``--update-weight-transfer-mode`` (``broadcast``,
  ``disk-delta``, else the module's ``UpdateWeightP2P``) and built as
  ``cls(args, model, weights_getter=..., model_name=..., quantization_config=...,
  is_lora=...)``; ``MegatronTrainRayActor.update_weights(info)``: connect when there
  are new engines or the updater is not fresh, a gloo barrier, ``update_weights()``;
  ``train`` ends with ``pop_metrics()``.
* ``DistBucketedWeightUpdateMixin`` (``.../update_weight_from_distributed/mixin.py``):
  ``update_weights`` (version + 1, pause-and-prepare, gloo barrier, non-expert buckets,
  barrier, expert buckets, barrier, finalize-and-resume, barrier; LoRA left out), and the
  bucketing of ``_gather_and_update_non_expert_weights`` /
  ``_gather_and_update_expert_weights`` (flush when the next unit would pass
  ``--update-weight-buffer-size``; the expert buffer counts EP size times; only
  ``_is_source`` ranks hand buckets over; the expert path clears its list first).

What is simplified: each rank's "model" is its pipeline stage's tensors already under
HF names, so miles' TP / EP all-gathers and ``convert_to_hf`` are identities (EP size 1)
and every update unit is one tensor; experts are the names ``is_routed_expert_param``
matches. miles' own ``_pause_and_prepare_engines`` / ``_finalize_and_resume_engines``
record that they ran (an updater that owns the engines' update session overrides them).
Engine actors answer ``get_topology_info()`` with their server's URL; there is no Ray
cluster: a remote call's value is returned by ``ray.get`` as is.

Every hand-over of a bucket and the finalize are logged (``calls``) before and after,
so a test sees which call raised; ``args.on_bucket(index)``, when set, runs before the
hand-over of bucket ``index`` (to fail an engine at a known point).
"""

from __future__ import annotations

import importlib
import sys
import types
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"

_STATE: dict[str, Any] = {}


# -- miles/backends/training_utils/parallel.py, miles/utils/distributed_utils.py ------------------


@dataclass(frozen=True)
class _Axis:
    rank: int
    size: int


@dataclass(frozen=True)
class ParallelState:
    pp: _Axis


def get_parallel_state() -> ParallelState:
    return _STATE["parallel"]


def get_gloo_group() -> Any:
    return _STATE["gloo"]


def load_function(path: str) -> Any:
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def is_routed_expert_param(name: str) -> bool:
    return ".experts." in name and ".shared_experts." not in name


# -- miles/backends/megatron_utils/update_weight/update_weight_from_distributed/mixin.py ---------


class DistBucketedWeightUpdateMixin:
    calls: list[str]
    miles_engine_calls: list[str]

    def _init_lora(self, *, args, model, model_name, quantization_config, is_lora) -> None:
        self.is_lora = is_lora

    def _log(self, event: str) -> None:
        self.__dict__.setdefault("calls", []).append(event)

    def _hand_over(self, func, bucket, pbar) -> None:
        index = self.__dict__.setdefault("_buckets_handed", 0)
        self._buckets_handed = index + 1
        on_bucket = getattr(self.args, "on_bucket", None)
        if on_bucket is not None:
            on_bucket(index)
        self._log(f"send {index}")
        func(bucket, pbar)
        self._log(f"sent {index}")

    def _gather_and_update_non_expert_weights(self, update_bucket_weight_func, pbar=None):
        buffer_size = 0
        converted_named_tensors: list[tuple[str, torch.Tensor]] = []
        for update_unit in self._get_weight_transfer_update_units(is_expert=False):
            gathered_params, unit_size = self._all_gather_update_unit(update_unit)
            if not self._is_source:
                continue
            if (
                buffer_size + unit_size > self.args.update_weight_buffer_size
                and converted_named_tensors
            ):
                self._hand_over(update_bucket_weight_func, converted_named_tensors, pbar)
                converted_named_tensors = []
                buffer_size = 0
            for name, param in gathered_params:
                converted_named_tensors += [(name, param)]  # convert_to_hf: already HF
            buffer_size += unit_size
        if converted_named_tensors:
            self._hand_over(update_bucket_weight_func, converted_named_tensors, pbar)

    def _gather_and_update_expert_weights(self, update_bucket_weight_func, pbar=None):
        buffer_size = 0
        named_tensors: list[tuple[str, torch.Tensor]] = []
        ep_size = 1
        for update_unit in self._get_weight_transfer_update_units(is_expert=True):
            gathered_params, unit_size = self._all_gather_update_unit(update_unit)
            if (buffer_size + unit_size) * ep_size > self.args.update_weight_buffer_size and (
                named_tensors
            ):
                self._update_expert_bucket_weights(named_tensors, update_bucket_weight_func, pbar)
                named_tensors = []
                buffer_size = 0
            named_tensors.extend(gathered_params)
            buffer_size += unit_size
        if named_tensors:
            self._update_expert_bucket_weights(named_tensors, update_bucket_weight_func, pbar)

    def _all_gather_update_unit(self, update_unit):
        return list(update_unit), sum(t.numel() * t.element_size() for _, t in update_unit)

    def _get_weight_transfer_update_units(self, is_expert: bool):
        units = [[(name, tensor)] for name, tensor in self.model]
        return [unit for unit in units if is_routed_expert_param(unit[0][0]) == is_expert]

    def _update_expert_bucket_weights(self, named_tensors, update_bucket_weight_func, pbar):
        flat_gathered = list(named_tensors)  # EP all-gather of one rank
        named_tensors.clear()
        if not self._is_source:
            return
        self._hand_over(update_bucket_weight_func, flat_gathered, pbar)

    def _pause_and_prepare_engines(self) -> None:
        self.__dict__.setdefault("miles_engine_calls", []).append("pause+begin")

    def _finalize_and_resume_engines(self) -> None:
        self.__dict__.setdefault("miles_engine_calls", []).append("end+continue")

    def pop_metrics(self) -> dict[str, float]:
        return self.__dict__.pop("update_weight_metrics", {})

    @torch.no_grad()
    def update_weights(self) -> None:
        self.weight_version += 1
        self._buckets_handed = 0
        self._pause_and_prepare_engines()
        dist.barrier(group=get_gloo_group())
        pbar = None  # miles: a tqdm bar on source ranks
        self._gather_and_update_non_expert_weights(self._update_weight_implementation, pbar)
        dist.barrier(group=get_gloo_group())
        self._gather_and_update_expert_weights(self._update_weight_implementation, pbar)
        dist.barrier(group=get_gloo_group())
        self._log("finalize")
        self._finalize_and_resume_engines()
        self._log("finalized")
        dist.barrier(group=get_gloo_group())


# -- miles/backends/megatron_utils/actor.py --------------------------------------------------------


class UpdateWeightP2P:
    """miles' own p2p updater (Mooncake, a CPU sglang replica): not part of the double."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise AssertionError("miles' own UpdateWeightP2P was built: install() did not run")


@dataclass(frozen=True)
class EnginesAndLock:
    rollout_engines: list[Any]
    rollout_engine_lock: Any
    has_new_engines: bool
    engine_gpu_counts: list[int]
    engine_gpu_offsets: list[int]


class MegatronTrainRayActor:
    def __init__(self, model: list[tuple[str, torch.Tensor]]):
        self.model = model

    def init(self, args: Namespace) -> None:
        self.args = args
        if args.custom_megatron_init_path:  # megatron_utils/initialize.py: init(args)
            load_function(args.custom_megatron_init_path)(args)
        actor = _module("actor")  # miles reads its module global UpdateWeightP2P here
        if args.update_weight_transfer_mode == "broadcast":
            raise AssertionError("the double has no broadcast updater")
        elif args.update_weight_transfer_mode == "disk-delta":
            raise AssertionError("the double has no disk-delta updater")
        else:
            update_weight_cls = actor.UpdateWeightP2P
        self.weight_updater = update_weight_cls(
            args,
            self.model,
            weights_getter=lambda: dict(self.model),
            model_name="qwen3",
            quantization_config=None,
            is_lora=False,
        )

    def update_weights(self, info: EnginesAndLock) -> None:
        if info.has_new_engines or not self.weight_updater.is_rollout_engines_fresh():
            self.weight_updater.connect_rollout_engines(
                info.rollout_engines,
                info.rollout_engine_lock,
                engine_gpu_counts=info.engine_gpu_counts,
                engine_gpu_offsets=info.engine_gpu_offsets,
            )
            dist.barrier(group=get_gloo_group())
        self.weight_updater.update_weights()

    def end_of_train_step(self) -> dict[str, float]:
        return self.weight_updater.pop_metrics()  # train(): log_perf_data(extra_metrics=...)


# -- miles/backends/sglang_utils/sglang_engine.py (the Ray actor, without Ray) ------------------


class _Remote:
    def __init__(self, value: Any):
        self.value = value


class EngineActor:
    """An ``SGLangEngine`` handle: ``get_topology_info.remote()`` gives the server URL."""

    def __init__(self, url: str):
        self.get_topology_info = types.SimpleNamespace(remote=lambda: _Remote({"url": url}))


def _ray_get(refs: Any) -> Any:
    return [ref.value for ref in refs] if isinstance(refs, list) else refs.value


# -- registering ---------------------------------------------------------------------------------

_MODULES = {
    "actor": "miles.backends.megatron_utils.actor",
    "mixin": "miles.backends.megatron_utils.update_weight.update_weight_from_distributed.mixin",
    "parallel": "miles.backends.training_utils.parallel",
    "distributed_utils": "miles.utils.distributed_utils",
    "misc": "miles.utils.misc",
}
_MEMBERS = {
    "actor": ["MegatronTrainRayActor", "UpdateWeightP2P", "EnginesAndLock"],
    "mixin": ["DistBucketedWeightUpdateMixin"],
    "parallel": ["get_parallel_state", "ParallelState"],
    "distributed_utils": ["get_gloo_group"],
    "misc": ["load_function"],
}


def _module(key: str) -> types.ModuleType:
    return sys.modules[_MODULES[key]]


def register(pp_rank: int, pp_size: int) -> None:
    """Make this double importable as miles, in this trainer process (after
    ``torch.distributed`` is initialized: it makes miles' gloo group)."""
    import ray

    ray.get = _ray_get  # engine actors answer without a Ray cluster
    _STATE["parallel"] = ParallelState(pp=_Axis(pp_rank, pp_size))
    _STATE["gloo"] = dist.new_group(backend="gloo")
    for key, path in _MODULES.items():
        parts = path.split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            sys.modules.setdefault(parent, types.ModuleType(parent))
        module = types.ModuleType(path)
        for name in _MEMBERS[key]:
            setattr(module, name, globals()[name])
        sys.modules[path] = module
