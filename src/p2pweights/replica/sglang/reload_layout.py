"""Bring a meta replica to the engine's reload layout, one module at a time.

An engine rank's parameters are in the "reload layout" while an update session is
open: sglang ran each quant method's start-up ``process_weights_after_loading``,
then the ``restore_weights_before_loading`` that ``begin_weight_update`` runs. Both
act on one module at a time (the module that owns the quant method), so a replica
does the same, module by module:

1. On meta. Most postprocess steps only re-wrap, re-shape or re-type parameters,
   which meta tensors do without storage. They run on a deep copy of the module
   first; if that succeeds they run again on the module itself (cheap on meta).
2. On real storage, for a module whose postprocess reads values (an fp8 attention
   layer's ``k_scale > 0`` test, a scale-format check): such a step raises on meta,
   and the copy is dropped. The module's own parameters and buffers then get real
   storage (zeros; floating tensors named ``*scale*`` ones, a valid scale) on the
   GPU when this process has one, else on the CPU; the postprocess and restore
   run, and every tensor of the module goes back to meta with the shape, stride and
   dtype the steps gave it. Peak memory is one module (tensors the module keeps in
   containers or on its quant method are not materialized; a step that needs them
   fails and is reported).

Device branches are the trainer's: sglang reads ``_is_cuda`` and its GPU kernel
flags (DeepGEMM, Blackwell scale formats) in this process, so a replica reproduces
an engine on the same kind of accelerator. A Hopper trainer writing to a Blackwell
engine whose DeepGEMM path requantizes scales to ue8m0 is not covered; the layout
check at connect catches a size difference, not a re-encoding of equal size.

The values a step reads decide branches whose outcome sglang writes into values,
not into shapes or dtypes (the engine's own start-up reads checkpoint values it
then overwrites on every update), so the layout does not depend on them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from p2pweights.replica.sglang import env as sglang_env
from p2pweights.replica.sglang.parameters import meta_like, parameter_like, repoint

if TYPE_CHECKING:
    from torch import nn

    from p2pweights.replica.ranks import RankSpec

logger = logging.getLogger(__name__)

__all__ = ["to_reload_layout", "MaterializedModules"]

_CPU = torch.device("cpu")
"""The device handed to sglang's steps: its ``device_loading_context`` then moves nothing."""


def _storage_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else _CPU


class MaterializedModules(list[str]):
    """Names of the modules that needed real storage to reach the reload layout."""


def to_reload_layout(model: nn.Module, spec: RankSpec) -> MaterializedModules:
    """Run the start-up postprocess, then the begin-update restore, module by module."""
    from sglang.srt.model_loader.loader import QuantizedRLModelLoader

    materialized = MaterializedModules()
    if QuantizedRLModelLoader.is_reload_scenario(model):
        return materialized
    with sglang_env.rank_scope(spec):
        for name, module, quant_method in sglang_env.modules_with_quant_method(model):
            if _runs_on_meta(module):
                _postprocess_and_restore(module, quant_method)
                continue
            with _real_storage(module):
                _postprocess_and_restore(module, module.quant_method)
            materialized.append(name)
    if materialized:
        logger.debug("modules brought to the reload layout on real storage: %s", materialized)
    return materialized


def _postprocess_and_restore(module: nn.Module, quant_method: Any) -> None:
    """What sglang's start-up postprocess, then ``begin_weight_update``, do to one module."""
    from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
    from sglang.srt.model_loader.loader import device_loading_context

    with device_loading_context(module, _CPU):
        quant_method.process_weights_after_loading(module)
    # AMX packing and some backend wrappers are duck-typed and cannot restore (sglang too).
    if isinstance(quant_method, QuantizeMethodBase):
        with device_loading_context(module, _CPU):
            quant_method.restore_weights_before_loading(module)


def _runs_on_meta(module: nn.Module) -> bool:
    """Whether the module's steps run on meta tensors, tried on a throwaway deep copy."""
    # Parameters are copied by hand: sglang's BasevLLMParameter subclasses cannot be
    # deep-copied, and a trial only needs same-class meta tensors with the attributes.
    memo: dict[int, Any] = {
        id(param): parameter_like(param, meta_like(param), dict(param.__dict__))
        for param in module.parameters()
    }
    try:
        trial = copy.deepcopy(module, memo)
    except Exception as exc:  # a module holding something uncopyable: take real storage
        logger.debug("cannot copy %s for a meta trial: %s", type(module).__name__, exc)
        return False
    if _has_storage(trial):
        return False
    try:
        _postprocess_and_restore(trial, trial.quant_method)
    except (RuntimeError, NotImplementedError, ValueError, AssertionError) as exc:
        logger.debug("%s needs values for its postprocess: %s", type(module).__name__, exc)
        return False
    return True


def _has_storage(module: nn.Module) -> bool:
    return any(not t.is_meta for t in _tensors_of(module))


def _tensors_of(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


@contextlib.contextmanager
def _real_storage(module: nn.Module) -> Iterator[None]:
    """Give the module's meta tensors real storage meanwhile; send them back to meta.

    Tensors that had storage before (sglang shares e.g. rope caches between models of
    one process) are left alone; every other tensor the module holds afterwards,
    materialized here or made by the steps, goes to meta with its shape and dtype.
    """
    already_real = set()
    for owner, attr, tensor in _owned_tensors(module):
        if tensor.is_meta:
            _replace(owner, attr, tensor, _filled_like(attr, tensor))
        else:
            already_real.add(id(tensor))
    try:
        yield
    finally:
        for owner, attr, tensor in _owned_tensors(module):
            if not tensor.is_meta and id(tensor) not in already_real:
                _replace(owner, attr, tensor, meta_like(tensor))


def _owned_tensors(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every (module, attribute, tensor) in the module's tree: parameters, buffers, plain."""
    found = []
    for owner in module.modules():
        for attr, value in list(vars(owner).items()):
            if isinstance(value, torch.Tensor):
                found.append((owner, attr, value))
        for store in (owner._parameters, owner._buffers):
            for attr, value in list(store.items()):
                if value is not None:
                    found.append((owner, attr, value))
    return found


def _filled_like(attr: str, tensor: torch.Tensor) -> torch.Tensor:
    real = torch.empty_strided(
        tensor.shape, tensor.stride(), dtype=tensor.dtype, device=_storage_device()
    )
    real.fill_(1 if "scale" in attr and real.is_floating_point() else 0)
    return real


def _replace(owner: nn.Module, attr: str, old: torch.Tensor, data: torch.Tensor) -> None:
    """Put ``data`` in place of ``old``, keeping a Parameter's object and attributes."""
    if isinstance(old, torch.nn.Parameter):
        repoint(old, data)
    elif attr in owner._buffers:
        owner._buffers[attr] = data
    else:
        setattr(owner, attr, data)
