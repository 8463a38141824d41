"""SyncConfig: defaults, sizes as strings, frozen, unknown fields and bad values rejected."""

from __future__ import annotations

import pydantic
import pytest

from p2pweights import (
    ConfigError,
    MooncakeConfig,
    NixlConfig,
    SyncConfig,
    Timeouts,
    TrainerTopology,
    WeightSyncSession,
)
from p2pweights.config import parse_bytes


def test_defaults():
    config = SyncConfig()
    assert config.transport == MooncakeConfig(protocol="rdma")
    assert config.buffer_bytes == 512 * 2**20
    assert (config.timeouts.transfer, config.pause_mode) == (30.0, "retract")
    assert config.timeouts == Timeouts(transfer=30, control=15, read=60, end_update=None)
    assert config.verify_with_weight_checker is False and config.api_key is None


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
        {"timeouts": {"transfer": 0}},
        {"pause_mode": "later"},
        {"bogus": 1},
        {"transport": {"kind": "carrier-pigeon"}},
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
        SyncConfig(delta=DeltaConfig()).with_topology(TrainerTopology(num_pipeline_stages=2))
    with pytest.raises(ConfigError, match="max_fraction"):
        DeltaConfig(max_fraction=0)


# -- issue 30: names that say what a user chooses; the old ones for one more release ----------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("check_weight_update_equal", "verify_with_weight_checker"),
        ("check_finite", "verify_finite_inputs"),
    ],
)
def test_renamed_checks_still_work_with_a_warning(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"SyncConfig.{old} is now SyncConfig.{new}"):
        config = SyncConfig(**{old: True})
    assert getattr(config, new) is True
    assert old not in config.model_dump()  # the dump (and a copy made from it) uses the new name
    assert SyncConfig(**config.model_dump()) == config
    with pytest.warns(DeprecationWarning, match=new):
        assert getattr(config, old) is True  # reading the old name too
    with (
        pytest.raises(ConfigError, match=f"both {old} and {new}"),
        pytest.warns(DeprecationWarning),
    ):
        SyncConfig(**{old: True, new: False})


def test_new_check_names_do_not_warn(recwarn: pytest.WarningsRecorder) -> None:
    config = SyncConfig(verify_with_weight_checker=True, verify_finite_inputs=True)
    assert config.verify_with_weight_checker and config.verify_finite_inputs
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_end_update_timeout_is_its_own_setting() -> None:
    assert SyncConfig().timeouts.end_update is None  # unset: read
    config = SyncConfig(timeouts=Timeouts(read=10, end_update=900))
    assert (config.timeouts.read, config.timeouts.end_update) == (10, 900)
    with pytest.raises(ConfigError, match="positive"):
        SyncConfig(timeouts=Timeouts(end_update=0))
    with pytest.raises(ConfigError, match="positive"):
        SyncConfig(timeouts={"control": -1})


OLD_TIMEOUTS = [
    ("transfer_timeout_s", "transfer", 90.0),
    ("control_timeout_s", "control", 5.0),
    ("http_timeout_s", "read", 300.0),
    ("end_update_timeout_s", "end_update", 900.0),
]


