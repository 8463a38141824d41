"""The checkpoint an HF config describes: tensor names, shapes and dtypes, from transformers.

The config's transformers model class is built on the meta device (no memory, no
initialisation; a fraction of a second even for DeepSeek-V3 sized configs, because
transformers 5 keeps each layer's experts in two fused tensors). What it holds is
then named as checkpoints, and sglang's loaders, name it:

* tied parameters appear once, under the first name (as ``save_pretrained`` writes
  them); the other names are kept apart as aliases (``lm_head.weight``);
* non-persistent buffers such as rotary ``inv_freq`` are left out;
* fused experts (``mlp.experts.gate_up_proj`` of shape [experts, 2 x moe_intermediate,
  hidden]) are split back into one tensor per expert and projection by inverting the
  model type's own checkpoint conversion (``transformers.conversion_mapping``); any
  other conversion (a renaming, another fusion) is refused rather than guessed;
* multi-token-prediction layers (``num_nextn_predict_layers``, which transformers does
  not model) are appended as DeepSeek-V3 checkpoints name them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from p2pweights.errors import ConfigError

__all__ = ["CheckpointTensor", "ConfigCheckpoint", "config_checkpoint", "config_dtype"]


class CheckpointTensor(NamedTuple):
    """One tensor of the checkpoint a config describes (a tuple: tens of thousands are made)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    linear: bool = False
    """The weight of a linear layer or of one expert's projection (what block-fp8
    checkpoints quantize); the output embedding is not one."""
    keep_fp32: bool = False
    """The model class keeps it in float32 whatever the model's dtype
    (``_keep_in_fp32_modules``, e.g. DeepSeek's ``e_score_correction_bias``)."""


@dataclass(frozen=True)
class ConfigCheckpoint:
    """What :func:`config_checkpoint` derives."""

    model_class: str
    """The transformers class that was built, e.g. ``DeepseekV3ForCausalLM``."""
    tensors: list[CheckpointTensor]
    """Checkpoint tensors in ``save_pretrained`` order, MTP layers last."""
    aliases: dict[str, str]
    """Tied names left out of ``tensors`` -> the name they share storage with."""


def config_dtype(values: Mapping[str, Any]) -> torch.dtype:
    """The config's ``torch_dtype`` (or ``dtype``); float32 when it names none."""
    name = values.get("torch_dtype") or values.get("dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r} in the model config")
    return dtype


def config_checkpoint(values: Mapping[str, Any]) -> ConfigCheckpoint:
    """Checkpoint tensors of the HF config ``values``, from its transformers model on meta.

    Raises ``ConfigError`` when transformers stores this model in memory under names
    p2pweights cannot turn back into checkpoint names; whatever transformers raises
    for a config it cannot build (e.g. an unknown model type) passes through.
    """
    dtype = config_dtype(values)
    model = _meta_model(values, dtype)
    keep_fp32 = _keep_fp32_pattern(model)
    output = model.get_output_embeddings()
    linear_weights = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module is not output
    }
    tensors = [
        CheckpointTensor(
            name,
            tuple(param.shape),
            param.dtype,
            linear=id(param) in linear_weights,
            keep_fp32=bool(keep_fp32 and keep_fp32.search(name)),
        )
        for name, param in model.named_parameters()
    ]
    canonical = {id(param): name for name, param in model.named_parameters()}
    aliases = {
        name: canonical[id(param)]
        for name, param in model.named_parameters(remove_duplicate=False)
        if canonical[id(param)] != name
    }
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name in module._non_persistent_buffers_set or buffer is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            fp32 = bool(keep_fp32 and keep_fp32.search(full))
            tensors.append(CheckpointTensor(full, tuple(buffer.shape), buffer.dtype, False, fp32))
    tensors = _unfuse_experts(tensors, _conversions(model))
    tensors += _nextn_tensors(tensors, values)
    return ConfigCheckpoint(type(model).__name__, tensors, aliases)


