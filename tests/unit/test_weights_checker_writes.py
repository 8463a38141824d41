"""Verified writes through sglang's own ``/weights_checker``, for engines without digests.

A released sglang server (its own Mooncake publication) records no write digests, but
answers ``{"action": "checksum"}`` with sglang's hash of every parameter per rank. The
fakes here are test_session_sequence's engines answering as sglang 0.5.23 does, with
sglang's own hash function (sha256 on the CPU); the recorded answers of a real CPU
server (tests/fixtures/sglang-0.5.23-cpu) pin the sender's hash and the answer's shape.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_session_sequence import FakeClient, FakeEngine, _holds, _tensors
from test_verified_writes import DigestEngine, engines  # noqa: F401  (the fixture)

from p2pweights import DeltaConfig, NixlConfig, SyncConfig, TransferError, WeightSyncSession
from p2pweights.engines import fleet as fleet_module
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.errors import EngineError
from p2pweights.verification.checker import CheckerTarget, check, checksums_by_rank

pytest.importorskip("sglang", reason="the sender hashes with sglang's own function")

from p2pweights.replica.sglang import facade

ANSWERS = Path(__file__).parent.parent / "fixtures" / "sglang-0.5.23-cpu"
CONFIG = SyncConfig(buffer_bytes="1MiB", transport=NixlConfig())


@dataclass
class CheckerEngine(FakeEngine):
    """A released sglang server: no digests, a weight checker that hashes its weights."""

    device: str = "cpu"
    version_reported: str = "0.5.23"
    corrupt_before_checksum: str | None = None
    """A parameter one byte of which changes after the writes, before the checksum (one-shot)."""
    checksums_in_session: list[bool] | None = None


class CheckerClient(FakeClient):
    """On this CPU the stand-in for a GPU server's own publication is a CPU server
    publishing through the plugin (NIXL) with its digests off (sglang refuses Mooncake
    into a CPU server)."""

    def publication(self, rank, role="target"):
        return dataclasses.replace(super().publication(rank, role), backend="nixl")

    def server_info(self):
        return {"tp_size": 1, "version": self.engine.version_reported, "device": self.engine.device}

    def weights_checker(self, action, **options):
        if action != "checksum":
            return super().weights_checker(action, **options)
        engine = self.engine

        def answer():
            if engine.corrupt_before_checksum is not None:
                engine.memory[engine.corrupt_before_checksum][7] ^= 1
                engine.corrupt_before_checksum = None
            sums = {name: facade.weights_checker_hash(t) for name, t in engine.memory.items()}
            info = {"role": options.get("selector", "target"), "tp_rank": 0, "tp_size": 1}
            return {"success": True, "ranks": [{"checksums": sums, "parallelism_info": [info]}]}

        return engine.call("checksum", answer)


FP8_ENGINE = CheckerEngine("http://fp8")
FP8_ENGINE.memory["o.weight_scale_inv"] = torch.zeros(64, dtype=torch.uint8)


@pytest.fixture
def checked(engines, monkeypatch):  # noqa: F811
    """``engines``, where a ``CheckerEngine`` answers as released sglang does."""
    made = fleet_module.EngineClient

    def client_for(url, **kwargs):
        engine = engines.get(url)
        if isinstance(engine, CheckerEngine):
            return CheckerClient(engine)
        return made(url, **kwargs)

    monkeypatch.setattr(fleet_module, "EngineClient", client_for)
    return engines


def test_an_engine_without_digests_is_verified_by_its_checker_before_its_end(checked):
    engine = checked.setdefault("http://sgl", CheckerEngine("http://sgl"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://sgl"])
        report = session.update(_tensors(4))
    seen = report.engines["http://sgl"]
    assert seen.verified_by == ("weights_checker",) and seen.unverified_reason is None
    assert "verified by sglang's /weights_checker checksums: 1 engine" in report.summary()
    events = [e for e in engine.events if not e.startswith("write")]
    assert events.index("checksum") < events.index("end")  # inside the open session
    assert events.count("checksum") == 1 and _holds(engine, 4) and engine.running
    assert {"verify_checker", "checksum"} <= report.stage_seconds.keys()


def test_a_byte_changed_after_the_writes_fails_the_update_naming_engine_rank_and_parameter(
    checked,
):
    bad = checked.setdefault("http://bad", CheckerEngine("http://bad", corrupt_before_checksum="o"))
    good = checked.setdefault("http://good", CheckerEngine("http://good"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://bad", "http://good"])
        with pytest.raises(TransferError, match=r"engine http://bad rank 0: 1 of 2 .*'o'"):
            session.update(_tensors(3))
        # paused and torn, its session still open; the engine the checker passed was
        # ended (whole, as a digest check leaves those it passed), nothing resumed
        assert bad.paused and bad.open and bad.version == f"{UPDATING_PREFIX}1"
        assert good.paused and not good.open and good.version == f"{UPDATING_PREFIX}1"
        assert _holds(good, 3)
        report = session.abort()
        assert report.left_paused == ["http://bad"]
        assert good.running and good.version == "1"
        assert bad.paused and not bad.open and bad.version == f"{UPDATING_PREFIX}1"
        session.update(_tensors(5))  # the retry rewrites it whole, verifies and resumes it
    assert bad.running and _holds(bad, 5) and bad.version == "1"  # a failed version is reused


def test_a_checker_that_cannot_answer_fails_the_update(checked):
    engine = checked.setdefault("http://sgl", CheckerEngine("http://sgl"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://sgl"])
        engine.inject["checksum"] = "answered"
        with pytest.raises(TransferError, match="checksum could not be read"):
            session.update(_tensors(3))
        assert engine.paused and engine.version == f"{UPDATING_PREFIX}1"


def test_digests_are_preferred_where_an_engine_records_them(checked):
    engine = checked.setdefault("http://dig", DigestEngine("http://dig"))
    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB")) as session:
        session.connect(["http://dig"])
        report = session.update(_tensors(2))
    assert report.engines["http://dig"].verified_by == ("write_digests",)
    assert "checksum" not in engine.events


@pytest.mark.parametrize(
    ("engine", "why"),
    [
        (CheckerEngine("http://old", version_reported="0.5.21"), "older than 0.5.23"),
        (CheckerEngine("http://gpu", device="cuda"), "this trainer has no CUDA"),
        (CheckerEngine("http://nodevice", device=""), "does not report the device"),
        (FP8_ENGINE, "fp8 block-quantized weights"),
    ],
)
def test_an_engine_neither_way_can_verify_is_named_with_both_settings(checked, engine, why):
    if engine.device == "cuda" and torch.cuda.is_available():
        pytest.skip("this trainer has CUDA: the GPU engine is verified")
    checked.setdefault(engine.url, engine)
    with WeightSyncSession(CONFIG) as session:
        session.connect([engine.url])
        report = session.update(_tensors(2))
    reason = report.engines[engine.url].unverified_reason
    assert reason is not None and why in reason and "records no write digests" in reason
    always = CONFIG.model_copy(update={"verify_writes": "always"})
    with WeightSyncSession(always) as session, pytest.raises(EngineError) as refused:
        session.connect([engine.url])
    message = str(refused.value)
    assert "P2PWEIGHTS_WRITE_DIGESTS" in message and "/weights_checker" in message
    assert why in message and "verify_writes='auto'" in message


def test_delta_updates_refuse_an_engine_only_its_checker_could_verify(checked):
    engine = checked.setdefault("http://sgl", CheckerEngine("http://sgl"))
    delta = CONFIG.model_copy(update={"delta": DeltaConfig()})
    only_digests = "delta updates are checked by write digests only"
    with WeightSyncSession(delta) as session, pytest.raises(EngineError, match=only_digests):
        session.connect(["http://sgl"])
    assert engine.running and "pause" not in engine.events


def test_off_asks_no_checker(checked):
    engine = checked.setdefault(
        "http://sgl", CheckerEngine("http://sgl", corrupt_before_checksum="o")
    )
    with WeightSyncSession(CONFIG.model_copy(update={"verify_writes": "off"})) as session:
        session.connect(["http://sgl"])
        report = session.update(_tensors(2))
    assert "checksum" not in engine.events and report.engines["http://sgl"].verified_by == ()


# -- the recorded answers of a real sglang 0.5.23 CPU server -----------------------------------


def _recorded_tp1() -> tuple[dict, dict[str, torch.Tensor]]:
    """The TP 1 server's checksum answer after the suite's last update (seed 13), and the
    HF tensors of that update whose names are sglang's (those not fused on load)."""
    from p2pweights.testing import model_config, synthetic_weights

    answer = json.loads((ANSWERS / "tp1.json").read_text())["/weights_checker"]
    config = {**model_config("qwen3-tiny"), "num_attention_heads": 4, "head_dim": 64}
    weights = dict(synthetic_weights({**config, "vocab_size": 1024}, seed=13))
    return answer, weights


