"""Failures that stop an update midway, on real engines and real transports, and what state
each leaves every engine in (docs/reliability.md points here, row by row):

- an engine frozen mid-update, then thawed: the retry in the same session succeeds bit-exact;
- an engine killed mid-update: ``abort()`` resumes the others (whole weights, their version)
  and reports the dead one; a reconnect with a restarted engine succeeds bit-exact;
- an interrupted trainer (Ctrl-C inside a streamed update): the engine stays paused and its
  weight version says so; the next session adopts it and rewrites it whole;
- an engine hung outside the writes fails the update within ``timeouts.control``.

The local engine reports its state in ``/server_info`` (``p2pweights_engine_state``).
"""

from __future__ import annotations

import importlib.metadata
import os
import signal

import pytest
import torch
from _bit_exact import engine_mismatches, next_version

from p2pweights import (
    EngineError,
    MooncakeConfig,
    NixlConfig,
    P2PWeightsError,
    SyncConfig,
    Timeouts,
    WeightSyncSession,
)
from p2pweights.engines.client import EngineClient
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration

TRANSPORTS = {"mooncake": MooncakeConfig(protocol="tcp"), "nixl": NixlConfig(backend="UCX")}


def _weights(folder, seed):
    return list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))


def _state(url):
    client = EngineClient(url)
    try:
        info = client.server_info()
        return info["p2pweights_engine_state"], client.weight_version()
    finally:
        client.close()


def _bit_exact(engine, folder, seed):
    mismatches = engine_mismatches(engine.url, lambda: _weights(folder, seed))
    return mismatches == {r: [] for r in range(engine.tp)}


def _on_step(number, action):
    """An ``agree`` hook (called after each update step) running ``action`` after step
    ``number`` (1: the input is prepared; 2: the update session is open, the writes come
    next)."""
    calls = []

    def agree(ok):
        calls.append(ok)
        if len(calls) == number:
            action()
        return ok

    return agree


