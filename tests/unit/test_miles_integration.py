"""p2pweights.integrations.miles with a fake session: buckets stream into one update, in
order, under miles' version; errors surface from the miles call running when the update
failed (a bucket's hand-over or the finalize), never swallowed; the config comes from
miles' flags; ``install`` rebinds miles' p2p updater class.

The class derives from p2pweights' stand-in for miles' mixin here (miles is not
installed); ``_Driven`` feeds it buckets as miles' gathers would. The integration test
(tests/integration/test_miles_drop_in.py) drives it with a double of miles' own
mixin and actor into local engines.
"""

from __future__ import annotations

import sys
import types
from argparse import Namespace
from collections.abc import Iterator

import pytest
import torch

from p2pweights import ConfigError, MooncakeConfig, NixlConfig, SyncConfig, Timeouts, TransferError
from p2pweights.integrations import miles, miles_args
from p2pweights.integrations.miles import P2PWeightsUpdater, config_from_args, update_metrics
from p2pweights.integrations.streamed_update import StreamedUpdate
from p2pweights.report import EngineReport, UpdateReport


def _pairs(*names: str) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.full((2,), float(len(name)))) for name in names]


BUCKETS = [_pairs("a", "b"), _pairs("c", "d"), _pairs("e", "f")]


class FakeSession:
    """Reads the update's pairs as a session would; may fail after ``fail_after`` pairs
    (0: before reading any; -1: once the stream ended, as a close step would) or stop
    reading early (``stop_after``)."""

    def __init__(self, fail_after: int | None = None, stop_after: int | None = None):
        self.config = SyncConfig(timeouts=Timeouts(transfer=1, control=1))
        self.fail_after, self.stop_after = fail_after, stop_after
        self.error = RuntimeError("injected: the update failed")
        self.read: list[str] = []
        self.versions: list[str | None] = []
        self.stream_errors: list[BaseException] = []
        self.connected: list[list[str]] = []
        self.on_read = lambda name: None

    def connect(self, urls: list[str]) -> None:
        self.connected.append(list(urls))

    def update(self, named_tensors: Iterator[tuple[str, torch.Tensor]], *, version=None):
        self.versions.append(version)
        if self.fail_after == 0:
            raise self.error
        try:
            for name, _ in named_tensors:
                self.read.append(name)
                self.on_read(name)
                if self.fail_after is not None and len(self.read) == self.fail_after:
                    raise self.error
                if self.stop_after is not None and len(self.read) == self.stop_after:
                    break
        except TransferError as exc:
            self.stream_errors.append(exc)
            raise
        if self.fail_after == -1:
            raise self.error
        return UpdateReport(
            version=str(version),
            bytes_by_target={("http://e:1", 0): 10 * len(self.read)},
            stage_seconds={"load": 0.5},
            seconds=2.0,
        )


class _Driven(P2PWeightsUpdater):
    """miles' gathers as far as the updater sees them: buckets handed to the hook, with a
    log of each call and whether it returned."""

    buckets = BUCKETS
    fail_gather_after: int | None = None

    def __init__(self, session: FakeSession, **kwargs):
        super().__init__(
            _args(), [], model_name="qwen3", quantization_config=None, session=session, **kwargs
        )
        self.log: list[str] = []

    def _gather_and_update_non_expert_weights(self, func, pbar=None):
        for index, bucket in enumerate(self.buckets):
            if self.fail_gather_after == index:
                raise RuntimeError("injected: miles' gather failed")
            self.log.append(f"send {index}")
            func(list(bucket), pbar)
            self.log.append(f"sent {index}")

    def _gather_and_update_expert_weights(self, func, pbar=None):
        pass

    def _finalize_and_resume_engines(self):
        self.log.append("finalize")
        super()._finalize_and_resume_engines()
        self.log.append("finalized")


class _Handle:
    def __init__(self, url: str):
        self.get_topology_info = types.SimpleNamespace(remote=lambda: {"url": url})


