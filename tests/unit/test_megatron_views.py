"""``megatron_views.derived_view``: which megatron-bridge 0.3 conversion tasks become a
rank's own view of an HF tensor, and which stay on the gathered export.

Uses the bridge's real mapping classes (skipped where megatron-bridge is not installed);
the tensor-parallel group is stood in for by the mappings' ``tp_rank`` / ``tp_size``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from _megatron_cpu import import_bridge, megatron_available

pytestmark = pytest.mark.skipif(not megatron_available(), reason="megatron-bridge is not installed")


@dataclass(frozen=True)
class Task:  # the fields of the bridge's WeightConversionTask that the views read
    global_param_name: str
    mapping: object
    param_weight: object
    megatron_module: object


class RowParallelLinear(torch.nn.Module):  # AutoMapping detects by the module's class name
    pass


@pytest.fixture
def pm(monkeypatch):
    import_bridge()
    from megatron.bridge.models.conversion import param_mapping

    base = param_mapping.MegatronParamMapping
    monkeypatch.setattr(base, "tp_rank", property(lambda self: 1))
    monkeypatch.setattr(base, "tp_size", property(lambda self: 2))
    monkeypatch.setattr(base, "ep_size", property(lambda self: 2))
    return param_mapping


def _view(pm, mapping, megatron_name, weight, *, tied=False, vocab_size=8):
    from p2pweights.adapters.megatron_views import derived_view

    task = Task(megatron_name, mapping, torch.nn.Parameter(weight), RowParallelLinear())
    return derived_view(task, tied=tied, vocab_size=vocab_size)


def test_column_row_and_auto_mappings_are_this_ranks_slice(pm):
    weight = torch.ones(4, 6)
    column = _view(pm, pm.ColumnParallelMapping("x.weight", "a"), "x.weight", weight)
    assert (column.name, column.shard, column.expert) == ("a", (0, 4, 8), False)
    row = _view(pm, pm.RowParallelMapping("x.weight", "b"), "x.weight", weight)
    assert row.shard == (1, 6, 12)
    bias = _view(pm, pm.RowParallelMapping("x.bias", "c"), "x.bias", torch.ones(4))
    assert bias.shard is None  # a row-parallel bias is not split
    auto = _view(pm, pm.AutoMapping("x.weight", "d"), "x.weight", weight)
    assert auto.shard == (1, 6, 12)  # detected from the module: row-parallel
    whole = _view(pm, pm.ReplicatedMapping("n.weight", "e"), "n.weight", torch.ones(4))
    assert whole.shard is None and whole.tensor.shape == (4,)


def test_what_the_export_converts_or_renames_stays_gathered(pm):
    weight = torch.ones(4, 6)
    emb = "embedding.word_embeddings.weight"
    assert _view(pm, pm.ColumnParallelMapping(emb, "m"), emb, weight).shard == (0, 4, 8)
    assert _view(pm, pm.ColumnParallelMapping(emb, "m"), emb, weight, tied=True) is None
    assert _view(pm, pm.ColumnParallelMapping(emb, "m"), emb, weight, vocab_size=7) is None
    permuted = pm.AutoMapping("x.weight", "p", permute_dims=(1, 0))
    assert _view(pm, permuted, "x.weight", weight) is None
    zero_centred = pm.RMSNorm2ZeroCenteredRMSNormMapping("n.weight", "z")
    assert _view(pm, zero_centred, "n.weight", torch.ones(4)) is None
    qkv = pm.QKVMapping("l.linear_qkv.weight", q="q", k="k", v="v")
    assert _view(pm, qkv, "l.linear_qkv.weight", weight) is None
    local = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    assert _view(pm, pm.RowParallelMapping(local, "x"), local, weight) is None  # EP 2
    grouped = "decoder.layers.0.mlp.experts.linear_fc2.weight5"
    expert = _view(pm, pm.RowParallelMapping(grouped, "y"), grouped, weight)
    assert expert.expert and expert.shard == (1, 6, 12)
