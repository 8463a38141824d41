"""megatron-core and megatron-bridge on a CPU host, for the Megatron adapter's tests.

megatron-bridge 0.3 imports transformer_engine when it is imported (its LoRA layers
subclass ``te.Linear``), and Transformer Engine needs CUDA. The models built here use
megatron-core's local layer spec (plain torch layers), so Transformer Engine is never
called: megatron-core is imported first, finds no Transformer Engine and takes its
local paths; then a stand-in module lets the bridge's import succeed. Any use of the
stand-in raises. On a host with Transformer Engine nothing is stood in.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

import torch


def megatron_available() -> bool:
    needed = ("megatron.core", "megatron.bridge")
    try:
        return all(importlib.util.find_spec(module) is not None for module in needed)
    except ModuleNotFoundError:  # no megatron package at all
        return False


class _Unusable(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unusable(name, (), {"__init__": _refuse})


def _refuse(*args: object, **kwargs: object) -> None:
    raise RuntimeError("transformer_engine is a stand-in here (tests/integration/_megatron_cpu.py)")


class _StandIn(types.ModuleType):
    __path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].islower():  # a submodule
            return importlib.import_module(f"{self.__name__}.{name}")
        value = _Unusable(name, (), {"__init__": _refuse})
        setattr(self, name, value)
        return value


class _Finder:
    def find_spec(self, fullname: str, path: object, target: object = None) -> Any:
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__version__ = "0.0.0+stand-in"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_bridge() -> Any:
    """``megatron.bridge.AutoBridge``, with a Transformer Engine stand-in where TE is missing."""
    # imported before the stand-in exists: megatron-core must see no Transformer Engine
    for module in (
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.process_groups_config",
        "megatron.core.tensor_parallel",
        "megatron.core.transformer",
    ):
        importlib.import_module(module)

    if importlib.util.find_spec("transformer_engine") is None:
        sys.meta_path.insert(0, _Finder())
    from megatron.bridge import AutoBridge

    return AutoBridge


def build_gpt(bridge: Any, tp: int, pp: int) -> list[Any]:
    """The bridge's GPT model of its HF config on this rank: local layer spec, bf16, on the
    current CUDA device where there is one, else on the CPU.

    ``megatron.core.parallel_state.initialize_model_parallel(tp, pp)`` must have run.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    provider = bridge.to_megatron_provider(load_weights=False)
    provider.transformer_layer_spec = lambda *a, **k: get_gpt_layer_local_spec(
        qk_layernorm=provider.qk_layernorm
    )
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.use_cpu_initialization = not torch.cuda.is_available()
    provider.params_dtype = torch.bfloat16
    provider.bf16 = True
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if torch.cuda.is_available():  # GPU initialisation draws from Megatron's CUDA RNG tracker
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    model = provider.provide()
    if torch.cuda.is_available():  # the local spec's torch norms are built on the CPU
        model = model.cuda()
    return [model.to(torch.bfloat16)]  # all weights bf16, as Megatron's Float16Module holds them


def load_checkpoint(bridge: Any, model: list[Any]) -> None:
    """``bridge.load_hf_weights(model)``, past two GPU assumptions of its loading on a CPU host.

    megatron-bridge 0.3's ``ReplicatedMapping.hf_to_megatron`` moves replicated weights to
    ``torch.cuda.current_device()`` before broadcasting them to the TP ranks: here that
    call answers "no CUDA device" (``None``), so they stay on the CPU. Its row-parallel
    loading scatters ``torch.chunk(..., dim=1)`` views, which gloo sends as if they were
    contiguous (wrong bytes): here they are made contiguous first. Only loading the
    test's checkpoint is affected; the export under test runs unchanged.
    """
    if torch.cuda.is_available():
        bridge.load_hf_weights(model)
        return
    import torch.distributed as dist

    current_device, scatter = torch.cuda.current_device, dist.scatter

    def contiguous_scatter(tensor: Any, scatter_list: Any = None, *args: Any, **kwargs: Any) -> Any:
        if scatter_list is not None:
            scatter_list = [t.contiguous() for t in scatter_list]
        return scatter(tensor, scatter_list, *args, **kwargs)

    torch.cuda.current_device = lambda: None  # type: ignore[assignment,return-value]
    dist.scatter = contiguous_scatter
    try:
        bridge.load_hf_weights(model)
    finally:
        torch.cuda.current_device, dist.scatter = current_device, scatter
