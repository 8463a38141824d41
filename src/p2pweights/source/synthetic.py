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
    "glm-5-full",
)

ConfigLike = str | os.PathLike[str] | Mapping[str, Any]
"""A shipped model name, a folder holding config.json, or the config as a dict."""


def model_config(config: ConfigLike) -> dict[str, Any]:
    """The HF config dict of a shipped model, a model folder, or a dict.

    Args:
        config: A name in ``MODEL_NAMES``, a folder holding ``config.json``, the path of a
            config file, or a config dict (copied).

    Returns:
        The config as a dict.

    Raises:
        ValueError: ``config`` is neither a shipped model nor a config file.
    """
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
    """Write ``config.json`` into ``directory`` so sglang can use it as model_path.

    Args:
        config: As for ``model_config``.
        directory: The folder (created if missing).

    Returns:
        The folder.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_config(config), indent=2) + "\n")
    return folder


def hf_checkpoint_names_and_shapes(
    config: ConfigLike,
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Checkpoint (safetensors) names, shapes and dtypes of ``config``'s HF model.

    The library's derivation (``p2pweights.source.config_checkpoint``: transformers on
    the meta device, fused experts split per expert, MTP layers appended) without the
    tied aliases: a tied ``lm_head.weight`` is not listed, as ``save_pretrained`` does
    not write it.

    Args:
        config: As for ``model_config``.

    Returns:
        ``(name, shape, dtype)`` per checkpoint tensor.
    """
    from p2pweights.source.config_checkpoint import config_checkpoint

    return [(t.name, t.shape, t.dtype) for t in config_checkpoint(model_config(config)).tensors]


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def synthetic_weights(
    config: ConfigLike, seed: int, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic CPU tensors for every checkpoint name, values fixed by (seed, name).

    Matrices and biases are N(0, 0.02) (sane activations); norm weights are
    1 + N(0, 0.02). A ``p2pweights engine --seed S`` engine starts from these tensors.

    Args:
        config: As for ``model_config``.
        seed: Fixes the values, with each tensor's name.
        dtype: The tensors' dtype (default: the config's).

    Yields:
        ``(checkpoint name, tensor)`` pairs, in checkpoint order.
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
    """Write ``tensors`` as one safetensors file in ``directory``.

    Args:
        directory: The folder (created if missing).
        tensors: ``(name, tensor)`` pairs.
        filename: The file's name.

    Returns:
        The file's path.
    """
    from safetensors.torch import save_file

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    save_file({name: tensor.contiguous() for name, tensor in tensors}, str(path))
    return path
