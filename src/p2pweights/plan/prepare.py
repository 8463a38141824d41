"""The first update's preparation: its inputs checked, sglang's loaders probed, bytes planned.

Runs once per connection, before any engine is paused: the inputs' names, shapes and
dtypes (every pipeline stage's together) are checked against each engine's
checkpoint and for parameters they feed only in part; each replica's loaders are
probed for the checkpoint format they want (fp8 quantization) and the parameter
groups the inputs feed; the byte plan lays out every group and checks every write
against what the targets published. What later updates reuse is a ``Prepared``.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2pweights.engines.fleet import ConnectedEngine
from p2pweights.errors import ConfigError
from p2pweights.plan.byte_plan import BytePlan, aligned, build_byte_plan
from p2pweights.plan.owners import OwnedPlan, Owner, Ownership, plan_owned
from p2pweights.plan.stream import UpdateSource
from p2pweights.progress import progress
from p2pweights.replica.registry import ReplicaHandle, config_path
from p2pweights.source.checkpoint_format import unify
from p2pweights.source.completeness import check_whole_parameters
from p2pweights.source.expected import (
    ExpectedCheckpoint,
    check_first_update,
    engine_dtype,
    expected_checkpoint,
)
from p2pweights.source.inputs import InputSpec, ParamGroup
from p2pweights.wire.publication import RankPublication

__all__ = [
    "Groups",
    "Prepared",
    "build_plan",
    "check_against_checkpoints",
    "engine_checkpoints",
    "prepare",
    "prepare_owned",
    "staging_bytes",
]

Groups = dict[Hashable, list[tuple[frozenset[str], Sequence[str]]]]
"""Per replica, its parameter groups as (HF names, parameter names), in plan order."""


@dataclass
class Prepared:
    """What the first update established, for every later one."""

    source: UpdateSource
    """The inputs' contract, their conversion and grouping."""
    groups: Groups
    plan: BytePlan
    owned: OwnedPlan | None = None
    """Owner sends (``plan.owners``): which groups go to every engine rank, in which ranges."""
    owned_inputs: frozenset[str] = frozenset()
    """The HF tensors this rank owns; later updates must own the same."""
    owned_shards: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """The slices this rank holds of sharded HF tensors; later updates must hold the same."""

    def replan(
        self,
        replicas: Mapping[Hashable, ReplicaHandle],
        targets: Mapping[Hashable, Sequence[RankPublication]],
        buffer_bytes: int,
    ) -> BytePlan:
        """The same groups planned into ``targets`` (publications that moved)."""
        if self.owned is not None:
            return self.owned.build(replicas, targets, buffer_bytes)
        return build_plan(self.groups, replicas, targets, buffer_bytes)


def engine_checkpoints(
    engines: Iterable[ConnectedEngine],
) -> list[tuple[ExpectedCheckpoint, torch.dtype | None]]:
    """What each engine's checkpoint holds, and the dtype it runs in, once per distinct
    config and dtype (derived once per config for the process)."""
    found = {}
    for engine in engines:
        path = config_path(engine.server_info, engine.endpoint.model_path)
        dtype = engine.server_info.get("dtype")
        found[(path, dtype)] = (expected_checkpoint(path.parent), engine_dtype(dtype))
    return list(found.values())


_MODEL_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "num_experts",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
)
"""The config fields that say which model an engine serves: the tensors a trainer sends
depend on them (not on the dtype, the path or the quantization it serves them in)."""


def check_one_model(engines: Iterable[ConnectedEngine]) -> None:
    """Refuse engines whose configs describe different models: one session sends one
    model's tensors (engines of one model in several layouts are fine)."""
    seen: list[tuple[str, Path, dict[str, Any]]] = []
    for engine in engines:
        path = config_path(engine.server_info, engine.endpoint.model_path)
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # not compared: building its replica says what is wrong with it
        model = {key: config[key] for key in _MODEL_FIELDS if key in config}
        if any(model == other for _, _, other in seen):
            continue
        for url, first_path, first in seen:
            differ = sorted(k for k in first.keys() & model.keys() if first[k] != model[k])
            if differ:
                fields = ", ".join(f"{k} {first[k]!r} / {model[k]!r}" for k in differ)
                raise ConfigError(
                    f"engines {url} ({first_path}) and {engine.url} ({path}) serve different "
                    f"models ({fields}); one session updates one model: connect a session per "
                    f"model"
                )
        seen.append((engine.url, path, model))


def staging_bytes(replicas: Sequence[ReplicaHandle], buffer_bytes: int) -> int:
    """The staging size known at connect: no group is smaller than its largest parameter.
    Builds each replica (once per layout, for the process)."""
    largest = 0
    with progress("p2pweights connect: building replicas", total=len(replicas)) as step:
        for handle in replicas:
            largest = max(largest, *(aligned(handle.param_bytes(n)) for n in handle.layouts))
            step(1)
    return max(buffer_bytes, largest)


def check_against_checkpoints(
    specs: Mapping[str, InputSpec],
    expected: Iterable[tuple[ExpectedCheckpoint, torch.dtype | None]],
) -> None:
    """The first update must match the checkpoint each engine's config describes."""
    for checkpoint, dtype in expected:
        check_first_update(specs, checkpoint, engine_dtype=dtype)