def test_timeouts_given_as_one_object_do_not_warn(recwarn: pytest.WarningsRecorder) -> None:
    config = SyncConfig(timeouts=Timeouts(transfer=90, control=5, read=300, end_update=900))
    assert config.timeouts.model_dump() == {
        "transfer": 90,
        "control": 5,
        "read": 300,
        "end_update": 900,
    }
    assert SyncConfig(timeouts={"transfer": 90}).timeouts == Timeouts(transfer=90)
    dumped = SyncConfig(**config.model_dump())  # a dump reads back, the timeouts nested
    assert dumped.timeouts == config.timeouts
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize(("old", "new", "value"), OLD_TIMEOUTS)
def test_the_old_timeout_fields_still_work_with_a_warning(old: str, new: str, value: float) -> None:
    message = rf"SyncConfig.{old} is now SyncConfig.timeouts.{new} .*Timeouts\({new}=\.\.\.\)"
    with pytest.warns(DeprecationWarning, match=message):
        config = SyncConfig(**{old: value})
    assert getattr(config.timeouts, new) == value
    assert config.timeouts == Timeouts(**{new: value})  # the others keep their defaults
    with pytest.warns(DeprecationWarning, match=message):
        assert getattr(config, old) == value  # reading the old name warns too
    with pytest.warns(DeprecationWarning, match=message):
        copied = SyncConfig(timeouts=Timeouts(transfer=7)).model_copy(update={old: value})
    assert getattr(copied.timeouts, new) == value
    if new != "transfer":
        assert copied.timeouts.transfer == 7  # a copy keeps the timeouts it had
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="positive"):
        SyncConfig(**{old: 0})
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ConfigError, match=f"both timeouts and {old}"),
    ):
        SyncConfig(timeouts=Timeouts(), **{old: value})


def _end_update_bound(config: SyncConfig, monkeypatch: pytest.MonkeyPatch) -> object:
    """The bound on end_weight_update that connecting with ``config`` gives the engines."""
    import torch

    from p2pweights.engines.fleet import Fleet
    from p2pweights.sync_connection import Connection

    given = []

    def connect(endpoints: object, options: object) -> Fleet:
        given.append(options)
        raise RuntimeError("connected no further")

    monkeypatch.setattr(Fleet, "connect", connect)
    with pytest.raises(RuntimeError, match="no further"):
        Connection(config, torch.device("cpu")).connect(["http://engine:1"])
    return given[0].end_update_timeout_s  # type: ignore[attr-defined]


def test_end_update_timeout_follows_the_read_timeout_however_the_config_was_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # unset, it is the read bound (which bounded end_weight_update before it had a name),
    # in a config built, copied or rebuilt from a dump with another read bound
    dump = SyncConfig().model_dump()
    for config in [
        SyncConfig(timeouts=Timeouts(read=300)),
        SyncConfig().model_copy(update={"timeouts": Timeouts(read=300)}),
        SyncConfig(**{**dump, "timeouts": {**dump["timeouts"], "read": 300}}),
    ]:
        assert _end_update_bound(config, monkeypatch) == 300
    assert _end_update_bound(SyncConfig(), monkeypatch) == 60
    given = SyncConfig(timeouts=Timeouts(read=300, end_update=900))
    assert _end_update_bound(given, monkeypatch) == 900
    with pytest.warns(DeprecationWarning):
        old = SyncConfig(end_update_timeout_s=900).model_copy(update={"http_timeout_s": 300})
    assert _end_update_bound(old, monkeypatch) == 900


def test_end_weight_update_is_bounded_by_its_own_timeout() -> None:
    """The client gives end_weight_update its own bound and names it when it runs out."""
    import httpx

    from p2pweights import EngineUnreachable
    from p2pweights.engines.client import EngineClient

    timeouts: dict[str, object] = {}

    def handle(request: httpx.Request) -> httpx.Response:
        timeouts[request.url.path] = request.extensions["timeout"]["read"]
        if request.url.path == "/end_weight_update":
            raise httpx.ReadTimeout("slow", request=request)
        return httpx.Response(200, json={"success": True})

    client = EngineClient(
        "http://engine:1",
        timeout_s=5,
        control_timeout_s=2,
        end_update_timeout_s=120,
        transport=httpx.MockTransport(handle),
    )
    client.begin_weight_update()
    with pytest.raises(EngineUnreachable, match=r"within 120 s \(timeouts.end_update\)"):
        client.end_weight_update()
    client.close()
    assert timeouts == {"/begin_weight_update": 2, "/end_weight_update": 120}


@pytest.mark.parametrize(
    "fields",
    [{"rank": 2, "num_ranks": 2}, {"rank": -1}, {"num_ranks": 0}, {"num_pipeline_stages": 0}],
)
def test_topology_rejected(fields):
    with pytest.raises(ConfigError):
        TrainerTopology(**fields)