def test_the_senders_hash_is_the_real_cpu_servers_own():
    answer, weights = _recorded_tp1()
    (held,) = checksums_by_rank("http://tp1.test:30000", answer)
    same = [name for name, t in weights.items() if name in held]
    assert len(same) == 15  # the fused ones (qkv_proj, gate_up_proj) have other names
    assert {name: facade.weights_checker_hash(weights[name]) for name in same} == {
        name: held[name] for name in same
    }


def test_the_check_reads_a_real_answer_and_names_the_wrong_parameter():
    answer, weights = _recorded_tp1()
    url = "http://tp1.test:30000"

    class Recorded:  # the client, answering what the real server answered
        def weights_checker(self, action, **options):
            return answer

    engine = type("E", (), {"url": url, "client": Recorded()})()
    targets = {url: CheckerTarget(engine, "cpu")}  # type: ignore[arg-type]
    (held,) = checksums_by_rank(url, answer)
    staged = {name: facade.weights_checker_hash(t) for name, t in weights.items() if name in held}
    assert check(targets, {(url, 0, "target"): staged}) == []
    changed = weights["model.layers.1.mlp.down_proj.weight"].clone()
    changed.view(-1).view(torch.uint8)[0] ^= 1
    staged["model.layers.1.mlp.down_proj.weight"] = facade.weights_checker_hash(changed)
    ((runner, problem),) = check(targets, {(url, 0, "target"): staged})
    assert runner == (url, 0, "target")
    assert "1 of 15" in problem and "'model.layers.1.mlp.down_proj.weight'" in problem


def test_a_checker_engine_is_not_resumed_unchecked_after_a_failed_write_elsewhere(checked):
    """Review finding: after a write to another engine failed, a lone trainer rank ended the
    engines that got every byte and marked them whole; an engine verified only by its
    /weights_checker (which can look only before its end) was then resumed by abort() with
    bytes nobody compared. It stays paused and torn; the next update rewrites it."""
    bad = checked.setdefault("http://bad", CheckerEngine("http://bad"))
    bad.inject["write2"] = "failed"
    good = checked.setdefault("http://good", CheckerEngine("http://good"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://bad", "http://good"])
        with pytest.raises(TransferError):
            session.update(_tensors(5))
        report = session.abort()
    assert "checksum" not in good.events  # nothing compared its bytes
    assert not report.outcomes["http://good"].startswith("resumed")
    assert good.paused and good.version.startswith(UPDATING_PREFIX)
