"""What the engine's checkpoint holds, and the first update checked against it.

The first update fixes what every later update must send (``inputs.check_input``), so
it is checked, before any byte moves, against the checkpoint the engine's config
describes: each HF name must be one of the checkpoint's, with its shape and dtype. The
checkpoint is read from the first of these that works:

1. the safetensors headers next to ``config.json`` (``model.safetensors.index.json``
   and the files it lists, else every ``*.safetensors`` file); headers only, never
   tensor data;
2. the config's transformers model class on the meta device (``config_checkpoint``).

Accepted besides the checkpoint's own dtype:

* block-fp8 checkpoints: a quantized weight in the model's dtype (p2pweights quantizes
  it), or ``float8_e4m3fn`` together with ``<name>_scale_inv`` (float32, block scales);
* a tensor the checkpoint keeps in float32 in a lower-precision model (routing biases
  such as ``e_score_correction_bias``): also the model's dtype, and the other way round;
* ``engine_dtype`` (sglang ``--dtype``) wherever the model's dtype is accepted;
* tied embeddings: ``lm_head.weight``, not stored, but accepted in the embedding's shape;
* rotary buffers (``rotary_emb.inv_freq``), which sglang's loaders skip.

Nothing is required here: tensors the loaders need but did not get are reported by
the grouping (``GroupCollector``), and ``ExpectedCheckpoint.missing`` lists the names an
update lacks. When neither source works (no readable headers, and a config that
transformers cannot build or quantized other than block fp8), ``unchecked`` says why
and the first update is let through with a warning.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from p2pweights.bounded_cache import LruCache
from p2pweights.errors import ConfigError
from p2pweights.source.config_checkpoint import config_checkpoint, config_dtype
from p2pweights.source.finite import check_finite
from p2pweights.source.fp8_block import FP8, SCALE_SUFFIX, BlockFp8Format
from p2pweights.source.inputs import InputSpec
from p2pweights.source.safetensors_header import read_header, safetensors_files

__all__ = [
    "ExpectedTensor",
    "ExpectedCheckpoint",
    "expected_checkpoint",
    "check_first_update",
    "check_finite",
    "engine_dtype",
]

logger = logging.getLogger(__name__)

MAX_NAMED = 8
"""Problems named in one error; the rest are counted."""
_IGNORED = re.compile(r"(^|\.)rotary_emb\.")
_LAYER = re.compile(r"^((?:.*?\.)?layers)\.(\d+)\.")
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ExpectedTensor:
    """One checkpoint tensor, as a trainer may send it."""

    shape: tuple[int, ...]
    dtypes: frozenset[torch.dtype]
    """The dtypes it may arrive in (quantized fp8 aside, see ``scale_shape``)."""
    scale_shape: tuple[int, ...] | None = None
    """A block-fp8 weight: it may also arrive as float8_e4m3fn, with ``<name>_scale_inv``
    in float32 of this shape."""
    optional: bool = False
    """Not stored on its own (a tied ``lm_head.weight``): accepted, never missing."""


@dataclass(frozen=True, eq=False)
class ExpectedCheckpoint:
    """The tensors an engine's checkpoint holds, and where that was read."""

    tensors: Mapping[str, ExpectedTensor]
    source: str
    """Where the names come from, for error messages."""
    model_dtype: torch.dtype
    """The config's ``torch_dtype``."""
    num_hidden_layers: int | None = None
    num_nextn_layers: int = 0
    unchecked: str | None = None
    """Why the checkpoint could not be derived; set, nothing is checked."""

    def missing(self, names: Collection[str]) -> list[str]:
        """Checkpoint names not in ``names`` (the loaders may not need all of them)."""
        return sorted(n for n, t in self.tensors.items() if not t.optional and n not in names)

    @cached_property
    def layers(self) -> dict[str, list[int]]:
        """Layer indices under each ``...layers`` prefix (``model.layers`` -> 0..N-1)."""
        found: dict[str, set[int]] = {}
        for name in self.tensors:
            match = _LAYER.match(name)
            if match:
                found.setdefault(match.group(1), set()).add(int(match.group(2)))
        return {prefix: sorted(indices) for prefix, indices in found.items()}

    @cached_property
    def templates(self) -> dict[str, list[str]]:
        """Names with their indices as ``*`` -> the names of that form."""
        found: dict[str, list[str]] = {}
        for name in self.tensors:
            found.setdefault(_INDEX.sub("*", name), []).append(name)
        return found


CACHE_SIZE = 16
"""Checkpoints kept (least recently used dropped): one per model a process updates,
with room for a few config revisions."""
_CACHE: LruCache[Hashable, ExpectedCheckpoint] = LruCache(CACHE_SIZE)
_CACHE_LOCK = threading.Lock()