def architecture_model_type(values: Mapping[str, Any]) -> str | None:
    """The model type transformers knows for ``values``' architecture, where its own
    ``model_type`` is one transformers does not know (a remote-code type such as Kimi-K2's
    ``kimi_k2``, whose ``DeepseekV3ForCausalLM`` is what sglang serves); None where
    transformers knows the model type, or knows none of the architectures."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if values.get("model_type") in CONFIG_MAPPING:
        return None
    for architecture in values.get("architectures") or ():
        cls = getattr(transformers, architecture, None)
        config_class = getattr(cls, "config_class", None)
        model_type = getattr(config_class, "model_type", None)
        if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
            return model_type
    return None


def _meta_model(values: Mapping[str, Any], dtype: torch.dtype) -> Any:
    """The config's architecture (else the causal-LM class of its model type) on meta; a
    model type transformers does not know is read as its architecture's
    (``architecture_model_type``)."""
    import transformers

    model_type = architecture_model_type(values)
    if model_type is not None:
        values = {k: v for k, v in values.items() if k != "auto_map"}
        values["model_type"] = model_type
    hf_config = transformers.AutoConfig.for_model(**values)
    with torch.device("meta"):
        for architecture in values.get("architectures") or ():
            cls = getattr(transformers, architecture, None)
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
                return cls._from_config(hf_config, dtype=dtype)
        return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def _keep_fp32_pattern(model: Any) -> re.Pattern[str] | None:
    """Names the model class keeps in float32, matched as transformers matches them."""
    modules: set[str] = set()
    for attribute in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        modules |= set(getattr(model, attribute, None) or ())
    if not modules:
        return None
    return re.compile("|".join(rf"(^|\.){re.escape(m)}($|\.)" for m in sorted(modules)))


_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"
_KNOWN_CONVERSIONS = {
    (
        ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
        (_FUSED_GATE_UP,),
        ("MergeModulelist", "Concatenate"),
    ),
    (("mlp.experts.*.down_proj.weight",), (_FUSED_DOWN,), ("MergeModulelist",)),
}
"""The only conversions inverted: experts merged over dim 0 (and gate/up concatenated on
dim 1), as transformers 5 loads Qwen-MoE, GLM-4.5 and DeepSeek-V3 checkpoints."""


def _conversions(model: Any) -> set[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    """(sources, targets, operations) of every conversion transformers applies on loading."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: the model holds checkpoint names
        return set()
    return {
        (
            tuple(getattr(conversion, "source_patterns", ())),
            tuple(getattr(conversion, "target_patterns", ())),
            tuple(type(op).__name__ for op in getattr(conversion, "operations", ())),
        )
        for conversion in get_model_conversion_mapping(model, add_legacy=False)
    }


def _unfuse_experts(
    tensors: list[CheckpointTensor],
    conversions: set[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]],
) -> list[CheckpointTensor]:
    """Split fused expert tensors into per-expert checkpoint names."""
    unknown = conversions - _KNOWN_CONVERSIONS
    fused = any(t.name.endswith((_FUSED_GATE_UP, _FUSED_DOWN)) for t in tensors)
    if unknown or (fused and conversions != _KNOWN_CONVERSIONS):
        raise ConfigError(
            f"transformers converts this model's checkpoint names in a way p2pweights does "
            f"not invert ({sorted(unknown or conversions)}); the checkpoint's tensors cannot "
            f"be derived from its config"
        )
    result: list[CheckpointTensor] = []
    for tensor in tensors:
        if tensor.name.endswith(_FUSED_GATE_UP):
            prefix = tensor.name[: -len("gate_up_proj")]
            num_experts, rows, cols = tensor.shape
            for expert in range(num_experts):
                for proj in ("gate_proj", "up_proj"):
                    name = f"{prefix}{expert}.{proj}.weight"
                    result.append(CheckpointTensor(name, (rows // 2, cols), tensor.dtype, True))
        elif tensor.name.endswith(_FUSED_DOWN):
            prefix = tensor.name[: -len("down_proj")]
            num_experts, rows, cols = tensor.shape
            for expert in range(num_experts):
                name = f"{prefix}{expert}.down_proj.weight"
                result.append(CheckpointTensor(name, (rows, cols), tensor.dtype, True))
        else:
            result.append(tensor)
    return result


def _nextn_tensors(
    tensors: list[CheckpointTensor], values: Mapping[str, Any]
) -> list[CheckpointTensor]:
    """The multi-token-prediction layers a DeepSeek-V3 style checkpoint stores.

    Layer ``num_hidden_layers + i`` holds a full (MoE) decoder layer, shaped like the
    last decoder layer, plus ``enorm``, ``hnorm``, ``eh_proj``, its own
    ``embed_tokens`` and ``shared_head`` (norm and head); ``eh_proj`` and the head are
    never quantized.
    """
    num_nextn = int(values.get("num_nextn_predict_layers") or 0)
    if num_nextn == 0:
        return []
    num_layers = int(values["num_hidden_layers"])
    hidden, vocab = int(values["hidden_size"]), int(values["vocab_size"])
    last = f"model.layers.{num_layers - 1}."
    layer = [t for t in tensors if t.name.startswith(last)]
    dtype = config_dtype(values)
    extra: list[CheckpointTensor] = []
    for index in range(num_layers, num_layers + num_nextn):
        prefix = f"model.layers.{index}."
        extra += [t._replace(name=prefix + t.name[len(last) :]) for t in layer]
        extra += [
            CheckpointTensor(prefix + "embed_tokens.weight", (vocab, hidden), dtype),
            CheckpointTensor(prefix + "enorm.weight", (hidden,), dtype),
            CheckpointTensor(prefix + "hnorm.weight", (hidden,), dtype),
            CheckpointTensor(prefix + "eh_proj.weight", (hidden, 2 * hidden), dtype),
            CheckpointTensor(prefix + "shared_head.norm.weight", (hidden,), dtype),
            CheckpointTensor(prefix + "shared_head.head.weight", (vocab, hidden), dtype),
        ]
    return extra
