"""The ``p2pweights plan`` command's inputs, built without engines or GPUs.

For every ``--engine`` layout, sglang resolves the server args as a server started with
them would (``replica.sglang.facade.resolved_server_info``; this publishes sglang's server
args process-wide, which only the CLI process does), then each engine rank's replica is
built on the meta device: the replicas are the only source of truth for what a rank
holds. Each rank's parameters become one group of a byte plan, written to a stand-in
publication of exactly the replica's sizes, so the bytes per rank are the byte plan's
(``plan.byte_plan``), as an update computes them. ``plan.cluster`` then assigns writers
and costs the update.

What the replicas do not say is estimated from the checkpoint the config describes
(``source.expected``): the bytes a broadcast sends (the whole checkpoint, fp8 where the
checkpoint is), and, for the predicted time only, how many HF tensors each rank's
loaders read (its own experts' and every other tensor).
"""

from __future__ import annotations

import logging
import math
import re
import tempfile
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from p2pweights.errors import ConfigError, EngineError
from p2pweights.plan.byte_plan import aligned, build_byte_plan
from p2pweights.plan.cluster import (
    ClusterPlan,
    EngineLoad,
    RankLoad,
    pipeline_stage_of,
    plan_cluster,
)
from p2pweights.plan.cost import LinkModel, PipelineModel
from p2pweights.replica.ranks import RankSpec
from p2pweights.source.expected import ExpectedCheckpoint
from p2pweights.wire.publication import RankPublication, WeightRegion

__all__ = ["EngineSpec", "parse_engine_spec", "model_folder", "build_cluster_plan"]

logger = logging.getLogger(__name__)

_ALIASES = {"tp": "tp_size", "ep": "ep_size", "pp": "pp_size"}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_ROUTED_PARAM = re.compile(r"\.mlp\.experts\.")
"""An engine parameter of the routed experts (sglang's fused ``mlp.experts.w13_weight``,
its scales; not ``shared_experts``)."""
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class EngineSpec:
    """One ``--engine`` value: a layout, as typed and as sglang server args, and a count."""

    layout: dict[str, Any]
    """As given (``{"tp": 8, "ep": 8}``), for the output."""
    server_args: dict[str, Any]
    """sglang ServerArgs fields (``{"tp_size": 8, "ep_size": 8}``)."""
    count: int = 1
    """How many engines of this layout."""


def parse_engine_spec(text: str) -> EngineSpec:
    """``tp=T[,ep=E][,dp_attention=D][,count=N][,<sglang server arg>=V...]``.

    ``dp_attention=D`` is sglang's ``--enable-dp-attention --dp-size D``; other keys are
    sglang server args (``moe_dense_tp_size=1``); values are read as ints, floats,
    true/false, or else kept as text.
    """
    layout: dict[str, Any] = {}
    server_args: dict[str, Any] = {}
    count = 1
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--engine {text!r}: {item!r} is not key=value")
        value = _value(raw.strip())
        if key == "count":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--engine {text!r}: count must be a positive integer")
            count = value
            continue
        layout[key] = value
        if key == "dp_attention":
            server_args.update(enable_dp_attention=True, dp_size=value)
        else:
            server_args[_ALIASES.get(key, key)] = value
    if "tp_size" not in server_args:
        raise ConfigError(f"--engine {text!r} needs tp=T")
    return EngineSpec(layout, server_args, count)


