"""Synthetic models: tiny real configs and deterministic checkpoint tensors.

The configs in ``p2pweights/models/*.json`` are real HF configs of small sizes
(``qwen3-tiny``: hidden 256, 8 heads, 2 kv heads, head dim 32, vocabulary 1000 so
sglang pads it; ``-tied`` variants tie the embeddings; ``qwen3-demo`` is a few
hundred MB in bf16). Tensors are generated per (seed, name), so a trainer and a
checker produce identical values without exchanging them, in any order.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MODEL_NAMES",
    "model_config",
    "write_model_dir",
    "hf_checkpoint_names_and_shapes",
    "synthetic_weights",
    "save_safetensors",
]

MODEL_NAMES = (
    "qwen2-tiny",
    "qwen2-tiny-tied",
    "qwen3-tiny",
    "qwen3-tiny-tied",
    "qwen3-demo",
    "qwen3-moe-tiny",
    "glm4-moe-tiny",
    "glm4-moe-lite-tiny",
    "deepseek-v3-tiny",
    "deepseek-v3-fp8-tiny",
    "qwen3-235b-a22b-full",
    "glm-4.5-air-full",
    "deepseek-v3-full",
    "kimi-k2-full",
)

ConfigLike = str | os.PathLike[str] | Mapping[str, Any]
"""A shipped model name, a folder holding config.json, or the config as a dict."""


def model_config(config: ConfigLike) -> dict[str, Any]:
    """The HF config dict of a shipped name, a model folder, or a dict."""
    if isinstance(config, Mapping):
        return dict(config)
    text = os.fspath(config)
    if text in MODEL_NAMES:
        resource = resources.files("p2pweights").joinpath("models", f"{text}.json")
        loaded: dict[str, Any] = json.loads(resource.read_text())
        return loaded
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{text!r} is neither a shipped model ({', '.join(MODEL_NAMES)}) nor a config file"
        )
    loaded = json.loads(path.read_text())
    return loaded


def write_model_dir(config: ConfigLike, directory: str | os.PathLike[str]) -> Path:
    """Write ``config.json`` into ``directory`` (created) so sglang can use it as model_path."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_config(config), indent=2) + "\n")
    return folder


def _hf_config(config: ConfigLike) -> Any:
    from transformers import AutoConfig

    values = model_config(config)
    return AutoConfig.for_model(**values)


def _config_dtype(values: Mapping[str, Any]) -> torch.dtype:
    name = values.get("torch_dtype") or values.get("dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the model config")
    return dtype