def expected_checkpoint(model_path: str | os.PathLike[str]) -> ExpectedCheckpoint:
    """The checkpoint of the model folder (or config.json) an engine was started from.

    Cached per config content (and per safetensors file, size and mtime when the
    headers are read), so asking for every engine of one model costs one derivation;
    the ``CACHE_SIZE`` most recently used are kept.
    """
    path = Path(model_path)
    config_file = path / "config.json" if path.is_dir() else path
    try:
        text = config_file.read_bytes()
        values = json.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read the engine's model config {str(config_file)!r}: {exc}; pass "
            f"EngineEndpoint(url, model_path=<local folder or config.json of the same model>)"
        ) from exc
    digest = hashlib.sha256(text).hexdigest()
    files, note = safetensors_files(config_file.parent)
    key: Hashable = ("config", digest, note)
    if files:
        stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        key = ("headers", digest, stats)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        if cached is None:
            cached = _CACHE[key] = _derive(values, config_file, files, note)
    return cached


def _derive(
    values: dict[str, Any], config_file: Path, files: list[Path], note: str
) -> ExpectedCheckpoint:
    # The garbage collector stays on here: switching it off is process-wide (every
    # thread of the trainer) and bought little. DeepSeek-V3 (46,183 tensors), median of
    # 3 on a 2-core host: 4.4 s with it, 3.0 s without in a bare process; 3.7 s either
    # way with 4 million live objects on the heap, as a trainer has (full collections
    # then come rarely). Once per model: the result is cached.
    if files:
        try:
            return _from_headers(values, config_file.parent, files)
        except (OSError, ValueError, KeyError) as exc:
            note = f"; the safetensors headers in {config_file.parent} are unreadable ({exc})"
    return _from_config(values, config_file, note)


def _from_headers(values: dict[str, Any], folder: Path, files: list[Path]) -> ExpectedCheckpoint:
    headers: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for file in files:
        headers.update(read_header(file))
    model_dtype = config_dtype(values)
    fmt = BlockFp8Format.from_quantization_config(values.get("quantization_config"))
    tensors: dict[str, ExpectedTensor] = {}
    for name, (dtype, shape) in headers.items():
        scale = headers.get(name + SCALE_SUFFIX)
        weight = headers.get(name.removesuffix(SCALE_SUFFIX))
        if name.endswith(SCALE_SUFFIX) and weight is not None and weight[0] == FP8:
            continue  # described with its weight
        if dtype == FP8 and scale is not None:
            high = frozenset({model_dtype}) if fmt is not None else frozenset()
            tensors[name] = ExpectedTensor(shape, high, scale_shape=scale[1])
        else:
            tensors[name] = ExpectedTensor(shape, _dtypes(dtype, model_dtype))
    embedding = min((n for n in tensors if n.endswith("embed_tokens.weight")), key=len, default="")
    if values.get("tie_word_embeddings", True) and embedding and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = replace(tensors[embedding], optional=True)
    return ExpectedCheckpoint(
        tensors,
        f"the safetensors headers of {folder} ({len(files)} file(s))",
        model_dtype,
        *_layer_counts(values),
    )


def _from_config(values: dict[str, Any], config_file: Path, note: str) -> ExpectedCheckpoint:
    model_dtype = config_dtype(values)
    quantization = values.get("quantization_config")
    fmt = BlockFp8Format.from_quantization_config(quantization)
    if quantization and fmt is None:
        reason = (
            f"the checkpoint is quantized ({quantization.get('quant_method')!r}), its tensors "
            f"are not derivable from {config_file}, and no safetensors headers are readable "
            f"next to it{note}"
        )
        return ExpectedCheckpoint({}, str(config_file), model_dtype, unchecked=reason)
    try:
        derived = config_checkpoint(values)
    except Exception as exc:  # transformers cannot build it: unknown type, remote code, ...
        logger.debug("no checkpoint derivable from %s", config_file, exc_info=True)
        said = str(exc).split(". Should contain one of")[0]  # not transformers' 10 kB list
        reason = f"transformers cannot describe the model of {config_file} ({said}){note}"
        return ExpectedCheckpoint({}, str(config_file), model_dtype, unchecked=reason)
    skipped = _not_converted(quantization)
    tensors: dict[str, ExpectedTensor] = {}
    shared: dict[Hashable, ExpectedTensor] = {}  # tens of thousands of experts, few kinds
    for t in derived.tensors:
        quantized = fmt is not None and t.linear and len(t.shape) == 2
        if quantized and skipped is not None:
            quantized = not skipped.search(t.name.removesuffix(".weight"))
        key = (t.shape, t.dtype, t.keep_fp32, quantized)
        tensor = shared.get(key)
        if tensor is None:
            tensor = shared[key] = ExpectedTensor(
                t.shape,
                _dtypes(t.dtype, model_dtype, t.keep_fp32),
                scale_shape=fmt.scale_shape(t.shape) if fmt is not None and quantized else None,
            )
        tensors[t.name] = tensor
    for alias, name in derived.aliases.items():
        tensors[alias] = replace(tensors[name], optional=True)
    source = f"transformers {derived.model_class} built on the meta device from {config_file}"
    return ExpectedCheckpoint(tensors, source + note, model_dtype, *_layer_counts(values))


