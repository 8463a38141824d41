"""Which engine ranks share a replica: every server arg counts unless known not to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2pweights.replica.layout_key import (
    ENGINE_LOCAL_ARGS,
    NOT_BYTE_RELEVANT,
    SAME_MODEL,
    LayoutKey,
    layout_args,
)
from p2pweights.replica.ranks import RankSpec

# a few real ServerArgs field names; the key only reads names it is given
NAMES = frozenset(
    {
        "model_path",
        "tokenizer_path",
        "host",
        "port",
        "tp_size",
        "ep_size",
        "dtype",
        "quantization",
        "moe_runner_backend",
        "mem_fraction_static",
        "log_level",
        "api_key",
        "weight_version",
        "speculative_algorithm",
        "speculative_draft_model_path",
    }
)

BASE = {
    "model_path": "/engine/a/model",
    "tokenizer_path": "/engine/a/model",
    "host": "10.0.0.1",
    "port": 30000,
    "tp_size": 4,
    "ep_size": 1,
    "dtype": "bfloat16",
    "quantization": None,
    "moe_runner_backend": "auto",
    "mem_fraction_static": 0.8,
    "log_level": "info",
    "api_key": None,
    "weight_version": "default",
}


def _args(**changes: object) -> tuple[tuple[str, str], ...]:
    return layout_args({**BASE, **changes}, NAMES)


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"port": 30001, "host": "10.0.0.2"}, id="address"),
        pytest.param({"mem_fraction_static": 0.5}, id="memory-fraction"),
        pytest.param({"log_level": "debug"}, id="logging"),
        pytest.param({"api_key": "secret"}, id="api-key"),
        pytest.param({"model_path": "/engine/b", "tokenizer_path": "/engine/b"}, id="paths"),
        pytest.param({"weight_version": "step-40"}, id="weight-version"),
    ],
)
def test_args_that_do_not_change_bytes_share_a_key(changes: dict) -> None:
    assert _args(**changes) == _args()


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"ep_size": 2}, id="ep_size"),
        pytest.param({"quantization": "fp8"}, id="quantization"),
        pytest.param({"moe_runner_backend": "triton"}, id="moe_runner_backend"),
        pytest.param({"dtype": "float16"}, id="dtype"),
    ],
)
def test_byte_relevant_args_keep_engines_apart(changes: dict) -> None:
    assert _args(**changes) != _args()


def test_an_unclassified_server_arg_counts() -> None:
    """A ServerArgs field this module has never heard of (added by a later sglang) counts."""
    names = NAMES | {"enable_new_weight_layout"}
    base = layout_args({**BASE, "enable_new_weight_layout": False}, names)
    assert layout_args({**BASE, "enable_new_weight_layout": True}, names) != base
    assert "enable_new_weight_layout" not in NOT_BYTE_RELEVANT


def test_runtime_state_of_server_info_is_not_a_server_arg() -> None:
    runtime = {
        "version": "0.5.23",
        "startup_time": 1712.5,
        "internal_states": [{"last_gen_throughput": 42.0}],
        "p2pweights_engine_state": {"session": "abc"},
    }
    assert layout_args({**BASE, **runtime}, NAMES) == _args()
    assert {name for name, _ in _args()} == {"dtype", "ep_size", "moe_runner_backend", "tp_size"}


def test_none_counts_as_unset() -> None:
    without = {k: v for k, v in BASE.items() if k != "quantization"}
    assert layout_args(without, NAMES) == _args()


def test_a_same_model_draft_path_is_not_an_engine_path() -> None:
    same = _args(speculative_draft_model_path=BASE["model_path"])
    elsewhere = layout_args(
        {**BASE, "model_path": "/b", "speculative_draft_model_path": "/b"}, NAMES
    )
    assert same == elsewhere
    assert ("speculative_draft_model_path", json.dumps(SAME_MODEL)) in same
    assert _args(speculative_draft_model_path="/engine/a/draft") != same


def test_key_holds_model_rank_role_and_sglang() -> None:
    rank = RankSpec.derive(tp_size=4, engine_rank=1)
    key = LayoutKey("abc", rank, "target", "0.5.23", _args())
    assert key == LayoutKey(
        "abc", RankSpec.derive(tp_size=4, engine_rank=1), "target", "0.5.23", _args()
    )
    assert len({key, LayoutKey("abc", rank, "draft", "0.5.23", _args())}) == 2
    assert len({key, LayoutKey("abd", rank, "target", "0.5.23", _args())}) == 2
    assert len({key, LayoutKey("abc", rank, "target", "0.5.22", _args())}) == 2
    other_rank = RankSpec.derive(tp_size=4, engine_rank=2)
    assert len({key, LayoutKey("abc", other_rank, "target", "0.5.23", _args())}) == 2


def test_the_ignore_list_names_installed_server_args() -> None:
    """A typo or a field sglang renamed would silently stop ignoring anything."""
    pytest.importorskip("sglang")
    from p2pweights.replica.sglang.env import server_args_names

    names = server_args_names()
    assert sorted(NOT_BYTE_RELEVANT - names) == []
    assert ENGINE_LOCAL_ARGS <= NOT_BYTE_RELEVANT
    # the args the replica reads for its bytes all count
    for name in ("tp_size", "ep_size", "dtype", "quantization", "moe_runner_backend"):
        assert name in names and name not in NOT_BYTE_RELEVANT


def test_replica_for_shares_handles_by_layout(tmp_path: Path) -> None:
    """Handles are shared (and built lazily) by key; nothing is built here."""
    pytest.importorskip("sglang")
    from p2pweights.replica.registry import replica_for
    from p2pweights.testing import model_config, write_model_dir

    # a config of its own (the handles are process-wide: another test may have built one)
    config = {**model_config("qwen3-tiny"), "_name_or_path": str(tmp_path)}
    folder = write_model_dir(config, tmp_path / "qwen3-tiny")
    a = {"model_path": "/engine/a", "tp_size": 2, "port": 30000, "log_level": "info"}
    b = {**a, "model_path": "/engine/b", "port": 31000, "log_level": "debug", "version": "x"}
    first = replica_for(a, 1, str(folder))
    assert replica_for(b, 1, str(folder)) is first
    assert replica_for({**a, "dtype": "float16"}, 1, str(folder)) is not first
    assert replica_for(a, 0, str(folder)) is not first
    assert replica_for(a, 1, str(folder), role="draft") is not first
    assert first._replica is None
