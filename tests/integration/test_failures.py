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
from _bit_exact import assert_bit_exact

from p2pweights import (
    ConfigError,
    EngineEndpoint,
    EngineError,
    LayoutMismatchError,
    MooncakeConfig,
    SyncConfig,
    Timeouts,
    TransferError,
    WeightSyncSession,
)
from p2pweights.engines.client import EngineClient
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.errors import InputChangedError
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration


def _weights(folder, seed):
    return list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))


def _config(**kwargs):
    return SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB", **kwargs)


def _checksum(url):
    return EngineClient(url).weights_checker("checksum")["per_engine_checksum"]


@pytest.fixture
def engine(model_dir, shared_engines):
    """A TP 2 engine from the pool (these tests leave it running, resumed and whole)."""
    (engine,) = shared_engines(model_dir("qwen3-tiny"), [2], seed=0)
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
        first = session.update(_weights(folder, 141))  # the first update maps names
        before = _checksum(engine.url)
        with pytest.raises(ConfigError, match=message):
            session.update(mutate(_weights(folder, 142)))
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
            session.update(mutate(_weights(folder, 142)))
        report = session.update(_weights(folder, 143))  # not blamed on the bad one
    assert EngineClient(engine.url).weight_version() == report.version


def _own_bytes(engine, folder) -> None:
    """Write bytes of this file's own into a pooled engine, so "unchanged" is judged
    against them, not against whatever an earlier test left that a bad write could match."""
    with WeightSyncSession(_config()) as session:
        session.connect([engine.url])
        session.update(_weights(folder, 144))


def test_bad_first_update_leaves_the_engine_untouched(engine, model_dir):
    folder = model_dir("qwen3-tiny")
    _own_bytes(engine, folder)
    before, version = _checksum(engine.url), EngineClient(engine.url).weight_version()
    bad = [(n, t.float() if "v_proj" in n else t) for n, t in _weights(folder, 142)]
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
    _own_bytes(engine, folder)
    before, version = _checksum(engine.url), EngineClient(engine.url).weight_version()
    with WeightSyncSession(_config()) as session:
        session.connect([engine.url])
        with pytest.raises(ConfigError) as refused:
            session.update([(n, t) for n, t in _weights(folder, 142) if n != left_out])
        message = str(refused.value)
        assert left_out in message and "leaves out 1 checkpoint tensor" in message
        assert "qkv_proj" not in message and "gate_up_proj" not in message  # checkpoint names
        assert _checksum(engine.url) == before
        assert EngineClient(engine.url).weight_version() == version
        report = session.update(_weights(folder, 143))  # the whole update then goes through
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
    with WeightSyncSession(_config(timeouts=Timeouts(transfer=10)), agree=agree) as session:
        session.connect([victim.url])
        with pytest.raises(
            TransferError, match=rf"engine {victim.url} rank [01] parameters model\."
        ):
            session.update(_weights(folder, 1))


def test_engine_check_fails_the_update_on_a_mismatch(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    (checked,) = start_engines(folder, [1], seed=0)
    with WeightSyncSession(_config(verify_with_weight_checker=True)) as session:
        session.connect([checked.url])
        # The engine snapshots its start weights (seed 0); these differ, so compare must fail.
        with pytest.raises(EngineError, match="weights_checker"):
            session.update(_weights(folder, 99))


def _through_one_buffer(pairs, bucket_bytes=128 * 1024):
    """A trainer's reused refit buffer: bucket after bucket copied into one flat buffer,
    each bucket's tensors yielded as views of it (the next bucket overwrites them)."""
    sizes = [t.numel() * t.element_size() for _, t in pairs]
    buffer = torch.empty(max(bucket_bytes, *sizes), dtype=torch.uint8)
    bucket: list = []
    filled = 0
    for (name, tensor), size in [*zip(pairs, sizes, strict=True), ((None, None), 0)]:
        if name is None or (bucket and filled + size > bucket_bytes):
            offset = 0
            for b_name, b_tensor in bucket:
                n = b_tensor.numel() * b_tensor.element_size()
                view = buffer[offset : offset + n]
                view.copy_(b_tensor.reshape(-1).view(torch.uint8))
                yield b_name, view.view(b_tensor.dtype).view(b_tensor.shape)
                offset += n
            bucket, filled = [], 0
        if name is not None:
            bucket.append((name, tensor))
            filled += size


def test_inputs_changed_after_they_were_yielded_fail_the_first_and_a_warm_update(engine, model_dir):
    """Issue 28 item 2: an iterator reusing its bucket buffer made update() report
    success with bytes other than those yielded (the digests agreed: both ends digested
    the same wrong bytes). Now the update fails naming the tensor, before the engine is
    resumed under the new version; the next update repairs it, bit-exact."""
    folder = model_dir("qwen3-tiny")
    before, version = _checksum(engine.url), EngineClient(engine.url).weight_version()
    with WeightSyncSession(_config()) as session:
        session.connect([engine.url])
        # first update: read whole before planning, so the overwrite happened before any load
        with pytest.raises(InputChangedError, match=r"HF tensor 'model\..*' changed after"):
            session.update(_through_one_buffer(_weights(folder, 4)))
        assert _checksum(engine.url) == before  # caught before the engine was touched
        assert EngineClient(engine.url).weight_version() == version
        warm = session.update(_weights(folder, 5)).version
        # a warm update streams: caught at the flush that loads an overwritten tensor
        with pytest.raises(InputChangedError, match=r"HF tensor 'model\..*' changed after"):
            session.update(_through_one_buffer(_weights(folder, 6)))
        shown = EngineClient(engine.url).weight_version()  # never resumed under the new one
        assert shown == warm or shown.startswith(UPDATING_PREFIX), shown
        report = session.update(_weights(folder, 7))
    assert EngineClient(engine.url).weight_version() == report.version
    assert_bit_exact([engine], folder, 7)
