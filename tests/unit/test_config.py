"""SyncConfig: defaults, sizes as strings, frozen, unknown fields and bad values rejected."""

from __future__ import annotations

import pydantic
import pytest

from p2pweights import ConfigError, MooncakeConfig, NixlConfig, SyncConfig
from p2pweights.config import parse_bytes


def test_defaults():
    config = SyncConfig()
    assert config.transport == MooncakeConfig(protocol="rdma")
    assert config.buffer_bytes == 512 * 2**20
    assert (config.transfer_timeout_s, config.pause_mode) == (30.0, "retract")
    assert config.check_weight_update_equal is False and config.api_key is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1GiB", 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        (" 64 kib ", 65536),
        (4096, 4096),
        ("2048", 2048),
    ],
)
def test_sizes(text, expected):
    assert parse_bytes(text) == expected


def test_buffer_bytes_accepts_strings():
    assert SyncConfig(buffer_bytes="1GiB").buffer_bytes == 2**30


@pytest.mark.parametrize(
    "kwargs",
    [
        {"buffer_bytes": "lots"},
        {"buffer_bytes": 1024},
        {"transfer_timeout_s": 0},
        {"pause_mode": "later"},
        {"bogus": 1},
        {"transport": {"kind": "carrier-pigeon"}},
        {"trainer_rank": 2, "num_trainer_ranks": 2},
        {"num_trainer_ranks": 0},
    ],
)
def test_rejected(kwargs):
    # one error tree for users: pydantic's ValidationError surfaces as ConfigError (chained)
    with pytest.raises(ConfigError) as raised:
        SyncConfig(**kwargs)
    assert isinstance(raised.value.__cause__, pydantic.ValidationError)


def test_frozen():
    config = SyncConfig()
    with pytest.raises(ConfigError, match="frozen"):
        config.buffer_bytes = 2**30  # type: ignore[misc]


def test_transport_from_dict_and_env(monkeypatch):
    assert SyncConfig(transport={"kind": "mooncake", "protocol": "tcp"}).transport.protocol == "tcp"
    monkeypatch.setenv("SGLANG_REMOTE_INSTANCE_NIXL_BACKEND", "LIBFABRIC")
    assert NixlConfig().backend == "LIBFABRIC"
    assert NixlConfig(backend="UCX").backend == "UCX"


def test_delta_updates_are_off_by_default_and_refused_where_unsafe():
    from p2pweights.config import DeltaConfig

    assert SyncConfig().delta is None
    assert SyncConfig(delta=DeltaConfig()).delta == DeltaConfig(store="staging", max_fraction=0.3)
    with pytest.raises(ConfigError, match="verify_writes"):
        SyncConfig(delta=DeltaConfig(), verify_writes="off")
    with pytest.raises(ConfigError, match="pipeline stages"):
        SyncConfig(delta=DeltaConfig(), num_pipeline_stages=2)
    with pytest.raises(ConfigError, match="max_fraction"):
        DeltaConfig(max_fraction=0)