def hf_checkpoint_names_and_shapes(
    config: ConfigLike,
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Checkpoint (safetensors) names, shapes and dtypes of ``config``'s HF model.

    Built on the meta device with transformers. Tied parameters appear once (under
    the first name, as ``save_pretrained`` writes them) and non-persistent buffers
    such as rotary ``inv_freq`` are left out.

    transformers 5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj``
    of shape [experts, 2 x moe_intermediate, hidden]); checkpoints and sglang's
    loaders use one tensor per expert and projection. The fused entries are split
    back into checkpoint names by inverting the model type's own checkpoint
    conversion (``transformers.conversion_mapping``), see ``_unfuse_experts``. A
    checkpoint's multi-token-prediction layers (``num_nextn_predict_layers``, which
    transformers does not model) are appended as DeepSeek-V3 checkpoints name them.
    """
    from transformers import AutoModelForCausalLM

    values = model_config(config)
    dtype = _config_dtype(values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(values), dtype=dtype)
    entries = [(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()]
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name in module._non_persistent_buffers_set or buffer is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            entries.append((full, tuple(buffer.shape), buffer.dtype))
    entries = _unfuse_experts(entries, str(values.get("model_type", "")))
    return entries + _nextn_entries(entries, values)


_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"


def _unfuse_experts(
    entries: list[tuple[str, tuple[int, ...], torch.dtype]], model_type: str
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Split fused expert tensors into per-expert checkpoint names.

    Only the conversion transformers itself applies when loading these model types
    is inverted: ``mlp.experts.*.gate_proj.weight`` and ``*.up_proj.weight`` merged
    over experts (dim 0) then concatenated (dim 1) into ``gate_up_proj``, and
    ``*.down_proj.weight`` merged into ``down_proj``. Any other conversion on a
    fused expert tensor is refused rather than guessed.
    """
    if not any(name.endswith((_FUSED_GATE_UP, _FUSED_DOWN)) for name, _, _ in entries):
        return entries
    _check_expert_conversion(model_type)
    result: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name, shape, dtype in entries:
        if name.endswith(_FUSED_GATE_UP):
            prefix = name[: -len("gate_up_proj")]
            num_experts, rows, cols = shape
            for expert in range(num_experts):
                for proj in ("gate_proj", "up_proj"):
                    result.append((f"{prefix}{expert}.{proj}.weight", (rows // 2, cols), dtype))
        elif name.endswith(_FUSED_DOWN):
            prefix = name[: -len("down_proj")]
            num_experts, rows, cols = shape
            for expert in range(num_experts):
                result.append((f"{prefix}{expert}.down_proj.weight", (rows, cols), dtype))
        else:
            result.append((name, shape, dtype))
    return result


def _check_expert_conversion(model_type: str) -> None:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    expected = {
        ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"): (
            ["mlp.experts.gate_up_proj"],
            ["MergeModulelist", "Concatenate"],
        ),
        ("mlp.experts.*.down_proj.weight",): (["mlp.experts.down_proj"], ["MergeModulelist"]),
    }
    found = {}
    for conversion in get_checkpoint_conversion_mapping(model_type) or []:
        sources = tuple(getattr(conversion, "source_patterns", ()))
        targets = list(getattr(conversion, "target_patterns", ()))
        operations = [type(op).__name__ for op in getattr(conversion, "operations", ())]
        if any("experts" in target for target in targets):
            found[sources] = (targets, operations)
    if found != expected:
        raise ValueError(
            f"transformers fuses the experts of model type {model_type!r} in a way "
            f"p2pweights does not invert ({found}); list its checkpoint names explicitly"
        )


def _nextn_entries(
    entries: list[tuple[str, tuple[int, ...], torch.dtype]], values: Mapping[str, Any]
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The multi-token-prediction layers a DeepSeek-V3 style checkpoint stores.

    Layer ``num_hidden_layers + i`` holds a full (MoE) decoder layer, shaped like the
    last decoder layer, plus ``enorm``, ``hnorm``, ``eh_proj``, its own
    ``embed_tokens`` and ``shared_head`` (norm and head).
    """
    num_nextn = int(values.get("num_nextn_predict_layers") or 0)
    if num_nextn == 0:
        return []
    num_layers = int(values["num_hidden_layers"])
    hidden, vocab = int(values["hidden_size"]), int(values["vocab_size"])
    last = f"model.layers.{num_layers - 1}."
    layer = [
        (name[len(last) :], shape, dtype) for name, shape, dtype in entries if name.startswith(last)
    ]
    dtype = _config_dtype(values)
    extra: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for index in range(num_layers, num_layers + num_nextn):
        prefix = f"model.layers.{index}."
        extra += [(prefix + name, shape, dt) for name, shape, dt in layer]
        extra += [
            (prefix + "embed_tokens.weight", (vocab, hidden), dtype),
            (prefix + "enorm.weight", (hidden,), dtype),
            (prefix + "hnorm.weight", (hidden,), dtype),
            (prefix + "eh_proj.weight", (hidden, 2 * hidden), dtype),
            (prefix + "shared_head.norm.weight", (hidden,), dtype),
            (prefix + "shared_head.head.weight", (vocab, hidden), dtype),
        ]
    return extra


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def synthetic_weights(
    config: ConfigLike, seed: int, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic CPU tensors for every checkpoint name, values fixed by (seed, name).

    Matrices and biases are N(0, 0.02) (sane activations); norm weights are
    1 + N(0, 0.02). ``dtype`` defaults to the config's dtype.
    """
    for name, shape, native in hf_checkpoint_names_and_shapes(config):
        generator = torch.Generator().manual_seed(_seed_of(seed, name))
        values = torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02
        if "norm" in name and name.endswith(".weight"):
            values += 1.0
        yield name, values.to(native if dtype is None else dtype)


def save_safetensors(
    directory: str | os.PathLike[str],
    tensors: Iterable[tuple[str, torch.Tensor]],
    filename: str = "model.safetensors",
) -> Path:
    """Write ``tensors`` as one safetensors file in ``directory``; returns its path."""
    from safetensors.torch import save_file

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    save_file({name: tensor.contiguous() for name, tensor in tensors}, str(path))
    return path