@pytest.fixture(autouse=True)
def _ray_returns_values(monkeypatch):
    """Engine actors' remote calls return their values here (no Ray cluster)."""
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)


def _args(**overrides) -> Namespace:
    fields = {
        "update_weight_buffer_size": 64 * 2**20,
        "p2p_transfer_timeout": 45.0,
        "pause_generation_mode": "in_place",
        "verify_with_weight_checker": True,
        "update_weight_transfer_mode": "p2p",
    }
    return Namespace(**{**fields, **overrides})


def _connected(session: FakeSession) -> _Driven:
    updater = _Driven(session)
    updater.connect_rollout_engines([_Handle("http://e:2"), _Handle("http://e:1")], None)
    return updater


def test_buckets_stream_in_order_into_one_update_per_miles_version():
    session = FakeSession()
    updater = _connected(session)
    assert session.connected == [["http://e:2", "http://e:1"]]
    updater.update_weights()
    updater.update_weights()
    assert session.versions == ["1", "2"]  # miles' weight_version, as the actor reads it
    assert session.read == list("abcdef") * 2
    assert updater.log[-2:] == ["finalize", "finalized"]


def test_the_report_becomes_miles_metrics_once():
    updater = _connected(FakeSession())
    updater.update_weights()
    metrics = updater.pop_metrics()
    prefix = "perf/update_weights_p2pweights"
    assert metrics[f"{prefix}_bytes"] == 60.0
    assert metrics[f"{prefix}_seconds"] == 2.0
    assert metrics[f"{prefix}_load_s"] == 0.5
    assert updater.pop_metrics() == {}


def test_metrics_take_the_longest_engine_pause_where_the_report_has_them():
    def engine(url: str, paused_s: float) -> EngineReport:
        return EngineReport(url, "mooncake", "tcp", 1, 4, paused_s=paused_s, pause_made=True)

    report = UpdateReport(
        version="1",
        bytes_by_target={("http://a", 0): 4},
        seconds=1.0,
        engines={"http://a": engine("http://a", 0.25), "http://b": engine("http://b", 0.75)},
    )
    assert update_metrics(report)["perf/update_weights_p2pweights_paused_s_max"] == 0.75
    plain = UpdateReport(version="1", bytes_by_target={})
    assert not any("paused" in key for key in update_metrics(plain))


def test_a_bucket_hand_over_returns_only_once_the_update_took_it():
    session = FakeSession()
    returned = [0]
    seen: list[tuple[str, int]] = []
    session.on_read = lambda name: seen.append((name, returned[0]))
    stream = StreamedUpdate(session, version="7")
    buckets = [_pairs("a", "b", "c"), _pairs("d", "e", "f")]
    taken_when_returned = []
    for bucket in buckets:
        stream.send(bucket)
        taken_when_returned.append(len(session.read))
        returned[0] += 1
    stream.finish()
    # every pair but a bucket's last is read while its send still waits
    assert [(n, r) for n, r in seen if n in "abde"] == [("a", 0), ("b", 0), ("d", 1), ("e", 1)]
    # once a send returned, the update had taken the whole bucket (its last pair may
    # still be on its way into the session's own records)
    assert taken_when_returned[0] >= 2 and taken_when_returned[1] >= 5


@pytest.mark.parametrize(
    ("fail_after", "raised_in"),
    [(0, "send 0"), (3, "send 1"), (-1, "finalize")],
    ids=["before-any-bucket", "mid-bucket", "after-the-last-bucket"],
)
def test_the_update_error_surfaces_from_the_running_miles_call(fail_after, raised_in):
    session = FakeSession(fail_after=fail_after)
    updater = _connected(session)
    with pytest.raises(RuntimeError, match="injected: the update failed") as caught:
        updater.update_weights()
    assert caught.value is session.error
    assert updater.log[-1] == raised_in  # the call that raised, and nothing after it
    assert updater.pop_metrics() == {}