def _dtypes(
    dtype: torch.dtype, model_dtype: torch.dtype, keep_fp32: bool = False
) -> frozenset[torch.dtype]:
    """``dtype``; float32-kept tensors of a bf16/fp16 model also in the model's dtype."""
    if model_dtype in _LOW_PRECISION and (keep_fp32 or dtype == torch.float32):
        return frozenset({dtype, torch.float32, model_dtype})
    return frozenset({dtype})


def _not_converted(quantization: Mapping[str, Any] | None) -> re.Pattern[str] | None:
    """Modules a quantization config leaves in high precision."""
    names = [
        *((quantization or {}).get("modules_to_not_convert") or ()),
        *((quantization or {}).get("ignored_layers") or ()),
    ]
    if not names:
        return None
    return re.compile("|".join(rf"(^|\.){re.escape(n)}($|\.)" for n in names))


def _layer_counts(values: Mapping[str, Any]) -> tuple[int | None, int]:
    layers = values.get("num_hidden_layers")
    return (int(layers) if layers is not None else None), int(
        values.get("num_nextn_predict_layers") or 0
    )


def engine_dtype(server_args_dtype: str | None) -> torch.dtype | None:
    """The dtype an engine runs in from sglang's ``--dtype`` (None for ``auto``)."""
    aliases = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
    if server_args_dtype in (None, "", "auto"):
        return None
    name = aliases.get(str(server_args_dtype), str(server_args_dtype))
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"the engine runs in dtype {server_args_dtype!r}, unknown to torch")
    return dtype


def check_first_update(
    specs: Mapping[str, InputSpec],
    expected: ExpectedCheckpoint,
    *,
    engine_dtype: torch.dtype | None = None,
) -> None:
    """Raise ``ConfigError`` naming every HF tensor the checkpoint does not hold as sent.

    ``specs`` is the first update (``describe_inputs``); ``engine_dtype`` the engine's
    sglang ``--dtype`` when it overrides the config's. Up to ``MAX_NAMED`` problems are
    named, the rest counted.
    """
    if expected.unchecked is not None:
        logger.warning(
            "the first update is not checked against a checkpoint: %s", expected.unchecked
        )
        return
    problems = []
    for name, spec in specs.items():
        problem = _problem(name, spec, specs, expected, engine_dtype)
        if problem is not None:
            problems.append(problem)
    if not problems:
        return
    more = len(problems) - MAX_NAMED
    raise ConfigError(
        f"{len(problems)} HF tensor(s) of the first update do not match the engine's "
        f"checkpoint ({expected.source}); nothing was sent:\n  "
        + "\n  ".join(problems[:MAX_NAMED])
        + (f"\n  and {more} more" if more > 0 else "")
        + "\nSend the checkpoint's names, shapes and dtypes: the first update fixes what "
        "every later update must send."
    )


def _problem(
    name: str,
    spec: InputSpec,
    specs: Mapping[str, InputSpec],
    expected: ExpectedCheckpoint,
    engine_dtype: torch.dtype | None,
) -> str | None:
    tensor = expected.tensors.get(name)
    if tensor is None:
        weight = expected.tensors.get(name.removesuffix(SCALE_SUFFIX))
        if name.endswith(SCALE_SUFFIX) and weight is not None and weight.scale_shape is not None:
            return _scale_problem(name, spec, weight, specs, expected.model_dtype)
        return None if _IGNORED.search(name) else _unknown(name, expected)
    wrong = []
    if spec.dtype == FP8 and tensor.scale_shape is not None:
        if name + SCALE_SUFFIX not in specs:
            wrong.append(
                f"is float8_e4m3fn without its block scales {name + SCALE_SUFFIX!r} (float32 "
                f"{list(tensor.scale_shape)}); send them with it, or send the weight in "
                f"{_dtype_name(expected.model_dtype)} for p2pweights to quantize"
            )
    else:
        accepted = set(tensor.dtypes)
        if engine_dtype is not None and expected.model_dtype in accepted:
            accepted.add(engine_dtype)
        if spec.dtype not in accepted:
            wrong.append(f"is {_dtype_name(spec.dtype)}, expected {_expected_dtypes(tensor)}")
    if spec.shape != tensor.shape:
        wrong.append(_shape_problem(spec.shape, tensor.shape))
    return f"{name!r} " + "; ".join(wrong) if wrong else None


