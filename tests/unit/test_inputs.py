"""Grouping HF inputs: a group is released once, when its last input arrives; tensors are freed."""

from __future__ import annotations

import pytest
import torch

from p2pweights.errors import ConfigError
from p2pweights.source.checkpoint_format import AS_GIVEN
from p2pweights.source.collect import ConvertingCollector, GroupCollector
from p2pweights.source.inputs import InputSpec, ParamGroup, check_input, describe_inputs

QKV = ParamGroup(frozenset({"q", "k", "v"}), ("qkv_proj",))
TIED = ParamGroup(frozenset({"embed"}), ("embed_tokens", "lm_head"))
OPROJ = ParamGroup(frozenset({"o"}), ("o_proj",))


def _t(n: int = 4) -> torch.Tensor:
    return torch.zeros(n)


def _names(*groups: ParamGroup) -> list[frozenset[str]]:
    return [g.hf_names for g in groups]


def test_group_released_when_complete_with_all_inputs():
    collector = GroupCollector({"r0": _names(QKV, TIED, OPROJ)})
    assert collector.add("q", _t()) == []
    assert collector.add("embed", _t())[0][1] == 1  # TIED, the second group
    assert collector.add("k", _t()) == []
    ready = collector.add("v", _t())
    assert [(key, index) for key, index, _ in ready] == [("r0", 0)]
    assert [name for name, _ in ready[0][2]] == ["k", "q", "v"]
    assert collector.missing() == {("r0", 2): ["o"]}
    converting = ConvertingCollector({"r0": _names(OPROJ)}, {"r0": AS_GIVEN})
    with pytest.raises(ConfigError, match="missing HF tensors: o"):
        list(converting.collect([("q", _t())]))


def test_tensor_held_until_every_replica_loaded_it():
    collector = GroupCollector({"tp2-r0": _names(QKV), "tp1-r0": _names(QKV)})
    collector.add("q", _t())
    collector.add("k", _t())
    assert len(collector.add("v", _t())) == 2  # both layouts complete on the same tensor
    assert collector._held == {}


def test_unused_names_are_dropped_and_duplicates_refused():
    collector = GroupCollector({"r0": _names(OPROJ)})
    assert collector.add("rotary.inv_freq", _t()) == []
    assert "rotary.inv_freq" not in collector._held
    collector.add("o", _t())
    with pytest.raises(ConfigError, match="twice"):
        collector.add("o", _t())


def test_inputs_checked_against_the_first_update():
    known = describe_inputs([("w", torch.zeros(2, 3))])
    assert known == {"w": InputSpec((2, 3), torch.float32)}
    check_input("w", torch.ones(2, 3), known)
    with pytest.raises(ConfigError, match=r"torch\.bfloat16, the first update sent torch\.float32"):
        check_input("w", torch.ones(2, 3, dtype=torch.bfloat16), known)
    with pytest.raises(ConfigError, match=r"shape \(3, 2\), the first update sent \(2, 3\)"):
        check_input("w", torch.zeros(3, 2), known)
    with pytest.raises(ConfigError, match="not part of the first update"):
        check_input("x", torch.zeros(1), known)
    with pytest.raises(ConfigError, match=r"not a torch\.Tensor"):
        describe_inputs([("w", [1, 2])])
    with pytest.raises(ConfigError, match="twice"):
        describe_inputs([("w", torch.zeros(1)), ("w", torch.zeros(1))])