def prepare(
    own: Mapping[str, InputSpec],
    specs: Mapping[str, InputSpec],
    replicas: Mapping[Hashable, ReplicaHandle],
    targets: Mapping[Hashable, Sequence[RankPublication]],
    expected: Sequence[ExpectedCheckpoint],
    *,
    buffer_bytes: int,
    finite: bool,
) -> Prepared:
    """Probe and plan this rank's part of the first update.

    ``own``: the inputs this rank sends; ``specs``: those of every pipeline stage (equal
    to ``own`` with one stage); ``replicas``: one per layout this rank writes;
    ``expected``: the engines' checkpoints, for naming what a partly fed parameter lacks.
    """
    keys = sorted(replicas, key=str)
    check_whole_parameters(
        specs,
        expected,
        (replicas[key].trainer_feeds for key in keys),  # probed only if needed
    )
    with progress("p2pweights: probing sglang's loaders", total=2 * len(keys)) as advance:
        formats = {}
        for key in keys:
            formats[key] = replicas[key].checkpoint_format(specs)
            advance(1)
        formats = unify(formats)
        by_key = {}
        for key in keys:
            by_key[key] = _own_groups(
                replicas[key].groups(formats[key].engine_specs(specs)),
                formats[key].engine_specs(own),
            )
            advance(1)
    groups: Groups = {key: [(g.hf_names, g.param_names) for g in by_key[key]] for key in keys}
    source = UpdateSource(
        own,
        {key: [g.hf_names for g in by_key[key]] for key in keys},
        formats,
        finite=finite,
    )
    return Prepared(source, groups, build_plan(groups, replicas, targets, buffer_bytes))


def prepare_owned(
    own: Mapping[str, InputSpec],
    specs: Mapping[str, InputSpec],
    ownership: Ownership,
    me: Owner,
    replicas: Mapping[Hashable, ReplicaHandle],
    targets: Mapping[Hashable, Sequence[RankPublication]],
    assigned: Mapping[Hashable, Sequence[RankPublication]],
    expected: Sequence[ExpectedCheckpoint],
    *,
    buffer_bytes: int,
    finite: bool,
) -> Prepared:
    """``prepare`` under owner sends (``plan.owners``): ``targets`` holds every engine
    rank (owned groups go to all), ``assigned`` this rank's (replicated groups go there)."""
    keys = sorted(replicas, key=str)
    check_whole_parameters(specs, expected, (replicas[key].trainer_feeds for key in keys))
    with progress("p2pweights: probing sglang's loaders", total=2 * len(keys)) as advance:
        formats = {}
        for key in keys:
            formats[key] = replicas[key].checkpoint_format(specs)
            advance(1)
        formats = unify(formats)
        probed: Groups = {}
        engine_specs = {}
        for key in keys:
            engine_specs[key] = formats[key].engine_specs(specs)
            probed[key] = [
                (g.hf_names, g.param_names) for g in replicas[key].groups(engine_specs[key])
            ]
            advance(1)
    owned = plan_owned(
        probed,
        engine_specs,
        ownership,
        me,
        replicas,
        (pub.runner for pubs in assigned.values() for pub in pubs),
        assigned.keys(),
    )
    groups: Groups = {
        key: [(g.hf_names, g.params) for g in key_groups]
        for key, key_groups in owned.groups.items()
    }
    source = UpdateSource(
        own,
        {key: [names for names, _ in key_groups] for key, key_groups in groups.items()},
        formats,
        finite=finite,
    )
    return Prepared(source, groups, owned.build(replicas, targets, buffer_bytes), owned)


def build_plan(
    groups: Groups,
    replicas: Mapping[Hashable, ReplicaHandle],
    targets: Mapping[Hashable, Sequence[RankPublication]],
    buffer_bytes: int,
) -> BytePlan:
    """The byte plan of the probed groups into the targets' publications."""
    return build_byte_plan(
        groups, {key: _ParamBytes(replicas[key]) for key in groups}, targets, buffer_bytes
    )


class _ParamBytes(Mapping[str, int]):
    """A replica's parameter sizes, read lazily (the plan asks for the ones it stages)."""

    def __init__(self, handle: ReplicaHandle):
        self._handle = handle

    def __getitem__(self, name: str) -> int:
        return self._handle.param_bytes(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._handle.layouts)

    def __len__(self) -> int:
        return len(self._handle.layouts)


def _own_groups(groups: Sequence[ParamGroup], own: Mapping[str, InputSpec]) -> list[ParamGroup]:
    """The groups this rank's own tensors feed whole (with one stage: every group)."""
    mine = []
    for group in groups:
        sent = group.hf_names & own.keys()
        if sent == group.hf_names:
            mine.append(group)
        elif sent:
            raise ConfigError(
                f"parameters {list(group.param_names)[:4]} are loaded from HF tensors "
                f"{sorted(group.hf_names)[:6]} together, but this pipeline stage sends only "
                f"{sorted(sent)[:6]}; one stage must send all of them"
            )
    return mine