def test_topology_is_given_to_the_session_not_the_config():
    topology = TrainerTopology(rank=1, num_ranks=2)
    session = WeightSyncSession(SyncConfig(), topology=topology, agree=lambda ok: ok)
    assert session.topology == topology
    assert (session.config.trainer_rank, session.config.num_senders) == (1, 2)
    assert not session.config.leads
    assert WeightSyncSession(SyncConfig()).topology == TrainerTopology()  # one sending process


def test_topology_fields_in_the_config_still_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"SyncConfig\(trainer_rank, num_trainer_ranks\)"):
        config = SyncConfig(trainer_rank=1, num_trainer_ranks=2)
    session = WeightSyncSession(config, agree=lambda ok: ok)
    assert session.topology == TrainerTopology(rank=1, num_ranks=2)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="outside"):
        SyncConfig(trainer_rank=2, num_trainer_ranks=2)
    # topology= replaces what the config says
    replaced = WeightSyncSession(config, topology=TrainerTopology())
    assert replaced.topology == TrainerTopology()


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("check_weight_update_equal", "verify_with_weight_checker"),
        ("check_finite", "verify_finite_inputs"),
    ],
)
def test_renamed_checks_in_model_copy_work_as_in_the_constructor(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"SyncConfig.{old} is now SyncConfig.{new}"):
        copied = SyncConfig().model_copy(update={old: True})
    assert getattr(copied, new) is True
    assert old not in copied.model_dump() and new in copied.model_fields_set
    with (
        pytest.raises(ConfigError, match=f"both {old} and {new}"),
        pytest.warns(DeprecationWarning),
    ):
        SyncConfig().model_copy(update={old: True, new: False})


def test_topology_fields_in_model_copy_warn(recwarn: pytest.WarningsRecorder) -> None:
    with pytest.warns(DeprecationWarning, match=r"SyncConfig\(trainer_rank, num_trainer_ranks\)"):
        copied = SyncConfig().model_copy(update={"trainer_rank": 1, "num_trainer_ranks": 2})
    assert copied.topology == TrainerTopology(rank=1, num_ranks=2)
    recwarn.clear()
    SyncConfig().model_copy(update={"timeouts": Timeouts(read=5), "trainer_rank": 0})
    SyncConfig().with_topology(TrainerTopology(rank=1, num_ranks=2))
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_with_topology_keeps_the_fields_the_user_set(recwarn: pytest.WarningsRecorder) -> None:
    config = SyncConfig(buffer_bytes="64MiB")
    placed = config.with_topology(TrainerTopology(rank=1, num_ranks=2))
    assert placed.model_fields_set == {"buffer_bytes"}
    topology = TrainerTopology(rank=1, num_ranks=2)
    session = WeightSyncSession(config, topology=topology, agree=lambda ok: ok)
    assert SyncConfig(**session.config.model_dump(exclude_unset=True)) == config
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_the_verification_policy_is_said_where_the_config_is_made(caplog):
    import logging

    from p2pweights.config import DeltaConfig

    caplog.set_level(logging.INFO, logger="p2pweights.config")
    assert "/weights_checker" in SyncConfig().verification_policy
    assert "updated unverified" in SyncConfig().verification_policy
    assert "connect refuses" in SyncConfig(verify_writes="always").verification_policy
    assert caplog.records == []  # nothing to say: the default verifies where it can
    delta = SyncConfig(delta=DeltaConfig())
    (said,) = [r.getMessage() for r in caplog.records]
    assert "delta updates need verified engines" in said and said.endswith(
        delta.verification_policy
    )
    assert "P2PWEIGHTS_WRITE_DIGESTS=0" in said and "connect refuses" in said
    with pytest.raises(ConfigError, match="delta updates need verified engines"):
        SyncConfig(delta=DeltaConfig(), verify_writes="off")
