"""Names, shapes and dtypes of a safetensors checkpoint, from its headers alone.

Read with safetensors' own ``safe_open``: it checks the header (offsets, lengths) and
maps the file without reading a tensor, so the cost is the header's few hundred
kilobytes however large the tensors are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["safetensors_files", "read_header"]


def safetensors_files(folder: Path) -> tuple[list[Path], str]:
    """The files an engine loads from ``folder`` (those its index lists, else all), and
    why none are used when an index names files that cannot be read here."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            return [], f"; {index} is unreadable ({exc})"
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            return [], f"; {len(absent)} file(s) {index.name} lists are not here ({absent[0]}, ...)"
        return files, ""
    files = sorted(folder.glob("*.safetensors"))
    kept = [f for f in files if not f.name.startswith("consolidated")]
    return kept or files, ""


_SAFETENSORS_DTYPES = {
    code: getattr(torch, attr)
    for code, attr in (
        ("BOOL", "bool"),
        ("U8", "uint8"),
        ("I8", "int8"),
        ("U16", "uint16"),
        ("I16", "int16"),
        ("U32", "uint32"),
        ("I32", "int32"),
        ("U64", "uint64"),
        ("I64", "int64"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("F32", "float32"),
        ("F64", "float64"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E8M0", "float8_e8m0fnu"),
    )
    if hasattr(torch, attr)
}


def read_header(file: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor in a safetensors file, from its header.

    Raises:
        ValueError: ``file`` is no readable safetensors file, or holds a dtype torch lacks.
    """
    result = {}
    try:
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118  (safe_open is not iterable)
                entry = tensors.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(entry.get_dtype())
                if dtype is None:
                    raise ValueError(f"{name} in {file.name} has dtype {entry.get_dtype()}")
                result[name] = (dtype, tuple(entry.get_shape()))
    except SafetensorError as exc:
        raise ValueError(f"{file.name} is not a readable safetensors file ({exc})") from exc
    return result
