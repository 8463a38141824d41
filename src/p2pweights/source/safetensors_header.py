"""Names, shapes and dtypes of a safetensors checkpoint, from its headers alone.

A safetensors file starts with the length of its JSON header (8 bytes, little
endian), then the header: name -> dtype, shape and byte offsets. Reading it costs a
few hundred kilobytes per file however large the tensors are.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

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
    """Name -> (dtype, shape) from a safetensors file's JSON header (8-byte length first)."""
    with open(file, "rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8))
        if length > 1 << 28:
            raise ValueError(f"{file.name} is not a safetensors file")
        header = json.loads(stream.read(length))
    header.pop("__metadata__", None)
    result = {}
    for name, entry in header.items():
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{name} in {file.name} has dtype {entry['dtype']}")
        result[name] = (dtype, tuple(int(d) for d in entry["shape"]))
    return result
