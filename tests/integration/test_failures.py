"""The seed's failure claims, on real engines and real transports:

- bad input gets a clear error before any byte is written (the engine is untouched);
- a failed or late write fails the update, naming engine URL, engine rank and parameter;
- an engine whose published layout differs from the replica is refused at connect;
- the engine's own weight check fails the update on a mismatch.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from p2pweights import (
    ConfigError,
    EngineEndpoint,
    EngineError,
    LayoutMismatchError,
    MooncakeConfig,
    SyncConfig,
    TransferError,
    WeightSyncSession,
)
from p2pweights.engines.client import EngineClient
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration


def _weights(folder, seed):
    return list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))


def _config(**kwargs):
    return SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB", **kwargs)


def _checksum(url):
    return EngineClient(url).weights_checker("checksum")["per_engine_checksum"]


@pytest.fixture(scope="module")
def engine(model_dir, start_module_engines):
    (engine,) = start_module_engines(model_dir("qwen3-tiny"), [2], seed=0)
    return engine


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda ws: ws[:-1], "lacks 1 HF tensor"),
        (lambda ws: [*ws, ("model.layers.9.bogus.weight", torch.zeros(4))], "bogus"),
        (
            lambda ws: [(n, t[:-1] if "o_proj" in n else t) for n, t in ws],
            "o_proj",
        ),
        (lambda ws: [*ws, ws[0]], "twice"),
    ],
    ids=["missing", "unknown-name", "wrong-shape", "duplicate"],
)
def test_bad_input_fails_before_any_byte(engine, model_dir, mutate, message):
    folder = model_dir("qwen3-tiny")
    with WeightSyncSession(_config()) as session:
        session.connect([engine.url])
        first = session.update(_weights(folder, 1))  # the first update maps names
        before = _checksum(engine.url)
        with pytest.raises(ConfigError, match=message):
            session.update(mutate(_weights(folder, 2)))
        assert _checksum(engine.url) == before
        assert EngineClient(engine.url).weight_version() == first.version


def test_bad_first_update_fails_before_any_byte(engine, model_dir):
    folder = model_dir("qwen3-tiny")
    before = _checksum(engine.url)
    # 8 rows short: rank 1's loader cannot take its shard. (sglang's row-parallel loaders
    # zero-pad a short input dim, so not every wrong shape is caught, by sglang either.)
    bad = [(n, t[:-8] if "q_proj" in n else t) for n, t in _weights(folder, 2)]
    with WeightSyncSession(_config()) as session:
        session.connect([engine.url])
        with pytest.raises(ConfigError, match="q_proj"):
            session.update(bad)
    assert _checksum(engine.url) == before


def test_layout_mismatch_refused_at_connect(engine, model_dir):
    other = model_dir("qwen3-tiny-tied")  # no lm_head parameter in this layout
    with (
        WeightSyncSession(_config()) as session,
        pytest.raises(LayoutMismatchError, match=rf"engine {engine.url} rank 0 .*lm_head"),
    ):
        session.connect([EngineEndpoint(engine.url, model_path=str(other))])


def _stop_engine_during_writes(sig):
    """A barrier that, once the update session is open, sends ``sig`` to the engine."""

    def barrier(state={"calls": 0}):  # noqa: B006 (per-test closure state)
        state["calls"] += 1
        if state["calls"] == 1:
            os.killpg(barrier.engine_pid, sig)

    return barrier


def test_dead_engine_fails_the_update_naming_url_rank_and_parameter(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    (victim,) = start_engines(folder, [2], seed=0)
    barrier = _stop_engine_during_writes(signal.SIGKILL)
    barrier.engine_pid = victim._process.pid
    with WeightSyncSession(_config(transfer_timeout_s=10), barrier=barrier) as session:
        session.connect([victim.url])
        with pytest.raises(
            TransferError, match=rf"engine {victim.url} rank [01] parameters model\."
        ):
            session.update(_weights(folder, 1))


def test_hung_engine_fails_the_update_after_the_timeout(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    (victim,) = start_engines(folder, [1], seed=0)
    barrier = _stop_engine_during_writes(signal.SIGSTOP)
    barrier.engine_pid = victim._process.pid
    try:
        with WeightSyncSession(_config(transfer_timeout_s=2), barrier=barrier) as session:
            session.connect([victim.url])
            with pytest.raises(TransferError, match=rf"{victim.url} rank 0 parameters"):
                session.update(_weights(folder, 1))
    finally:
        os.killpg(victim._process.pid, signal.SIGCONT)


def test_engine_check_fails_the_update_on_a_mismatch(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    (checked,) = start_engines(folder, [1], seed=0)
    with WeightSyncSession(_config(check_weight_update_equal=True)) as session:
        session.connect([checked.url])
        # The engine snapshots its start weights (seed 0); these differ, so compare must fail.
        with pytest.raises(EngineError, match="weights_checker"):
            session.update(_weights(folder, 99))