def _scale_problem(
    name: str,
    spec: InputSpec,
    weight: ExpectedTensor,
    specs: Mapping[str, InputSpec],
    model_dtype: torch.dtype,
) -> str | None:
    base = name.removesuffix(SCALE_SUFFIX)
    sent = specs.get(base)
    if sent is None:
        return f"{name!r} came without its weight {base!r}"
    if sent.dtype != FP8:
        return (
            f"{name!r} came with {base!r} in {_dtype_name(sent.dtype)}: send the weight "
            f"quantized (float8_e4m3fn) with its scales, or alone in "
            f"{_dtype_name(model_dtype)} for p2pweights to quantize"
        )
    assert weight.scale_shape is not None
    wrong = []
    if spec.dtype != torch.float32:
        wrong.append(f"is {_dtype_name(spec.dtype)}, expected float32")
    if spec.shape != weight.scale_shape:
        wrong.append(
            _shape_problem(spec.shape, weight.scale_shape)
            + f" (the block scales of a {list(weight.shape)} weight)"
        )
    return f"{name!r} " + "; ".join(wrong) if wrong else None


def _unknown(name: str, expected: ExpectedCheckpoint) -> str:
    match = _LAYER.match(name)
    if match and match.group(1) in expected.layers:
        prefix, index = match.group(1), int(match.group(2))
        indices = expected.layers[prefix]
        if index not in indices:
            return (
                f"{name!r} is in layer {index}, which the model does not have: the checkpoint "
                f"has {prefix}.{{{_ranges(indices)}}}{_layer_note(expected)}"
            )
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return (
            f"{name!r} is transformers' fused in-memory tensor; send the checkpoint's names, "
            f"one tensor per expert and projection (mlp.experts.<i>.gate_proj.weight, ...)"
        )
    template = _INDEX.sub("*", name)
    same_form = expected.templates.get(template)
    if same_form:
        return f"{name!r} is not in the checkpoint, which has {_describe(template, same_form)}"
    close = difflib.get_close_matches(template, list(expected.templates), n=1, cutoff=0.6)
    if close:
        numbers = iter(_INDEX.findall(name))
        guess = re.sub(r"\*", lambda _: next(numbers, "0"), close[0])
        if guess not in expected.tensors:
            guess = expected.templates[close[0]][0]
        return f"{name!r} is not a tensor of the checkpoint; did you mean {guess!r}?"
    examples = ", ".join(repr(n) for n in list(expected.tensors)[:3])
    return f"{name!r} is not a tensor of the checkpoint (whose names are like {examples})"


def _layer_note(expected: ExpectedCheckpoint) -> str:
    if expected.num_hidden_layers is None:
        return ""
    note = f"num_hidden_layers={expected.num_hidden_layers}"
    if expected.num_nextn_layers:
        note += f", then {expected.num_nextn_layers} multi-token-prediction layer(s)"
    return f" ({note})"


def _describe(template: str, names: list[str]) -> str:
    """``model.layers.{1-2}.mlp.experts.{0-7}.gate_proj.weight`` for a template's names."""
    positions: list[set[int]] = [set() for _ in range(template.count("*"))]
    for name in names:
        for position, number in zip(positions, _INDEX.findall(name), strict=True):
            position.add(int(number))
    ranges = iter("{" + _ranges(sorted(p)) + "}" for p in positions)
    return re.sub(r"\*", lambda _: next(ranges), template)


def _ranges(indices: list[int]) -> str:
    """``0-2,5`` for [0, 1, 2, 5]."""
    parts: list[str] = []
    start = previous = indices[0]
    for index in [*indices[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if index is not None:
            start = previous = index
    return ",".join(parts)


def _shape_problem(got: tuple[int, ...], want: tuple[int, ...]) -> str:
    text = f"has shape {list(got)}, expected {list(want)}"
    if len(got) != len(want):
        return text + f" ({len(got)} dimensions instead of {len(want)})"
    units = {1: ["element"], 2: ["row", "column"]}.get(len(want))
    details = []
    for dim, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            count = abs(g - w)
            unit = units[dim] + "s" * (count != 1) if units else f"entries along dim {dim}"
            details.append(f"{count} {'extra' if g > w else 'missing'} {unit}")
    return text + f" ({', '.join(details)})"


def _expected_dtypes(tensor: ExpectedTensor) -> str:
    names = sorted(_dtype_name(d) for d in tensor.dtypes)
    if tensor.scale_shape is not None:
        names.append(f"float8_e4m3fn with its {SCALE_SUFFIX} scales")
    elif not names:
        return "float8_e4m3fn"
    return " or ".join(names)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