RUNNING = {"paused": False, "update_open": False}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_frozen_engine_then_thawed_the_retry_succeeds(transport, model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    (engine,) = start_engines(folder, [2], transport=transport, seed=0)
    assert _state(engine.url)[0] == RUNNING
    pid = engine._process.pid
    config = SyncConfig(
        transport=TRANSPORTS[transport],
        buffer_bytes="1MiB",
        timeouts=Timeouts(transfer=3, control=3),
    )
    try:
        with WeightSyncSession(
            config, agree=_on_step(2, lambda: os.killpg(pid, signal.SIGSTOP))
        ) as session:
            session.connect([engine.url])
            # the writes (Mooncake) or, where loopback buffers swallow them (NIXL over TCP),
            # the end of the update session fail against the frozen engine
            with pytest.raises(P2PWeightsError, match=engine.url):
                session.update(_weights(folder, 1))
            os.killpg(pid, signal.SIGCONT)
            state, version = _state(engine.url)
            assert state["paused"] and version == f"{UPDATING_PREFIX}1"
            report = session.update(_weights(folder, 2))
            assert _state(engine.url) == (RUNNING, report.version)
            assert _bit_exact(engine, folder, 2)
    finally:
        os.killpg(pid, signal.SIGCONT)


def test_killed_engine_abort_resumes_the_others_and_a_restarted_one_rejoins(
    model_dir, start_engines, shared_engines
):
    folder = model_dir("qwen3-tiny")
    (victim,) = start_engines(folder, [1], seed=0, wait=False)  # killed: its own
    (survivor,) = shared_engines(folder, [2], seed=0)  # left running: back to the pool
    victim.wait_ready()
    first = next_version([survivor.url])
    config = SyncConfig(
        transport=TRANSPORTS["mooncake"], buffer_bytes="1MiB", timeouts=Timeouts(transfer=5)
    )
    pid = victim._process.pid
    with WeightSyncSession(
        config, agree=_on_step(2, lambda: os.killpg(pid, signal.SIGKILL))
    ) as session:
        session.connect([survivor.url, victim.url])
        with pytest.raises(P2PWeightsError, match=rf"{victim.url} rank 0"):
            session.update(_weights(folder, 123))
        report = session.abort()
    # the survivor got every byte: abort ended its session and resumed it at the new version
    assert report.outcomes[survivor.url].startswith("resumed")
    assert report.outcomes[victim.url].startswith("unreachable")
    assert _state(survivor.url) == (RUNNING, str(first))
    assert _bit_exact(survivor, folder, 123)

    (restarted,) = start_engines(folder, [1], seed=0)
    with WeightSyncSession(config) as session:
        session.connect([survivor.url, restarted.url])
        report = session.update(_weights(folder, 124))
    for engine in (survivor, restarted):
        assert _state(engine.url) == (RUNNING, report.version)
        assert _bit_exact(engine, folder, 124)


def test_interrupted_trainer_leaves_a_visible_torn_engine_the_next_session_repairs(
    model_dir, shared_engines
):
    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [2], seed=0)
    first = next_version([engine.url])  # the version this session's first update gives
    config = SyncConfig(transport=TRANSPORTS["mooncake"], buffer_bytes="1MiB")

    def interrupted(seed):
        weights = _weights(folder, seed)
        yield from weights[: len(weights) * 2 // 3]
        raise KeyboardInterrupt  # Ctrl-C while the trainer streams the update

    with pytest.raises(KeyboardInterrupt), WeightSyncSession(config) as session:
        session.connect([engine.url])
        session.update(_weights(folder, 115))
        session.update(interrupted(116))
    # close() ran (the with block): the session was ended, but the engine was not resumed
    paused = {"paused": True, "update_open": False}
    assert _state(engine.url) == (paused, f"{UPDATING_PREFIX}{first + 1}")

    with WeightSyncSession(config) as session:  # the next trainer process
        session.connect([engine.url])
        report = session.update(_weights(folder, 117))
    assert _state(engine.url) == (RUNNING, report.version)
    # it found the engine paused: the pause it reports counts from its own start, not connect
    assert report.engines[engine.url].pause_made is False
    assert 0 < report.paused_s[engine.url] < report.seconds
    assert "was paused already when this update began" in report.summary()
    assert _bit_exact(engine, folder, 117)


def test_engine_hung_outside_the_writes_fails_within_control_timeout(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    (engine,) = start_engines(folder, [1], seed=0)
    pid = engine._process.pid
    config = SyncConfig(
        transport=TRANSPORTS["mooncake"],
        buffer_bytes="1MiB",
        timeouts=Timeouts(control=2, read=60),
    )
    try:
        with WeightSyncSession(config) as session:
            session.connect([engine.url])
            session.update(_weights(folder, 8))
            os.killpg(pid, signal.SIGSTOP)
            with pytest.raises(EngineError, match=r"no answer within 2 s \(timeouts.control\)"):
                session.update(_weights(folder, 9))
            os.killpg(pid, signal.SIGCONT)
            report = session.update(_weights(folder, 9))
        assert _state(engine.url) == (RUNNING, report.version)
        assert _bit_exact(engine, folder, 9)
    finally:
        os.killpg(pid, signal.SIGCONT)


def test_local_engine_refuses_a_second_begin_as_sglang_does(model_dir, shared_engines):
    (engine,) = shared_engines(model_dir("qwen3-tiny"), [1], seed=0)
    client = EngineClient(engine.url)
    try:
        client.begin_weight_update()
        assert client.server_info()["p2pweights_engine_state"]["update_open"]
        with pytest.raises(EngineError, match="already open"):
            client.begin_weight_update()
        client.end_weight_update()
        with pytest.raises(EngineError, match="no weight-update session is open"):
            client.end_weight_update()
        assert client.server_info()["version"] == importlib.metadata.version("sglang")
    finally:
        client.close()
