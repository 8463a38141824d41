"""RankSpec derivation, table-driven against sglang's launcher arithmetic."""

from __future__ import annotations

import pytest

from p2pweights.errors import ConfigError
from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang.env import parallel_fields

# (server_info, engine_rank, expected fields)
CASES = [
    pytest.param({"tp_size": 1}, 0, {"tp_rank": 0, "attn_tp_size": 1, "moe_tp_size": 1}, id="tp1"),
    pytest.param(
        {"tp_size": 4},
        3,
        {"tp_rank": 3, "attn_tp_size": 4, "attn_tp_rank": 3, "moe_tp_size": 4, "moe_tp_rank": 3},
        id="tp4-rank3",
    ),
    pytest.param(
        {"tp_size": 2, "pp_size": 2},
        3,
        {"tp_rank": 1, "pp_rank": 1, "pp_size": 2, "attn_tp_rank": 1},
        id="tp2-pp2-rank3",
    ),
    pytest.param(
        {"tp_size": 8, "ep_size": 8},
        5,
        {"moe_ep_size": 8, "moe_ep_rank": 5, "moe_tp_size": 1, "moe_tp_rank": 0, "attn_tp_rank": 5},
        id="tp8-ep8",
    ),
    pytest.param(
        {"tp_size": 8, "ep_size": 2},
        5,
        {"moe_ep_size": 2, "moe_ep_rank": 1, "moe_tp_size": 4, "moe_tp_rank": 1},
        id="tp8-ep2",
    ),
    pytest.param(
        {"tp_size": 8, "dp_size": 4, "enable_dp_attention": True, "ep_size": 8},
        5,
        {
            "attn_dp_size": 4,
            "attn_tp_size": 2,
            "attn_tp_rank": 1,
            "attn_dp_rank": 2,
            "moe_ep_rank": 5,
        },
        id="dp-attention-deprecated-spelling",
    ),
    pytest.param(
        {"tp_size": 8, "dp_size": 1, "attn_dp_size": 8, "ep_size": 8},
        6,
        {"attn_dp_size": 8, "attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_rank": 6},
        id="dp-attention-resolved",
    ),
    pytest.param(
        {"tp_size": 4, "attn_cp_size": 2},
        3,
        {"attn_cp_size": 2, "attn_tp_size": 2, "attn_cp_rank": 1, "attn_tp_rank": 1},
        id="attn-cp2",
    ),
    pytest.param(
        {"tp_size": 4, "attn_cp_size": 2, "moe_dp_size": 1},
        2,
        {"moe_dp_rank": 1, "attn_cp_rank": 1},
        id="moe-dp-aliases-attn-cp",
    ),
    pytest.param(
        {"tp_size": 4, "dcp_size": 2},
        3,
        {"dcp_size": 2, "dcp_rank": 1},
        id="dcp2",
    ),
    pytest.param(
        {"tp_size": 2, "ep_size": None, "pp_size": None, "quantization": "fp8", "dtype": "auto"},
        1,
        {"tp_rank": 1, "moe_ep_size": 1, "pp_size": 1},
        id="nulls-and-extra-fields",
    ),
]


@pytest.mark.parametrize(("server_info", "engine_rank", "expected"), CASES)
def test_from_server_info(server_info: dict, engine_rank: int, expected: dict) -> None:
    spec = RankSpec.from_server_info(server_info, engine_rank)
    got = {name: getattr(spec, name) for name in expected}
    assert got == expected
    assert spec.tp_size == spec.attn_tp_size * spec.attn_dp_size * spec.attn_cp_size
    assert spec.tp_size == spec.moe_ep_size * spec.moe_dp_size * spec.moe_tp_size
    assert spec.world_rank == engine_rank


@pytest.mark.parametrize(
    ("server_info", "engine_rank"),
    [
        ({"tp_size": 2}, 2),
        ({"tp_size": 2}, -1),
        ({"tp_size": 4, "ep_size": 3}, 0),
        ({"tp_size": 4, "dp_size": 3, "enable_dp_attention": True}, 0),
        ({"tp_size": 0}, 0),
    ],
)
def test_rejects_impossible_layouts(server_info: dict, engine_rank: int) -> None:
    with pytest.raises(ConfigError):
        RankSpec.from_server_info(server_info, engine_rank)


def test_parallel_fields_groups_match_widths() -> None:
    spec = RankSpec.derive(tp_size=4, engine_rank=2, ep_size=2)
    fields = parallel_fields(spec)
    for name in ("tp", "attn_tp", "moe_ep", "moe_tp", "pp"):
        group = fields[f"{name}_group"]
        assert group.world_size == fields[f"{name}_size"]
        assert group.rank_in_group == fields[f"{name}_rank"]
    assert fields["tp_group"].is_last_rank is False
    assert fields["moe_ep_group"].is_last_rank is True
    assert fields["dcp_group"] is None


@pytest.mark.parametrize(
    ("arg", "value"),
    [
        ("ep_num_redundant_experts", 32),
        ("init_expert_location", "/placements/layout.pt"),
        ("enable_eplb", True),
        ("elastic_ep_backend", "mooncake"),
        ("enable_elastic_expert_backup", True),
        ("dwdp_size", 2),
        ("kt_weight_path", "/models/kt"),
    ],
)
def test_unreproducible_expert_placement_names_the_server_arg(arg: str, value: object) -> None:
    from p2pweights.replica.sglang.env import check_reproducible_layout

    with pytest.raises(ConfigError, match=arg):
        check_reproducible_layout({"tp_size": 8, "ep_size": 8, arg: value})


def test_default_expert_placement_is_accepted() -> None:
    from p2pweights.replica.sglang.env import check_reproducible_layout

    check_reproducible_layout(
        {
            "ep_num_redundant_experts": 0,
            "init_expert_location": "trivial",
            "enable_eplb": False,
            "elastic_ep_backend": None,
            "dwdp_size": 1,
        }
    )
