"""The seed's failure claims, on real engines and real transports:

- bad input gets a clear error before any byte is written (the engine is untouched);
- the first update is checked against the engine's checkpoint (names, shapes, dtypes);
- a failed or late write fails the update, naming engine URL, engine rank and parameter
  (a frozen, killed or hung engine: tests/integration/test_update_state.py);
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


def _extra_row(t):
    return torch.cat([t, t[:1]])


def _extra_column(t):
    return torch.cat([t, t[:, :1]], dim=1)


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        (lambda ws: [*ws, ("model.layers.0.mlp.bogus_proj.weight", torch.zeros(4, 4))], "bogus"),
        (lambda ws: [*ws, ("model.layers.9.mlp.up_proj.weight", ws[-1][1])], "layers.9"),
        (lambda ws: [(n, _extra_row(t) if "q_proj" in n else t) for n, t in ws], "q_proj"),
        (lambda ws: [(n, _extra_column(t) if "o_proj" in n else t) for n, t in ws], "o_proj"),
        (lambda ws: [(n, t.float() if "k_proj" in n else t) for n, t in ws], "k_proj"),
        (lambda ws: [(n, t[:-8] if "q_proj" in n else t) for n, t in ws], "q_proj"),
    ],
    ids=["unknown-name", "layer-not-in-model", "extra-row", "extra-column", "float32", "short"],
)
def test_bad_first_update_fails_before_any_byte(engine, model_dir, mutate, named):
    """The first update is checked against the checkpoint the engine's config describes: at
    TP 2 a loader would narrow away an extra row or column and write wrong slices."""
    folder = model_dir("qwen3-tiny")
    with WeightSyncSession(_config()) as session:
        session.connect([engine.url])
        with pytest.raises(ConfigError, match=named):
            session.update(mutate(_weights(folder, 2)))
        report = session.update(_weights(folder, 3))  # not blamed on the bad one
    assert EngineClient(engine.url).weight_version() == report.version


def test_bad_first_update_leaves_the_engine_untouched(engine, model_dir):
    folder = model_dir("qwen3-tiny")
    before, version = _checksum(engine.url), EngineClient(engine.url).weight_version()
    bad = [(n, t.float() if "v_proj" in n else t) for n, t in _weights(folder, 2)]
    with WeightSyncSession(_config()) as session:
        session.connect([engine.url])
        with pytest.raises(ConfigError, match="v_proj"):
            session.update(bad)
    assert _checksum(engine.url) == before
    assert EngineClient(engine.url).weight_version() == version


@pytest.mark.parametrize(
    "left_out",
    ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight"],
    ids=["k_proj-of-qkv_proj", "gate_proj-of-gate_up_proj"],
)
def test_a_first_update_leaving_out_part_of_a_fused_weight_fails_before_any_byte(
    engine, model_dir, left_out
):
    """q and v (or up) still feed the fused parameter, so the probe saw it fed; the slice
    of the left-out tensor would keep bytes no update wrote while the update succeeded."""
    folder = model_dir("qwen3-tiny")
    before, version = _checksum(engine.url), EngineClient(engine.url).weight_version()
    with WeightSyncSession(_config()) as session:
        session.connect([engine.url])
        with pytest.raises(ConfigError) as refused:
            session.update([(n, t) for n, t in _weights(folder, 2) if n != left_out])
        message = str(refused.value)
        assert left_out in message and "leaves out 1 checkpoint tensor" in message
        assert "qkv_proj" not in message and "gate_up_proj" not in message  # checkpoint names
        assert _checksum(engine.url) == before
        assert EngineClient(engine.url).weight_version() == version
        report = session.update(_weights(folder, 3))  # the whole update then goes through
    assert EngineClient(engine.url).weight_version() == report.version


def test_layout_mismatch_refused_at_connect(engine, model_dir):
    other = model_dir("qwen3-tiny-tied")  # no lm_head parameter in this layout
    with (
        WeightSyncSession(_config()) as session,
        pytest.raises(LayoutMismatchError, match=rf"engine {engine.url} rank 0 .*lm_head"),
    ):
        session.connect([EngineEndpoint(engine.url, model_path=str(other))])


def _signal_once_open(pid, sig):
    """An ``agree`` hook (called after each update step) that sends ``sig`` to the engine
    once the update session is open, i.e. just before the writes start."""
    calls = []

    def agree(ok):
        calls.append(ok)
        if len(calls) == 2:  # the steps so far: prepare, open
            os.killpg(pid, sig)
        return ok

    return agree


def test_dead_engine_fails_the_update_naming_url_rank_and_parameter(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    (victim,) = start_engines(folder, [2], seed=0)
    agree = _signal_once_open(victim._process.pid, signal.SIGKILL)
    with WeightSyncSession(_config(transfer_timeout_s=10), agree=agree) as session:
        session.connect([victim.url])
        with pytest.raises(
            TransferError, match=rf"engine {victim.url} rank [01] parameters model\."
        ):
            session.update(_weights(folder, 1))


def test_engine_check_fails_the_update_on_a_mismatch(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    (checked,) = start_engines(folder, [1], seed=0)
    with WeightSyncSession(_config(check_weight_update_equal=True)) as session:
        session.connect([checked.url])
        # The engine snapshots its start weights (seed 0); these differ, so compare must fail.
        with pytest.raises(EngineError, match="weights_checker"):
            session.update(_weights(folder, 99))