def _value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def model_folder(model: str) -> Path:
    """A folder holding ``config.json``: the folder given, the folder of a config.json, or
    a temporary one for a shipped model name or another JSON config, or for a config whose
    model type transformers does not know (``remote_code_as_architecture``)."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {model!r}: no config.json in that folder")
        return remote_code_as_architecture(path)
    if path.name == "config.json" and path.is_file():
        return remote_code_as_architecture(path.parent)
    from p2pweights.source.synthetic import model_config, write_model_dir

    try:
        config = model_config(model)
    except ValueError as exc:
        raise ConfigError(f"--model {model!r}: {exc}") from exc
    return remote_code_as_architecture(
        write_model_dir(config, tempfile.mkdtemp(prefix="p2pweights-plan-"))
    )


def remote_code_as_architecture(folder: Path) -> Path:
    """``folder``, or, where its config's ``model_type`` is one transformers does not know
    (remote code: Kimi-K2's ``kimi_k2``), a temporary folder whose config reads as the
    model type of its architecture, which sglang serves (``DeepseekV3ForCausalLM``:
    ``deepseek_v3``). A plan builds replicas on meta and runs no remote code."""
    import json

    from p2pweights.source.config_checkpoint import architecture_model_type
    from p2pweights.source.synthetic import write_model_dir

    config = json.loads((folder / "config.json").read_text())
    model_type = architecture_model_type(config)
    if model_type is None:
        return folder
    logger.info(
        "%s: model_type %r read as %r (its architecture %s, as sglang serves it)",
        folder,
        config.get("model_type"),
        model_type,
        ", ".join(config.get("architectures") or ()),
    )
    config = {k: v for k, v in config.items() if k != "auto_map"}
    config["model_type"] = model_type
    return write_model_dir(config, tempfile.mkdtemp(prefix="p2pweights-plan-"))


def build_cluster_plan(
    model: str,
    specs: Sequence[EngineSpec],
    *,
    num_senders: int,
    num_stages: int = 1,
    links: LinkModel | None = None,
    pipeline: PipelineModel | None = None,
    delta_fraction: float | None = None,
) -> ClusterPlan:
    """The plan of one update of ``model`` into engines of ``specs`` (replicas on meta);
    with ``delta_fraction``, also as a delta update at that fraction of values changed."""
    import json

    from p2pweights.source.expected import expected_checkpoint

    if not specs:
        raise ConfigError("give at least one --engine")
    pipeline = pipeline or PipelineModel()
    folder = model_folder(model)
    config = json.loads((folder / "config.json").read_text())
    num_layers = int(config.get("num_hidden_layers") or 1)
    num_experts = config.get("n_routed_experts") or config.get("num_experts")
    checkpoint = expected_checkpoint(folder)
    if checkpoint.unchecked:
        raise ConfigError(f"cannot describe the checkpoint of {folder}: {checkpoint.unchecked}")
    rank_loads = _RankLoads(folder, checkpoint, num_layers, num_experts, num_stages, pipeline)
    engines = []
    for spec in specs:
        info = _server_info(folder, spec)
        loads = tuple(rank_loads.of(info, rank) for rank in range(int(info["tp_size"])))
        engines += [EngineLoad(layout=spec.layout, ranks=loads)] * spec.count
    return plan_cluster(
        engines,
        num_senders=num_senders,
        num_stages=num_stages,
        broadcast_bytes_by_stage=_checkpoint_bytes(checkpoint, num_layers, num_stages),
        links=links,
        pipeline=pipeline,
        delta_fraction=delta_fraction,
    )


def _server_info(folder: Path, spec: EngineSpec) -> dict[str, Any]:
    from p2pweights.engines.fleet import num_engine_ranks
    from p2pweights.replica.sglang.env import server_args_names
    from p2pweights.replica.sglang.facade import resolved_server_info

    unknown = sorted(set(spec.server_args) - server_args_names())
    if unknown:
        raise ConfigError(
            f"--engine {spec.layout}: {', '.join(unknown)} not sglang server arg(s); use "
            f"tp, ep, dp_attention, count or sglang ServerArgs names such as moe_dense_tp_size"
        )
    try:
        info = resolved_server_info({**spec.server_args, "model_path": str(folder)})
        num_engine_ranks(f"--engine {spec.layout}", info)  # the refusals connect() makes
    except EngineError as exc:
        raise ConfigError(str(exc)) from exc
    except Exception as exc:  # sglang's own validation of the server args
        raise ConfigError(f"sglang refuses --engine {spec.layout}: {exc}") from exc
    return info


class _RankLoads:
    """Each engine rank's load, computed once per distinct replica."""

    def __init__(
        self,
        folder: Path,
        checkpoint: ExpectedCheckpoint,
        num_layers: int,
        num_experts: int | None,
        num_stages: int,
        pipeline: PipelineModel,
    ):
        self._folder = folder
        self._checkpoint = checkpoint
        self._num_layers = num_layers
        self._num_experts = num_experts
        self._num_stages = num_stages
        self._buffer_bytes = pipeline.buffer_bytes
        self._done: dict[Hashable, RankLoad] = {}

    def of(self, server_info: Mapping[str, Any], rank: int) -> RankLoad:
        from p2pweights.replica.registry import replica_for

        handle = replica_for(server_info, rank, str(self._folder))
        load = self._done.get(handle.key)
        if load is None:
            logger.info("engine rank %d: replica %d built on meta", rank, len(self._done) + 1)
            replica = handle.peek()
            optional = replica.optional_params
            written = {n: lay for n, lay in replica.layouts.items() if n not in optional}
            stages = [self._stage(name) for name in written]
            per_stage = _written_bytes(
                handle.key, written, stages, self._num_stages, self._buffer_bytes
            )
            spec = RankSpec.from_server_info(server_info, rank)
            inputs = self._inputs(spec)
            by_itemsize: list[dict[int, int]] = [{} for _ in range(self._num_stages)]
            for layout, stage in zip(written.values(), stages, strict=True):
                size = layout.dtype.itemsize
                by_itemsize[stage][size] = by_itemsize[stage].get(size, 0) + layout.num_bytes
            experts = [0] * self._num_stages
            for (name, layout), stage in zip(written.items(), stages, strict=True):
                if _ROUTED_PARAM.search(name):
                    experts[stage] += int(layout.num_bytes)
            load = self._done[handle.key] = RankLoad(
                layout_key=handle.key,
                bytes_by_stage=tuple(per_stage),
                expert_bytes_by_stage=tuple(experts),
                bytes_by_itemsize_by_stage=tuple(by_itemsize),
                loader_inputs_by_stage=inputs.loader_calls,
                quantized_by_stage=inputs.quantized,
            )
        return load

    def _stage(self, name: str) -> int:
        return pipeline_stage_of(name, self._num_layers, self._num_stages)

    def _inputs(self, spec: RankSpec) -> _RankInputs:
        """HF tensors this rank's loaders read (an estimate for the predicted time: every
        tensor but other ranks' routed experts, scales counted apart) and those of them
        the sender quantizes from the trainer's bf16: (bytes of the blocks the rank reads,
        of the whole tensor), a routed expert's ``1 / moe_tp_size``, others whole."""
        calls = [0] * self._num_stages
        quantized: list[dict[str, tuple[int, int]]] = [{} for _ in range(self._num_stages)]
        local = None
        if self._num_experts:
            per_rank = int(self._num_experts) // max(spec.moe_ep_size, 1)
            local = range(spec.moe_ep_rank * per_rank, (spec.moe_ep_rank + 1) * per_rank)
        for name, tensor in self._checkpoint.tensors.items():
            layer = _LAYER.search(name)
            if tensor.optional or (layer is not None and int(layer.group(1)) >= self._num_layers):
                continue  # a tied alias, or an MTP layer (a draft's, not the target's)
            match = _EXPERT.search(name)
            if match is not None and local is not None and int(match.group(1)) not in local:
                continue
            stage = self._stage(name)
            calls[stage] += 2 if tensor.scale_shape is not None else 1
            if tensor.scale_shape is not None:
                whole = math.prod(tensor.shape) * _TRAINER_BYTES
                sliced = match is not None and spec.moe_tp_size > 1
                quantized[stage][name] = (whole // spec.moe_tp_size if sliced else whole, whole)
        return _RankInputs(tuple(calls), tuple(quantized))


_TRAINER_BYTES = 2
"""Bytes per element of what a trainer sends an fp8 engine to quantize (bf16)."""


class _RankInputs(NamedTuple):
    loader_calls: tuple[int, ...]
    quantized: tuple[dict[str, tuple[int, int]], ...]


def _written_bytes(
    key: Hashable,
    layouts: Mapping[str, Any],
    stages: Sequence[int],
    num_stages: int,
    buffer_bytes: int,
) -> list[int]:
    """Bytes one update writes to a rank of this layout, per stage, from a byte plan.

    Each parameter is its own group (the probe, which joins parameters fed by the same
    HF tensors, changes the staging buffer's size, never the bytes), written to a
    stand-in publication of exactly the replica's sizes.
    """
    regions, address = {}, 0
    for name, layout in layouts.items():
        regions[name] = WeightRegion(address, int(layout.num_bytes))
        address += aligned(int(layout.num_bytes))
    target = RankPublication("plan", 0, "plan", regions)
    groups: dict[Hashable, list[tuple[frozenset[str], list[str]]]] = {}
    for name, stage in zip(layouts, stages, strict=True):
        groups.setdefault((key, stage), []).append((frozenset({name}), [name]))
    sizes = {name: int(layout.num_bytes) for name, layout in layouts.items()}
    plan = build_byte_plan(
        groups, dict.fromkeys(groups, sizes), {key: [target] for key in groups}, buffer_bytes
    )
    per_stage = [0] * num_stages
    for group in plan.groups.values():
        _, stage = group.key  # type: ignore[misc]
        for writes in group.targets:
            per_stage[stage] += sum(group.slots[w.slot].num_bytes for w in writes.writes)
    return per_stage


def trainer_expert_bytes(model: str, num_stages: int) -> list[int]:
    """Bytes of the routed experts a trainer holds in bf16, per pipeline stage (MTP
    layers left out): what an expert-parallel group gathers in a gathered export."""
    import json

    from p2pweights.source.expected import expected_checkpoint

    folder = model_folder(model)
    config = json.loads((folder / "config.json").read_text())
    num_layers = int(config.get("num_hidden_layers") or 1)
    per_stage = [0] * num_stages
    for name, tensor in expected_checkpoint(folder).tensors.items():
        layer = _LAYER.search(name)
        if tensor.optional or (layer is not None and int(layer.group(1)) >= num_layers):
            continue
        if _EXPERT.search(name):
            stage = pipeline_stage_of(name, num_layers, num_stages)
            per_stage[stage] += math.prod(tensor.shape) * _TRAINER_BYTES
    return per_stage


def _checkpoint_bytes(
    checkpoint: ExpectedCheckpoint, num_layers: int, num_stages: int
) -> list[int]:
    """The whole update as a broadcast sends it, per stage: the checkpoint's tensors,
    fp8 weights as fp8 plus their float32 block scales; MTP layers left out (the plan
    covers the engines' target models, not speculative drafts)."""
    per_stage = [0] * num_stages
    for name, tensor in checkpoint.tensors.items():
        layer = _LAYER.search(name)
        if tensor.optional or (layer is not None and int(layer.group(1)) >= num_layers):
            continue
        numel = math.prod(tensor.shape)
        if tensor.scale_shape is not None:
            num_bytes = numel + 4 * math.prod(tensor.scale_shape)
        else:
            num_bytes = numel * min(dtype.itemsize for dtype in tensor.dtypes)
        per_stage[pipeline_stage_of(name, num_layers, num_stages)] += num_bytes
    return per_stage
