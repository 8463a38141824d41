"""miles' own weight-update driver (after PR 2752), loaded from tests/fixtures/miles-protocol.

``load()`` puts miles' three files (``protocol.py``, ``updater.py``, ``sync_session.py``,
origin in tests/fixtures/miles-protocol/ORIGIN.md) into ``sys.modules`` under their
miles names, after stubbing the modules they import that are not among them. Each
stub is listed in ``STUBS`` with why it is one; none of them is on the path p2pweights
is driven through except the weight iterator and the gloo group:

* ``hf_weight_iterator``: miles' iterator all-gathers Megatron's TP / EP shards and
  converts them to HF names (Megatron-LM and Megatron-Bridge, GPUs): here each rank's
  "model" is its pipeline stage's HF tensors, bucketed by ``--update-weight-buffer-size``
  as miles does, converted (``materialize``) only on sender ranks;
* ``distributed_utils.get_gloo_group``: miles makes it at Megatron's init; here one gloo
  group over every trainer rank.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FIXTURES = Path(__file__).parents[1] / "fixtures" / "miles-protocol" / "upstream"
VARIANTS = {
    "proximal-44f6bec": FIXTURES,
    "radixark-78669cf9": FIXTURES / "radixark-78669cf9",
}
"""Where each variant's ``protocol.py`` lies (ORIGIN.md); both run under the same
``updater.py`` and ``sync_session.py``."""
FILES = {
    "miles.backends.training_utils.weight_update.protocol": "protocol.py",
    "miles.backends.training_utils.weight_update.session": "sync_session.py",
    "miles.backends.training_utils.weight_update.updater": "updater.py",
}

STUBS = {
    "miles.backends.sglang_utils.sglang_api_client": "SGLangApiClient: miles' httpx client "
    "(its module imports miles' HTTP pool); only its server_url is read here",
    "miles.backends.training_utils.parallel": "ParallelState: built from Megatron-LM's "
    "parallel state (mpu); here the pp axis of each rank",
    "miles.backends.training_utils.weight_update.hf_weight_iterator": "the Megatron TP/EP "
    "gathers and HF conversion (Megatron-LM, Megatron-Bridge): see the module docstring",
    "miles.backends.training_utils.weight_update.conn_status": "ConnStatusManager: only "
    "reconnect_if_needed reads it (Ray engine-cell snapshots), not called here",
    "miles.backends.training_utils.weight_update.utils": "record_lora_checksums: LoRA only",
    "miles.utils.async_utils": "the event loop sync_session.py's engine RPCs run on; "
    "p2pweights' protocol runs the engines' session itself, so they are never called",
    "miles.utils.distributed_utils": "get_gloo_group: made at Megatron's init",
    "miles.utils.lora.utils": "LORA_ADAPTER_NAME: a constant (LoRA only)",
    "miles.utils.timer": "timer: miles' global Timer (Megatron's global args)",
    "miles.utils.function_registry": "load_function: dotted-path import, as miles' does; "
    "function_registry: miles' registry of named test targets (radixark 78669cf9 asks it "
    "first), empty here",
}


@dataclass(frozen=True)
class SGLangApiClient:
    server_url: str
    api_key: str | None = None


@dataclass(frozen=True)
class GroupInfo:
    rank: int
    size: int
    group: Any = None


@dataclass(frozen=True)
class ParallelState:
    pp: GroupInfo


@dataclass(frozen=True)
class WeightUpdatePlacement:
    gather_pp: bool = False


class HfWeightIterator:
    """Buckets of this rank's HF tensors, flushed past the buffer size, as miles'."""

    weight_update_selector = "all"

    def __init__(self, args: Any, model: Any, *, required_placement: Any, **_: Any):
        self.args = args
        self.placement = required_placement
        self.materialized = 0

    def iter_hf_weights(
        self, weights: Any, *, include_base: bool = True, adapters: Any = (), materialize: bool
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in weights.items():
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > self.args.update_weight_buffer_size:
                yield bucket
                bucket, size = [], 0
            if materialize:
                self.materialized += 1
                bucket.append((name, tensor.clone()))  # miles' conversion makes new tensors
            else:
                bucket.append((name, tensor[:0]))  # joined the gathers, converted nothing
            size += nbytes
        if bucket:
            yield bucket


_STATE: dict[str, Any] = {}


def get_gloo_group() -> Any:
    return _STATE["gloo"]


function_registry: dict[str, Any] = {}


def load_function(path: str) -> Any:
    module, _, attribute = path.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


@contextlib.contextmanager
def timer(name: str) -> Iterator[None]:
    yield


def _unreachable(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a stub that p2pweights' path must not reach was called")


_MEMBERS: dict[str, dict[str, Any]] = {
    "miles.backends.sglang_utils.sglang_api_client": {"SGLangApiClient": SGLangApiClient},
    "miles.backends.training_utils.parallel": {"ParallelState": ParallelState},
    "miles.backends.training_utils.weight_update.hf_weight_iterator": {
        "WeightUpdatePlacement": WeightUpdatePlacement
    },
    "miles.backends.training_utils.weight_update.conn_status": {"ConnStatusManager": object},
    "miles.backends.training_utils.weight_update.utils": {"record_lora_checksums": _unreachable},
    "miles.utils.async_utils": {"submit": _unreachable, "wait_futures": _unreachable},
    "miles.utils.distributed_utils": {"get_gloo_group": get_gloo_group},
    "miles.utils.lora.utils": {"LORA_ADAPTER_NAME": "miles_lora"},
    "miles.utils.timer": {"timer": timer},
    "miles.utils.function_registry": {
        "load_function": load_function,
        "function_registry": function_registry,
    },
}


def _module(path: str) -> types.ModuleType:
    parts = path.split(".")
    for depth in range(1, len(parts)):
        parent = ".".join(parts[:depth])
        if parent not in sys.modules:
            package = types.ModuleType(parent)
            package.__path__ = []
            sys.modules[parent] = package
    module = types.ModuleType(path)
    sys.modules[path] = module
    return module


def _file(path: str, variant: str) -> Path:
    folder = VARIANTS[variant] if path.endswith(".protocol") else FIXTURES
    return folder / "miles" / "backends" / "training_utils" / "weight_update" / FILES[path]


def available(variant: str = "proximal-44f6bec") -> bool:
    return all(_file(path, variant).is_file() for path in FILES)


def load(variant: str = "proximal-44f6bec") -> types.ModuleType:
    """Stub what miles' files import, load them (``variant``'s ``protocol.py``); return
    miles' updater module. Call after ``torch.distributed`` is initialized (it makes
    miles' gloo group)."""
    assert set(_MEMBERS) == set(STUBS)
    _STATE["gloo"] = dist.new_group(backend="gloo")
    for path, members in _MEMBERS.items():
        module = _module(path)
        for name, value in members.items():
            setattr(module, name, value)
    for path in FILES:
        _module(path)  # the parent packages
        spec = importlib.util.spec_from_file_location(path, _file(path, variant))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[path] = module
        spec.loader.exec_module(module)
    return sys.modules["miles.backends.training_utils.weight_update.updater"]
