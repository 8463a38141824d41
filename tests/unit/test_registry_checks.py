"""Checks a replica handle makes against what engines published, before any write."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pweights.engines.published import RankPublication, WeightRegion
from p2pweights.errors import LayoutMismatchError
from p2pweights.replica.registry import ReplicaHandle
from p2pweights.source.inputs import ParamGroup


def _pub(names: list[str], role: str = "target") -> RankPublication:
    regions = {n: WeightRegion(4096 * (i + 1), 64) for i, n in enumerate(names)}
    return RankPublication("http://e:1", 1, "mooncake", regions, session_id="h:1", role=role)


def test_a_fed_parameter_the_engine_did_not_publish_is_refused_before_writing() -> None:
    handle = ReplicaHandle("key", Path("config.json"), {}, spec=None, role="draft")
    groups = [ParamGroup(frozenset({"model.layers.3.eh_proj.weight"}), ("model.eh_proj.weight",))]
    handle.check_writable(groups, [_pub(["model.eh_proj.weight"], "draft")])  # published: fine
    head = ParamGroup(frozenset({"model.layers.3.shared_head.head.weight"}), ("lm_head.weight",))
    with pytest.raises(LayoutMismatchError, match=r"http://e:1 rank 1 \(draft\).*lm_head.weight"):
        handle.check_writable([*groups, head], [_pub(["model.eh_proj.weight"], "draft")])
