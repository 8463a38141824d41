"""A Megatron rank's own slice of each HF tensor, where megatron-bridge's export only
concatenates the ranks' tensors to make it (owner sends, ``MegatronExport.owned_views``).

Newer megatron-bridge releases describe such views themselves
(``MegatronParamMapping.local_hf_params``). The bridge the integrations pin (0.3) has no
such call; ``derived_view`` reads the same thing off the mapping's class, reproducing what
that class's ``megatron_to_hf`` does with no conversion of values:

* ``ColumnParallelMapping``: the tensor-parallel ranks' tensors concatenated along dim 0,
  so this rank holds rows ``[tp_rank * n, (tp_rank + 1) * n)`` (``Shard(0)``);
* ``RowParallelMapping``: concatenated along dim 1 (``Shard(1)``); a 1-D bias is not split;
* ``ReplicatedMapping`` / ``DirectMapping``: the tensor whole;
* ``AutoMapping`` (that class exactly, no ``permute_dims``): one of the three, as the
  bridge's own detection picks it from the Megatron module.

For an expert parameter the tensor-parallel group is the expert-tensor-parallel one (the
mapping's ``tp_rank`` / ``tp_size`` say so), and the HF name carries the global expert
number (the bridge resolves the mapping from the parameter's global name).

Anything else has no view and goes through the bridge's gathered export: fused QKV and
gate/up (interleaved), subclasses of these mappings (they may compute on values, e.g.
zero-centred norms), permutes, LoRA-wrapped weights, fp8 or other tensor subclasses, a
model bridge that post-processes converted tensors (``maybe_modify_converted_hf_weight``:
DeepSeek-V3, gpt-oss, Qwen3-VL in 0.3), the embedding when it is tied to the output layer
(the export also yields it as ``lm_head.weight``), an embedding or output layer whose
vocabulary Megatron padded (its rows are not the checkpoint's), and the experts of
megatron-core's ``SequentialMLP`` under expert parallelism (bridge 0.3 names them by their
local number there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LocalView", "derived_view", "derives_views"]


@dataclass(frozen=True)
class LocalView:
    """One HF tensor as this rank holds it: whole (``shard`` None) or one slice."""

    name: str
    tensor: torch.Tensor
    shard: tuple[int, int, int] | None
    """(dim, start, full size) of this rank's slice; None: the whole tensor."""
    expert: bool
    """An expert's tensor: held by its expert-parallel rank only."""


def derives_views(bridge: Any) -> bool:
    """Whether the bridge's export is its mappings' ``megatron_to_hf`` and nothing after
    (its model bridge keeps the base ``maybe_modify_converted_hf_weight``)."""
    try:
        from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

        model_bridge = bridge._model_bridge  # AutoBridge's model bridge of its architecture
    except (ImportError, AttributeError, ValueError):
        return False
    base = MegatronModelBridge.maybe_modify_converted_hf_weight
    return getattr(type(model_bridge), "maybe_modify_converted_hf_weight", None) is base


def derived_view(task: Any, *, tied: bool, vocab_size: int | None) -> LocalView | None:
    """The local view of one conversion task's parameter, or None (gathered export)."""
    from megatron.bridge.models.conversion import param_mapping as pm

    mapping, weight, module = task.mapping, task.param_weight, task.megatron_module
    name = mapping.hf_param
    if module is None or not isinstance(name, str) or not _plain(weight):
        return None
    if "to_wrap." in task.global_param_name or mapping.is_adapter:
        return None
    kind = {
        pm.ColumnParallelMapping: "column",
        pm.RowParallelMapping: "row",
        pm.ReplicatedMapping: "replicated",
        pm.DirectMapping: "replicated",
    }.get(type(mapping))
    if type(mapping) is pm.AutoMapping and mapping.permute_dims is None:
        kind = mapping._detect_parallelism_type(module)
    if kind is None:
        return None
    if mapping.is_expert and ".local_experts." in mapping.megatron_param and mapping.ep_size > 1:
        return None
    vocabulary = task.global_param_name in _VOCAB_PARAMS
    if vocabulary and tied:
        return None
    tensor = weight.detach()
    dim = {"column": 0, "row": 1}.get(kind)
    if dim is not None and (mapping.tp_size == 1 or tensor.dim() <= dim):
        dim = None  # not split: a row-parallel bias, or no tensor parallelism
    full = tensor.shape[0] * (mapping.tp_size if dim == 0 else 1)
    if vocabulary and full != vocab_size:
        return None
    if dim is None:
        return LocalView(name, tensor, None, mapping.is_expert)
    size = tensor.shape[dim]
    shard = (dim, mapping.tp_rank * size, size * mapping.tp_size)
    return LocalView(name, tensor, shard, mapping.is_expert)


_VOCAB_PARAMS = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})


def _plain(weight: Any) -> bool:
    """A plain tensor (not fp8, not a DTensor): what the mapping would concatenate as is."""
    return type(weight) in (torch.Tensor, torch.nn.Parameter) and type(weight.data) is torch.Tensor