def test_an_update_ending_before_the_last_bucket_is_an_error():
    updater = _connected(FakeSession(stop_after=2))
    with pytest.raises(ConfigError, match="ended before the trainer's last bucket"):
        updater.update_weights()


def test_a_failure_in_miles_code_fails_the_running_update():
    session = FakeSession()
    updater = _connected(session)
    updater.fail_gather_after = 1
    with pytest.raises(RuntimeError, match="injected: miles' gather failed"):
        updater.update_weights()
    (stopped,) = session.stream_errors
    assert "the trainer stopped sending" in str(stopped)
    assert "injected: miles' gather failed" in str(stopped.__cause__)
    updater.fail_gather_after = None
    updater.update_weights()  # the next update runs: nothing left running
    assert session.versions == ["1", "2"]


def test_connection_freshness_follows_miles_calls():
    updater = _Driven(FakeSession())
    assert not updater.is_rollout_engines_fresh()
    updater.connect_rollout_engines([_Handle("http://e:1")], "lock")
    assert updater.is_rollout_engines_fresh()
    updater.mark_engine_connection_stale()
    assert not updater.is_rollout_engines_fresh()


def test_update_before_connect_is_refused():
    with pytest.raises(ConfigError, match="connect_rollout_engines"):
        _Driven(FakeSession()).update_weights()


def test_lora_is_refused():
    with pytest.raises(ConfigError, match="LoRA"):
        _Driven(FakeSession(), is_lora=True)


def test_config_from_miles_flags(monkeypatch):
    monkeypatch.setattr(miles_args, "_node_address", lambda: "10.0.0.7")
    config = config_from_args(_args(), None, 1, 4)
    assert config.buffer_bytes == 64 * 2**20
    assert config.timeouts.transfer == 45.0
    assert config.pause_mode == "in_place"
    # miles checks the first update itself (snapshot and reset before training, compare
    # after); the session's own check would snapshot the reset weights
    assert not config.verify_with_weight_checker
    assert (config.pipeline_stage, config.num_pipeline_stages) == (1, 4)
    assert config.transport == MooncakeConfig(protocol="rdma", local_hostname="10.0.0.7")


def test_fields_a_config_sets_win_over_miles_flags():
    given = SyncConfig(transport=NixlConfig(backend="UCX"), buffer_bytes="1GiB")
    config = config_from_args(_args(), given, 0, 1)
    assert config.transport == NixlConfig(backend="UCX")
    assert config.buffer_bytes == 2**30
    assert config.timeouts.transfer == 45.0  # left unset in the config: from the flags


@pytest.fixture
def miles_actor(monkeypatch) -> types.ModuleType:
    """A miles before the protocol, as far as install looks: its actor module (where
    install rebinds the class) and its bucketed mixin."""
    actor = types.ModuleType("miles.backends.megatron_utils.actor")
    actor.UpdateWeightP2P = object
    mixin = types.ModuleType(miles._MIXIN)
    mixin.DistBucketedWeightUpdateMixin = object
    parts = miles._MIXIN.split(".")
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        package = types.ModuleType(name)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    monkeypatch.setitem(sys.modules, actor.__name__, actor)
    monkeypatch.setitem(sys.modules, mixin.__name__, mixin)
    return actor


def test_install_makes_miles_p2p_mode_build_the_updater(miles_actor):
    assert miles.install(_args()) is P2PWeightsUpdater
    assert miles_actor.UpdateWeightP2P is P2PWeightsUpdater
    config = SyncConfig(buffer_bytes="2MiB")
    cls = miles.install(_args(), config=config)
    assert issubclass(cls, P2PWeightsUpdater) and cls.sync_config is config
    assert miles_actor.UpdateWeightP2P is cls


def test_install_refuses_another_transfer_mode(miles_actor):
    with pytest.raises(ConfigError, match="--update-weight-transfer-mode p2p"):
        miles.install(_args(update_weight_transfer_mode="broadcast"))
