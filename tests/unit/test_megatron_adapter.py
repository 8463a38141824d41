"""The Megatron adapter's own logic, without megatron: stage grouping, the rename hook.

megatron-bridge's tasks and Megatron's parallel state are stood in for by small
objects with the fields the adapter reads; tests/integration/test_megatron_bridge.py
runs the real megatron-core and megatron-bridge where they are installed.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from p2pweights import ConfigError, SyncConfig, Timeouts, TrainerTopology
from p2pweights.adapters.megatron import (
    MegatronExport,
    renamed,
    stage_config,
    stage_tasks,
    stepped,
)


class FakeMapping:
    def __init__(self, hf_param: str):
        self.hf_param = hf_param


@dataclass(frozen=True)
class FakeTask:  # the fields of megatron-bridge's WeightConversionTask the adapter uses
    param_name: str
    mapping: FakeMapping
    megatron_module: object | None = None
    param_weight: object | None = None


def test_stage_tasks_keep_this_stages_parameters():
    tasks = [
        FakeTask("embedding", FakeMapping("model.embed_tokens.weight"), megatron_module="here"),
        FakeTask("decoder.layers.1.fc1", FakeMapping("model.layers.1.mlp"), None),  # other stage
        FakeTask("final_norm", FakeMapping("model.norm.weight"), megatron_module="here"),
    ]
    assert [t.param_name for t in stage_tasks(tasks)] == ["embedding", "final_norm"]


def test_each_item_is_computed_inside_the_scope_and_consumed_outside():
    events = []

    @contextlib.contextmanager
    def scope():
        events.append("enter")
        yield
        events.append("exit")

    def items():
        for value in (1, 2):
            events.append(f"make {value}")
            yield value

    for value in stepped(items(), scope):
        events.append(f"use {value}")
    assert events == [
        *("enter", "make 1", "exit", "use 1"),
        *("enter", "make 2", "exit", "use 2"),
        *("enter", "exit"),
    ]


def _pairs(*names):
    return iter([(n, torch.ones(2, dtype=torch.float32)) for n in names])


def test_rename_hook_renames_drops_and_casts():
    def rename(name):
        if name.startswith("mtp."):
            return None
        return name.replace("language_model.", "")

    out = list(renamed(_pairs("language_model.a", "mtp.b", "c"), rename, torch.bfloat16))
    assert [n for n, _ in out] == ["a", "c"]
    assert {t.dtype for _, t in out} == {torch.bfloat16}
    assert [n for n, _ in renamed(_pairs("a", "b"), None)] == ["a", "b"]


def test_rename_hook_may_not_merge_two_tensors():
    with pytest.raises(ConfigError, match="both the name 'x'"):
        list(renamed(_pairs("a", "b"), lambda name: "x"))


@pytest.fixture
def parallel_state(monkeypatch):
    """A stand-in for megatron.core.parallel_state: pipeline rank 1 of 4."""
    state = types.SimpleNamespace(
        get_pipeline_model_parallel_rank=lambda: 1,
        get_pipeline_model_parallel_world_size=lambda: 4,
    )
    core = types.ModuleType("megatron.core")
    core.parallel_state = state  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    monkeypatch.setitem(sys.modules, "megatron.core", core)
    # and megatron-bridge's mapping base class, whose pipeline size the export narrows
    mapping = types.ModuleType("megatron.bridge.models.conversion.param_mapping")
    mapping.MegatronParamMapping = FakeParamMapping  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mapping.__name__, mapping)
    return state


class FakeParamMapping:
    @property
    def pp_size(self):
        return 4


def test_stage_config_from_megatrons_parallel_state(parallel_state):
    config = SyncConfig(buffer_bytes="64MiB", timeouts=Timeouts(transfer=5))
    staged = stage_config(config)
    assert (staged.pipeline_stage, staged.num_pipeline_stages) == (1, 4)
    assert (staged.buffer_bytes, staged.timeouts.transfer) == (64 * 2**20, 5)
    gathered = stage_config(config, per_stage=False)
    assert (gathered.pipeline_stage, gathered.num_pipeline_stages) == (0, 1)
    assert staged.model_fields_set == config.model_fields_set  # what the user set, only


def test_stage_config_keeps_a_given_trainer_rank(parallel_state):
    with pytest.warns(DeprecationWarning):
        config = SyncConfig(trainer_rank=1, num_trainer_ranks=2)
    staged = stage_config(config)
    assert staged.topology == TrainerTopology(
        rank=1, num_ranks=2, pipeline_stage=1, num_pipeline_stages=4
    )


class FakeBridge:
    """Records what MegatronExport asks of megatron-bridge's AutoBridge."""

    def __init__(self, tasks):
        self.tasks = tasks
        self.calls = []

    def get_conversion_tasks(self, model):
        self.calls.append(("tasks", len(model)))
        return self.tasks

    def export_hf_weights(self, model, **kwargs):
        self.calls.append(("export", kwargs["conversion_tasks"], kwargs["merge_adapter_weights"]))
        yield "model.embed_tokens.weight", torch.full((2,), FakeParamMapping().pp_size)


