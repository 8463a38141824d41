"""What a user sees of an update: the report says, per engine, whether and how its writes
were verified, what it was written over and how long this update kept it paused; a
delta update says what went as deltas; an unverified engine is warned about once per
session with the setting that turns verification on; ``api_key`` never shows.

The engines, client, replica and transport are test_session_sequence's fakes (sglang's
update rules), with test_verified_writes' engines that record digests."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
import test_verified_writes
from test_session_sequence import FakeEngine, _holds, _tensors
from test_verified_writes import DigestEngine

from p2pweights import SyncConfig, WeightSyncSession
from p2pweights.config import MooncakeConfig
from p2pweights.engines.client import EngineClient
from p2pweights.engines.endpoint import EngineEndpoint
from p2pweights.engines.fleet import ConnectOptions
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.errors import EngineError
from p2pweights.report import DeltaReport, EngineReport, UpdateReport

engines = test_verified_writes.engines  # the fixture: fake engines, digesting or not
CONFIG = SyncConfig(buffer_bytes="1MiB")
CHECK_LOGGER = "p2pweights.verification.check"


def _plugin_engine(url: str) -> FakeEngine:
    """An sglang server with the p2pweights plugin started with ``P2PWEIGHTS_WRITE_DIGESTS=0``:
    its publication is live (the plugin's; the fakes publish live where storage moves) and
    says no write digests."""
    return FakeEngine(url, moves_storage=True)


def _unverified_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == CHECK_LOGGER and r.levelno == logging.WARNING
    ]


# -- verification, per engine ------------------------------------------------------------------


def test_the_report_says_which_engines_were_verified_and_how(engines):
    engines.setdefault("http://checked", DigestEngine("http://checked"))
    engines.setdefault("http://plain", FakeEngine("http://plain"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://checked", "http://plain"])
        report = session.update(_tensors(3))
    checked, plain = report.engines["http://checked"], report.engines["http://plain"]
    assert checked.verified_by == ("write_digests",) and checked.verified
    assert checked.unverified_reason is None
    assert plain.verified_by == () and not plain.verified
    assert plain.unverified_reason is not None
    assert "SGLANG_PLUGINS=p2pweights_nixl" in plain.unverified_reason
    assert "P2PWEIGHTS_WRITE_DIGESTS" in plain.unverified_reason
    summary = report.summary()
    assert "verified by write digests: 1 engine" in summary
    assert "NOT verified: http://plain" in summary


def test_the_engines_weight_check_counts_as_verification_on_the_update_it_ran(engines):
    engines.setdefault("http://plain", FakeEngine("http://plain"))
    config = SyncConfig(buffer_bytes="1MiB", verify_with_weight_checker=True)
    with WeightSyncSession(config) as session:
        session.connect(["http://plain"])
        first = session.update(_tensors(0))  # the engine's own weights: the check passes
        second = session.update(_tensors(1))
    assert first.engines["http://plain"].verified_by == ("weight_check",)
    assert second.engines["http://plain"].verified_by == ()


def test_write_digests_and_the_weight_check_both_count(engines):
    engines.setdefault("http://e0", DigestEngine("http://e0"))
    config = SyncConfig(buffer_bytes="1MiB", verify_with_weight_checker=True)
    with WeightSyncSession(config) as session:
        session.connect(["http://e0"])
        report = session.update(_tensors(0))
    assert report.engines["http://e0"].verified_by == ("write_digests", "weight_check")


def test_an_unverified_engine_is_warned_about_once_per_session_with_the_fix(engines, caplog):
    caplog.set_level(logging.INFO, logger=CHECK_LOGGER)
    engines.setdefault("http://plain", FakeEngine("http://plain"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://plain"])
        session.update(_tensors(1))
        session.update(_tensors(2))
        session.connect(["http://plain"])  # a reconnect is the same session
        session.update(_tensors(3))
    warnings = _unverified_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "http://plain" in warnings[0] and "not verified" in warnings[0]
    assert "P2PWEIGHTS_WRITE_DIGESTS" in warnings[0]
    with WeightSyncSession(CONFIG) as session:  # a new session warns again
        session.connect(["http://plain"])
        session.update(_tensors(4))
    assert len(_unverified_warnings(caplog)) == 2


def test_verify_writes_off_is_reported_and_not_warned_about(engines, caplog):
    caplog.set_level(logging.INFO, logger=CHECK_LOGGER)
    engines.setdefault("http://e0", DigestEngine("http://e0"))
    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB", verify_writes="off")) as session:
        session.connect(["http://e0"])
        report = session.update(_tensors(1))
    reason = report.engines["http://e0"].unverified_reason
    assert reason is not None and "verify_writes='off'" in reason
    assert _unverified_warnings(caplog) == []


def test_a_plugin_engine_without_digests_is_told_the_setting_it_lacks(engines, caplog):
    caplog.set_level(logging.INFO, logger=CHECK_LOGGER)
    engines.setdefault("http://plugin", _plugin_engine("http://plugin"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://plugin"])
        report = session.update(_tensors(1))
    reason = report.engines["http://plugin"].unverified_reason
    assert reason is not None and "P2PWEIGHTS_WRITE_DIGESTS=0" in reason
    assert "SGLANG_PLUGINS" not in reason  # it runs the plugin already
    always = SyncConfig(buffer_bytes="1MiB", verify_writes="always")
    with WeightSyncSession(always) as session, pytest.raises(EngineError) as refused:
        session.connect(["http://plugin"])
    assert "P2PWEIGHTS_WRITE_DIGESTS=0" in str(refused.value)
    assert "SGLANG_PLUGINS" not in str(refused.value)


def test_a_released_sglang_engine_refused_on_always_is_told_both_settings(engines):
    engines.setdefault("http://plain", FakeEngine("http://plain"))
    always = SyncConfig(buffer_bytes="1MiB", verify_writes="always")
    with WeightSyncSession(always) as session, pytest.raises(EngineError) as refused:
        session.connect(["http://plain"])
    message = str(refused.value)
    assert "SGLANG_PLUGINS=p2pweights_nixl" in message and "P2PWEIGHTS_WRITE_DIGESTS" in message


# -- what the update did -----------------------------------------------------------------------


def test_the_report_names_the_transport_and_protocol_of_each_engine(engines):
    engines.setdefault("http://e0", DigestEngine("http://e0"))
    config = SyncConfig(buffer_bytes="1MiB", transport=MooncakeConfig(protocol="tcp"))
    with WeightSyncSession(config) as session:
        session.connect(["http://e0"])
        report = session.update(_tensors(1))
    engine = report.engines["http://e0"]
    assert (engine.transport, engine.protocol) == ("mooncake", "tcp")
    assert engine.num_ranks_written == 1 and engine.bytes_written == report.bytes_written
    assert "over mooncake (tcp)" in report.summary()


def test_a_delta_summary_says_what_went_as_deltas_and_never_shows_zero_throughput():
    report = UpdateReport(
        version="7",
        bytes_by_target={("http://e0", 0): 5_200_000},
        seconds=0.116,
        delta=DeltaReport(
            num_delta_params=30,
            num_full_params=2,
            num_unchanged_params=4,
            full_bytes=103_000_000,
            sent_bytes=5_200_000,
            store_bytes=103_000_000,
        ),
    )
    summary = report.summary()
    assert "30 parameter(s) as deltas, 2 in full, 4 unchanged" in summary
    assert "5.0 % of the 103.0 MB a full update writes" in summary
    assert "0.00 GB/s" not in summary and "44.8 MB/s" in summary
    assert report.delta is not None and report.delta.fraction == pytest.approx(5.2 / 103)


def test_every_report_field_has_a_docstring():
    import ast
    import inspect

    from p2pweights import report as report_module

    tree = ast.parse(inspect.getsource(report_module))
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or node.name not in {
            "UpdateReport",
            "EngineReport",
            "DeltaReport",
        }:
            continue
        body = node.body
        for i, item in enumerate(body):
            if isinstance(item, ast.AnnAssign):
                following = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(following, ast.Expr) and isinstance(
                    getattr(following, "value", None), ast.Constant
                )
                assert documented, f"{node.name}.{ast.unparse(item.target)} has no docstring"


# -- paused seconds ----------------------------------------------------------------------------


def test_an_engine_adopted_torn_counts_its_pause_from_this_update_not_from_connect(engines):
    torn = FakeEngine("http://torn", paused=True, version=f"{UPDATING_PREFIX}3")
    engines["http://torn"] = torn
    engines.setdefault("http://fresh", FakeEngine("http://fresh"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://fresh", "http://torn"])
        time.sleep(0.3)  # the trainer's step between connect and its first update
        started = time.monotonic()
        report = session.update(_tensors(2))
        took = time.monotonic() - started
    assert torn.running and _holds(torn, 2)
    assert report.engines["http://torn"].pause_made is False
    assert report.engines["http://fresh"].pause_made is True
    assert report.paused_s["http://torn"] <= took
    assert "http://torn was paused already when this update began" in report.summary()


# -- the api key is a secret -------------------------------------------------------------------


def test_the_api_key_never_shows_in_a_repr_or_a_dump():
    config = SyncConfig(api_key="s3cret-key")
    endpoint = EngineEndpoint("http://e0", api_key="s3cret-key")
    options = ConnectOptions("mooncake", 1.0, 1.0, config.api_key)
    for shown in (
        repr(config),
        str(config),
        config.model_dump_json(),
        repr(endpoint),
        repr(options),
        repr(SyncConfig(api_key=config.api_key)),
    ):
        assert "s3cret-key" not in shown, shown
    assert config.api_key is not None and config.api_key.get_secret_value() == "s3cret-key"
    assert endpoint.api_key is not None and endpoint.api_key.get_secret_value() == "s3cret-key"
    assert SyncConfig().api_key is None and EngineEndpoint("http://e0").api_key is None


def test_the_api_key_is_sent_as_the_bearer_token(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"weight_version": "1"})

    config = SyncConfig(api_key="s3cret-key")
    client = EngineClient(
        "http://e0", api_key=config.api_key, transport=httpx.MockTransport(answer)
    )
    client.weight_version()
    client.close()
    assert seen[0].headers["Authorization"] == "Bearer s3cret-key"
    assert "s3cret-key" not in repr(client._http.headers)
    assert "s3cret-key" not in caplog.text


def test_a_report_without_engines_still_reads_well():
    report = UpdateReport(version="1", bytes_by_target={})
    assert report.paused_s == {} and report.engines == {} and report.delta is None
    assert report.summary().startswith("version 1: 0.0 MB")


def test_engine_report_of_a_rank_that_does_not_drive_the_engines():
    engine = EngineReport(
        url="http://e0",
        transport="nixl",
        protocol="UCX",
        num_ranks_written=2,
        bytes_written=10,
        verified_by=("write_digests",),
    )
    assert engine.paused_s is None and engine.pause_made is None and engine.verified


def test_an_engine_rank_written_without_a_digest_is_not_counted_as_verified():
    from p2pweights.verification.check import WriteCheck

    check = WriteCheck(engines={"http://e0": object()})  # type: ignore[dict-item]
    written = {("http://e0", 0), ("http://e0", 1)}
    digests = {("http://e0", 0, "target"): {"w": "d0"}, ("http://e0", 1, "target"): {}}
    by, why = check.verification("http://e0", written, digests)
    assert by == () and why is not None and "engine rank(s) 1" in why
    digests[("http://e0", 1, "target")] = {"w": "d1"}
    assert check.verification("http://e0", written, digests) == (("write_digests",), None)
    assert check.verification("http://other", written, digests)[1] is not None


def test_a_fleet_summary_groups_engines_by_what_happened_to_them():
    why = "it records no write digests (released sglang's own publication); start it with ..."
    engines = {
        f"http://e{i}": EngineReport(
            f"http://e{i}",
            "mooncake",
            "rdma",
            1,
            100_000,
            verified_by=("write_digests",) if i < 6 else (),
            unverified_reason=None if i < 6 else why,
            paused_s=0.1 * i,
            pause_made=i != 3,
        )
        for i in range(8)
    }
    report = UpdateReport(
        version="2",
        bytes_by_target={(url, 0): 100_000 for url in engines},
        seconds=0.25,
        engines=engines,
    )
    lines = report.summary().splitlines()
    assert lines[0] == (
        "version 2: 800.0 kB to 8 engine rank(s) of 8 engine(s) in 0.250 s (3.2 MB/s)"
    )
    assert lines[1] == "  written over mooncake (rdma)"
    assert lines[2] == "  verified by write digests: 6 engine(s)"
    assert lines[3] == f"  NOT verified: http://e6, http://e7: {why}"
    assert lines[4].startswith("  paused up to 0.700 s (http://e7); http://e3 was paused already")
    assert lines[5].startswith("  inputs NOT checked for NaN / Inf")
    assert len(lines) == 7  # and the stages


def test_the_protocol_reported_is_the_one_the_transport_writes_over(engines, monkeypatch):
    from test_session_sequence import FakeTransport

    from p2pweights import sync_connection as connection_module

    class TcpTransport(FakeTransport):
        @property
        def protocol(self) -> str:
            return "tcp"  # asked for "auto", Mooncake found no RDMA device

    monkeypatch.setattr(connection_module, "create_transport", lambda config: TcpTransport(engines))
    engines.setdefault("http://e0", DigestEngine("http://e0"))
    config = SyncConfig(buffer_bytes="1MiB", transport=MooncakeConfig(protocol="auto"))
    with WeightSyncSession(config) as session:
        session.connect(["http://e0"])
        report = session.update(_tensors(1))
    assert report.engines["http://e0"].protocol == "tcp"


def test_a_delta_report_says_whether_the_update_went_as_deltas_and_why():
    from p2pweights.delta.policy import Decision
    from p2pweights.delta.sender import DeltaSummary

    summary = DeltaSummary(
        full_bytes=100,
        sent_bytes=100,
        num_full_slots=3,
        decision=Decision("full", False, "predicted", 0.2, 0.1),
    )
    delta = DeltaReport.of(summary)
    assert delta.decision == (
        "sent in full: faster (minimising update time; predicted writes and compare: "
        "delta 0.200 s, full 0.100 s)"
    )
    report = UpdateReport(version="1", bytes_by_target={("http://e0", 0): 100}, delta=delta)
    assert "sent in full: faster" in report.summary()


# -- metrics for a step logger, and the report as JSON (issue 41 item 1) -----------------------


def _full_report() -> UpdateReport:
    return UpdateReport(
        version="7",
        bytes_by_target={("http://a", 0): 3_000, ("http://a", 1): 1_000, ("http://b", 0): 2_000},
        stage_seconds={"load": 0.25, "wait": 0.5},
        seconds=2.0,
        engines={
            "http://a": EngineReport(
                "http://a", "mooncake", "tcp", 2, 4_000, ("write_digests",), None, 0.5, True
            ),
            "http://b": EngineReport(
                "http://b", "mooncake", "tcp", 1, 2_000, (), "no digests served", 0.75, False
            ),
        },
        delta=DeltaReport(
            num_delta_params=3,
            num_full_params=1,
            num_unchanged_params=2,
            full_bytes=8_000,
            sent_bytes=2_000,
            store_bytes=8_000,
            decision="deltas: predicted faster",
        ),
        num_control_calls=9,
        control_call_seconds=0.125,
        gathered_bytes_by_tensor={"model.layers.0.self_attn.q_proj.weight": 96},
    )


def test_metrics_are_flat_numbers_under_stable_documented_names():
    metrics = _full_report().metrics(prefix="p2pweights/")
    assert metrics == {
        "p2pweights/seconds": 2.0,
        "p2pweights/bytes": 6_000,
        "p2pweights/gb_per_s": 6_000 / 2.0 / 1e9,
        "p2pweights/num_engines": 2,
        "p2pweights/num_engine_ranks": 3,
        "p2pweights/engines_verified": 1,
        "p2pweights/engines_unverified": 1,
        "p2pweights/control_calls": 9,
        "p2pweights/control_call_s": 0.125,
        "p2pweights/inputs_checked_finite": 0,
        "p2pweights/gathered_bytes": 96,
        "p2pweights/max_engine_rank_bytes": 3_000,
        "p2pweights/max_engine_rank_gb_per_s": 3_000 / 2.0 / 1e9,
        "p2pweights/paused_s_max": 0.75,
        "p2pweights/delta_fraction": 0.25,
        "p2pweights/delta_sent_bytes": 2_000,
        "p2pweights/delta_params": 3,
        "p2pweights/full_params": 1,
        "p2pweights/unchanged_params": 2,
        "p2pweights/load_s": 0.25,
        "p2pweights/wait_s": 0.5,
    }
    assert all(type(v) in (int, float) for v in metrics.values())
    assert set(_full_report().metrics(prefix="")) == {k.split("/")[1] for k in metrics}


def test_metrics_of_a_plain_report_leave_out_what_it_does_not_know():
    metrics = UpdateReport(version="1", bytes_by_target={}).metrics()
    assert metrics["p2pweights/seconds"] == 0.0 and metrics["p2pweights/gb_per_s"] == 0.0
    assert not any(("paused" in k) or ("delta" in k) or ("max_" in k) for k in metrics)


def test_the_report_is_json_able_and_keeps_every_fact():
    import json

    report = _full_report()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["version"] == "7" and data["bytes_written"] == 6_000
    assert data["gathered_bytes"] == 96
    assert data["gathered_bytes_by_tensor"] == {"model.layers.0.self_attn.q_proj.weight": 96}
    assert data["bytes_by_target"] == [
        {"url": "http://a", "engine_rank": 0, "bytes": 3_000},
        {"url": "http://a", "engine_rank": 1, "bytes": 1_000},
        {"url": "http://b", "engine_rank": 0, "bytes": 2_000},
    ]
    assert data["engines"]["http://a"]["verified_by"] == ["write_digests"]
    assert data["engines"]["http://b"]["unverified_reason"] == "no digests served"
    assert data["delta"]["fraction"] == 0.25 and data["delta"]["decision"].startswith("deltas")
    assert data["metrics"]["paused_s_max"] == 0.75
    assert data["stage_seconds"] == {"load": 0.25, "wait": 0.5}


def test_a_real_update_reports_metrics_and_json(engines):
    import json

    engines.setdefault("http://checked", DigestEngine("http://checked"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://checked"])
        report = session.update(_tensors(3))
    metrics = report.metrics(prefix="x.")
    assert metrics["x.bytes"] == report.bytes_written > 0
    assert metrics["x.engines_verified"] == 1 and metrics["x.engines_unverified"] == 0
    assert "x.paused_s_max" in metrics
    json.dumps(report.to_dict())


def test_the_report_says_when_inputs_were_not_checked_for_nan_and_inf(engines):
    """verify_finite_inputs stays off by default (on this 2-core CPU the check alone reads
    383 MB of bf16 in 96 ms, 4 GB/s on one thread: tens of percent of an update), so the
    report says the inputs went unchecked (issue 41 item 12)."""
    engines.setdefault("http://checked", DigestEngine("http://checked"))
    for verify, said in ((False, True), (True, False)):
        with WeightSyncSession(SyncConfig(buffer_bytes="1MiB", verify_finite_inputs=verify)) as s:
            s.connect(["http://checked"])
            report = s.update(_tensors(3))
        assert report.inputs_checked_finite is verify
        assert ("inputs NOT checked for NaN / Inf" in report.summary()) is said
        assert report.metrics()["p2pweights/inputs_checked_finite"] == int(verify)


def test_engine_rank_keys_name_their_fields_and_still_behave_as_the_tuples_they_replaced():
    import dataclasses
    import json

    from p2pweights import EngineRankKey
    from p2pweights.wire.publication import Runner

    key = EngineRankKey("http://a", 1)
    url, rank = key
    assert (url, rank) == (key.url, key.rank) == ("http://a", 1)
    assert key == ("http://a", 1) and hash(key) == hash(("http://a", 1))
    assert sorted([EngineRankKey("http://b", 0), key, ("http://a", 0)])[1:] == [
        key,
        ("http://b", 0),
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.rank = 2  # type: ignore[misc]
    runner = Runner("http://a", 1, "draft")
    assert tuple(runner) == ("http://a", 1, "draft") and runner == ("http://a", 1, "draft")
    assert runner.key == key and {runner: 1}[("http://a", 1, "draft")] == 1

    # a report given tuple keys holds engine-rank keys; lookups, unpacking, equality with a
    # tuple-keyed dict and sorting work as before
    given = {("http://b", 0): 2_000, ("http://a", 1): 1_000}
    report = UpdateReport(version="1", bytes_by_target=given)
    assert report.bytes_by_target == given and dict(report.bytes_by_target) == given
    assert report.bytes_by_target[("http://a", 1)] == 1_000 == report.bytes_by_target[key]
    assert [url for (url, _), _ in report.bytes_by_target.items()] == ["http://a", "http://b"]
    assert sorted(report.bytes_by_target) == [key, EngineRankKey("http://b", 0)]
    assert report.bytes_written == 3_000 and ("http://b", 0) in report.bytes_by_target
    # and the whole report goes to JSON either way
    data = json.loads(json.dumps(dataclasses.asdict(report)))
    assert data["bytes_by_target"]["ranks"] == [
        {"url": "http://a", "rank": 1, "num_bytes": 1_000},
        {"url": "http://b", "rank": 0, "num_bytes": 2_000},
    ]
    assert json.loads(json.dumps(report.to_dict()))["bytes_by_target"][0]["engine_rank"] == 1
