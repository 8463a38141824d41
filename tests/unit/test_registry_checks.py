"""Checks against what engines published, before any write: a parameter this update feeds
must be published by its target (the byte plan refuses it otherwise), without building the
replica."""

from __future__ import annotations

import pytest

from p2pweights.errors import LayoutMismatchError
from p2pweights.plan.byte_plan import build_byte_plan
from p2pweights.source.inputs import ParamGroup
from p2pweights.wire.publication import RankPublication, WeightRegion


def _pub(names: list[str], role: str = "target") -> RankPublication:
    regions = {n: WeightRegion(4096 * (i + 1), 64) for i, n in enumerate(names)}
    return RankPublication("http://e:1", 1, "mooncake", regions, session_id="h:1", role=role)


def _plan(groups: list[ParamGroup], pub: RankPublication) -> None:
    sizes = {param: 64 for g in groups for param in g.param_names}
    build_byte_plan(
        {"draft": [(g.hf_names, g.param_names) for g in groups]},
        {"draft": sizes},
        {"draft": [pub]},
        2**20,
    )


def test_a_fed_parameter_the_engine_did_not_publish_is_refused_before_writing() -> None:
    groups = [ParamGroup(frozenset({"model.layers.3.eh_proj.weight"}), ("model.eh_proj.weight",))]
    _plan(groups, _pub(["model.eh_proj.weight"], "draft"))  # published: fine
    head = ParamGroup(frozenset({"model.layers.3.shared_head.head.weight"}), ("lm_head.weight",))
    with pytest.raises(LayoutMismatchError, match=r"http://e:1 rank 1 \(draft\).*lm_head.weight"):
        _plan([*groups, head], _pub(["model.eh_proj.weight"], "draft"))