@pytest.mark.parametrize("per_stage", [True, False])
def test_export_plans_once_and_exports_every_update(per_stage, parallel_state):
    tasks = [
        FakeTask("embedding", FakeMapping("e"), megatron_module="here"),
        None,  # the bridge leaves None where no mapping was found
        FakeTask("output", FakeMapping("o"), None),
    ]
    bridge = FakeBridge(tasks)
    export = MegatronExport(bridge, object(), per_stage=per_stage)
    for _ in range(2):
        (name, tensor), *rest = export.named_tensors()
        assert name == "model.embed_tokens.weight" and not rest
        # per stage, the bridge's mappings see a pipeline of one stage while exporting
        assert int(tensor[0]) == (1 if per_stage else 4)
    assert FakeParamMapping().pp_size == 4  # and only then
    assert bridge.calls[0] == ("tasks", 1) and len(bridge.calls) == 3
    exported = bridge.calls[1][1]
    assert [t.param_name for t in exported] == (
        ["embedding"] if per_stage else ["embedding", "output"]
    )
    assert bridge.calls[1][2] is (not per_stage)  # adapters merge across stages only
    assert export.stage_config().num_pipeline_stages == (4 if per_stage else 1)


@dataclass(frozen=True)
class FakeView:  # megatron-bridge's LocalHFParam
    name: str
    weight: torch.Tensor
    global_weight_shape: torch.Size
    shard_group: str
    shard_dim: int | None


class FakeLocalMapping(FakeMapping):
    """A mapping with megatron-bridge's ``local_hf_params`` (no collective, no transform)."""

    def __init__(self, hf_param, views=None, is_expert=False, tp_rank=0):
        super().__init__(hf_param)
        self.views, self.is_expert, self.tp_rank = views, is_expert, tp_rank

    def local_hf_params(self, weight, *, global_param_name, megatron_module):
        if self.views is None:
            raise ValueError(f"{global_param_name}: cannot be represented as local HF views")
        return self.views


@pytest.fixture
def replicas(parallel_state):
    """This rank's data-parallel and expert-data-parallel rank (settable; 0 by default)."""
    ranks = {"dp": 0, "edp": 0}
    parallel_state.get_data_parallel_rank = lambda with_context_parallel=False: ranks["dp"]
    parallel_state.get_expert_data_parallel_rank = lambda: ranks["edp"]
    return ranks


def _owned_tasks():
    o_proj = torch.arange(8, dtype=torch.bfloat16).reshape(4, 2)  # TP rank 1's columns
    expert = torch.ones(3, 2, dtype=torch.bfloat16)
    norm = torch.full((4,), 2.0, dtype=torch.bfloat16)
    o_name = "model.layers.0.self_attn.o_proj.weight"
    e_name = "model.layers.0.mlp.experts.5.down_proj.weight"
    return [
        FakeTask(
            "o",
            FakeLocalMapping(
                o_name, [FakeView(o_name, o_proj, torch.Size([4, 4]), "tp", 1)], tp_rank=1
            ),
            megatron_module="here",
        ),
        FakeTask(
            "e",
            FakeLocalMapping(
                e_name,
                [FakeView(e_name, expert, torch.Size([3, 2]), "replicated", None)],
                is_expert=True,
            ),
            megatron_module="here",
        ),
        FakeTask(
            "n",
            FakeLocalMapping(
                "model.norm.weight",
                [FakeView("model.norm.weight", norm, torch.Size([4]), "replicated", None)],
            ),
            megatron_module="here",
        ),
        FakeTask("qkv", FakeLocalMapping("qkv"), megatron_module="here"),  # interleaved: export
    ]


def test_owned_export_hands_local_shards_and_own_experts_and_exports_the_rest(replicas):
    tasks = _owned_tasks()
    bridge = FakeBridge(tasks)
    export = MegatronExport(bridge, object())
    pairs = export.named_tensors(owned=True)
    o_name = "model.layers.0.self_attn.o_proj.weight"
    e_name = "model.layers.0.mlp.experts.5.down_proj.weight"
    assert pairs.owned() == {e_name}
    assert pairs.shards() == {o_name: (1, 2, 4)}
    got = dict(pairs.whole_tensors())  # as the session stages them
    assert set(got) == {o_name, e_name, "model.norm.weight", "model.embed_tokens.weight"}
    assert torch.equal(got[o_name][:, 2:], tasks[0].mapping.views[0].weight)  # at its columns
    assert not got[o_name][:, :2].any()  # zero elsewhere (the other TP rank's)
    # only the task with no local view went through the bridge's gathered export: once to
    # learn its names and shapes (the first update only), then streamed
    assert [[t.param_name for t in call[1]] for call in bridge.calls[1:]] == [["qkv"]] * 2
    assert pairs.specs()["model.embed_tokens.weight"] == ((2,), torch.int64)
    list(export.named_tensors(owned=True))
    assert len(bridge.calls) == 4  # later updates: the export once


@pytest.mark.parametrize("replica", ["dp", "edp"])
def test_other_data_parallel_replicas_hand_only_replicated_and_exported_tensors(replica, replicas):
    """Replicas hold the same shards and experts: replica 0's ranks send them (dp: the
    dense shards; edp: the experts); every rank sends the replicated and exported ones."""
    replicas[replica] = 1
    export = MegatronExport(FakeBridge(_owned_tasks()), object())
    pairs = export.named_tensors(owned=True)
    o_name = "model.layers.0.self_attn.o_proj.weight"
    e_name = "model.layers.0.mlp.experts.5.down_proj.weight"
    assert pairs.shards() == ({} if replica == "dp" else {o_name: (1, 2, 4)})
    assert pairs.owned() == ({e_name} if replica == "dp" else set())
    replicated = {"model.norm.weight", "model.embed_tokens.weight"}
    assert set(dict(pairs)) == replicated | set(pairs.shards()) | pairs.owned()


def test_owned_export_needs_one_sender_group_per_stage(replicas):
    export = MegatronExport(FakeBridge(_owned_tasks()), object(), per_stage=False)
    with pytest.raises(ConfigError, match="per_stage=True"):
        export.named_tensors(owned=True)
