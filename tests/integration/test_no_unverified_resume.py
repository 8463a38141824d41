"""After a failure, no engine serves bytes nobody verified and no healthy engine is torn
(issue 39), on local engines in their own processes over real Mooncake:

- a failed ``end_weight_update`` (the trainer's call gets no answer, after or before it
  reached the engine), then ``abort()``: the engine is not resumed under the new version
  with bytes whose check never ran; it stays paused, ``p2pweights-updating:<v>``, the
  abort report and ``inspect`` say so, and the next session's update repairs it;
- one engine frozen during a streamed update: the healthy engine gets every byte, is
  verified and resumed by ``abort()``; only the frozen one is named and left torn;
- an engine restarted on the same URL without ``connect()``: the next ``update()``
  refuses it before anything is paused, naming it, and the healthy engine keeps running.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
from _bit_exact import assert_bit_exact, seed_weights

from p2pweights import (
    EngineError,
    EngineUnreachable,
    MooncakeConfig,
    SyncConfig,
    Timeouts,
    TransferError,
    WeightSyncSession,
)
from p2pweights.engines.client import EngineClient
from p2pweights.engines.inspect import inspect_engine, render_inspection
from p2pweights.engines.update_state import UPDATING_PREFIX

pytestmark = pytest.mark.integration

MOONCAKE = MooncakeConfig(protocol="tcp", local_hostname="127.0.0.1")
PARAM = "model.layers.1.mlp.down_proj.weight"
RUNNING = {"paused": False, "update_open": False}


def _state(url: str) -> tuple[dict[str, bool], str]:
    client = EngineClient(url)
    try:
        return client.server_info()["p2pweights_engine_state"], client.weight_version()
    finally:
        client.close()


@pytest.mark.parametrize("reached", [True, False], ids=["end-reached", "end-not-reached"])
def test_a_failed_end_then_abort_does_not_resume_unverified_bytes(
    reached, model_dir, start_engines, monkeypatch
):
    folder = model_dir("qwen3-tiny")
    (engine,) = start_engines(folder, [1], transport="mooncake", seed=0)
    config = SyncConfig(transport=MOONCAKE, buffer_bytes="1MiB", verify_writes="always")
    session = WeightSyncSession(config)
    session.connect([engine.url])
    first = session.update(seed_weights(folder, 71))
    new = str(int(first.version) + 1)
    # one bit flipped at the engine's end: only the write check can see it
    answer = httpx.post(f"{engine.url}/p2pweights/corrupt_at_end", json={"rank": 0, "param": PARAM})
    assert answer.status_code == 200
    real_end = EngineClient.end_weight_update

    def end_without_answer(client: EngineClient):
        if reached:
            real_end(client)
        raise EngineUnreachable(f"engine {client.url}: no answer to /end_weight_update (test)")

    monkeypatch.setattr(EngineClient, "end_weight_update", end_without_answer)
    with pytest.raises(EngineUnreachable) as failed:
        session.update(seed_weights(folder, 72))
    monkeypatch.undo()
    assert engine.url in str(failed.value)

    report = session.abort()  # what close(), __exit__ and a crashing loop run
    assert report.left_paused == [engine.url], report
    outcome = report.outcomes[engine.url]
    # whether or not the end ran there, it never answered: the engine is not whole
    assert outcome.startswith("left paused:") and "not verified" in outcome, outcome
    assert _state(engine.url) == ({"paused": True, "update_open": False}, f"{UPDATING_PREFIX}{new}")
    shown = inspect_engine(engine.url)
    assert shown["update_state"]["mid_update"] and shown["update_state"]["updating_to"] == new
    assert "mid-update to" in render_inspection(shown)
    session.close()  # aborts again: still paused, never resumed unverified
    assert _state(engine.url)[0] == {"paused": True, "update_open": False}

    with WeightSyncSession(config) as again:  # a new session adopts and repairs it
        again.connect([engine.url])
        repaired = again.update(seed_weights(folder, 73))
        assert repaired.engines[engine.url].verified_by == ("write_digests",)
    assert _state(engine.url) == (RUNNING, repaired.version)
    assert_bit_exact([engine], folder, 73)


def test_a_frozen_engine_does_not_tear_a_healthy_one_in_a_streamed_update(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    frozen, healthy = start_engines(folder, [1, 1], transport="mooncake", seed=0)
    config = SyncConfig(transport=MOONCAKE, buffer_bytes="1MiB", timeouts=Timeouts(transfer=3))
    with WeightSyncSession(config) as session:
        session.connect([frozen.url, healthy.url])
        first = session.update(iter(seed_weights(folder, 74)))
        new = str(int(first.version) + 1)
        weights = seed_weights(folder, 75)

        def stream():
            for index, pair in enumerate(weights):
                if index == 12:  # a 1 MiB buffer was written (the engines are open):
                    # freeze one for 8 s, past timeouts.transfer
                    os.killpg(frozen.pid, signal.SIGSTOP)
                    threading.Timer(8.0, os.killpg, (frozen.pid, signal.SIGCONT)).start()
                yield pair

        with pytest.raises(TransferError) as failed:
            session.update(stream())
        assert frozen.url in str(failed.value)
        assert healthy.url not in str(failed.value)
        report = session.abort()
        assert report.outcomes[healthy.url] == f"resumed (weight version {new})", report
        assert report.left_paused == [frozen.url], report
        assert _state(healthy.url) == (RUNNING, new)
        assert_bit_exact([healthy], folder, 75)
        assert _state(frozen.url)[1] == f"{UPDATING_PREFIX}{new}"
        session.update(seed_weights(folder, 76))  # the retry repairs the frozen one
    assert_bit_exact([frozen, healthy], folder, 76)


def test_an_engine_restarted_on_its_url_is_refused_before_anything_pauses(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    restarted, healthy = start_engines(folder, [1, 1], transport="mooncake", seed=0)
    config = SyncConfig(transport=MOONCAKE, buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([restarted.url, healthy.url])
        first = session.update(seed_weights(folder, 77))
        restarted.stop()  # the same URL, a new process: a new publication
        (restarted,) = start_engines(
            folder, [1], transport="mooncake", seed=0, port=int(restarted.url.rsplit(":", 1)[1])
        )
        with pytest.raises(EngineError) as refused:
            session.update(seed_weights(folder, 78))
        assert restarted.url in str(refused.value) and "connect" in str(refused.value)
        assert healthy.url not in str(refused.value)
        assert _state(healthy.url) == (RUNNING, first.version)  # untouched
        assert _state(restarted.url)[0] == RUNNING
        report = session.abort()
        assert report.ok, report
        session.connect([restarted.url, healthy.url])
        session.update(seed_weights(folder, 79))
    assert_bit_exact([restarted, healthy], folder, 79)
