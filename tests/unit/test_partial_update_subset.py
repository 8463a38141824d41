"""Partial updates (issue 41 item 2): an update declares the HF names it sends; only the
parameters those feed are written, every other weight of the engine keeps its bytes, the
write check covers what was sent, and a tensor missing by accident still fails.

The engines, client, replica and transport are test_session_sequence's fakes (sglang's
update rules): q, k and v feed one parameter (qkv), o its own; test_verified_writes'
engines record digests."""

from __future__ import annotations

import pytest
import test_verified_writes
import torch
from test_session_sequence import _tensors
from test_verified_writes import DigestEngine

from p2pweights import ConfigError, DeltaConfig, SyncConfig, WeightSyncSession

engines = test_verified_writes.engines  # the fixture
CONFIG = SyncConfig(buffer_bytes="1MiB")


def _values(engine) -> dict[str, int]:
    return {name: int(t[0]) for name, t in engine.memory.items()}


@pytest.fixture
def session(engines):
    engines.setdefault("http://a", DigestEngine("http://a"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://a"])
        session.update(_tensors(3))  # the first update sends everything
        yield session


def test_only_the_declared_subset_is_written_and_verified(engines, session):
    engine = engines["http://a"]
    before = _values(engine)
    report = session.update([("o", torch.full((2,), 5, dtype=torch.uint8))], subset={"o"})
    after = _values(engine)
    assert {n: v for n, v in after.items() if v != before[n]}  # something was written
    assert all(v == 3 for n, v in after.items() if "o" not in n)  # the rest kept its bytes
    assert any(v == 5 for v in after.values())
    assert report.bytes_written < sum(t.numel() for t in engine.memory.values())
    assert report.engines["http://a"].verified_by == ("write_digests",)
    assert report.subset_size == 1 and "partial update: the 1 HF tensor(s)" in report.summary()
    assert report.metrics()["p2pweights/subset_size"] == 1
    assert engine.running
    session.update(_tensors(6))  # a full update after it still writes everything
    assert all(v == 6 for v in _values(engine).values())


@pytest.mark.parametrize(
    ("tensors", "subset", "says"),
    [
        (["q"], {"q"}, r"feeds a parameter group only in part: it has q but not k, v"),
        (["o", "q"], {"o"}, r"HF tensor 'q' is not in this update's declared subset"),
        (["o"], {"o", "q", "k", "v"}, r"lacks 3 HF tensor\(s\) its declared subset names: k, q, v"),
        (["o"], {"o", "x"}, r"subset names 1 HF tensor\(s\) the first update did not send: x"),
    ],
    ids=["part-of-a-group", "outside", "missing", "unknown"],
)
def test_a_subset_that_does_not_match_is_refused_before_any_byte(
    engines, session, tensors, subset, says
):
    engine = engines["http://a"]
    before = {n: t.clone() for n, t in engine.memory.items()}
    given = [(n, torch.full((2,), 9, dtype=torch.uint8)) for n in tensors]
    with pytest.raises(ConfigError, match=says):
        session.update(given, subset=subset)
    assert all(torch.equal(engine.memory[n], t) for n, t in before.items())
    assert engine.running  # refused before the engines paused


def test_a_streamed_subset_missing_a_tensor_fails(engines, session):
    def stream():
        yield "q", torch.full((2,), 7, dtype=torch.uint8)
        yield "k", torch.full((2,), 7, dtype=torch.uint8)  # v never comes

    with pytest.raises(ConfigError, match=r"missing HF tensors: .*v"):
        session.update(stream(), subset={"q", "k", "v"})


def test_the_first_update_and_delta_sessions_refuse_a_subset(engines):
    engines.setdefault("http://a", DigestEngine("http://a"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://a"])
        with pytest.raises(ConfigError, match="the first update sends every HF tensor"):
            session.update(_tensors(3), subset={"q", "k", "v", "o"})
    delta = SyncConfig(buffer_bytes="1MiB", delta=DeltaConfig())
    refused = pytest.raises(ConfigError, match=r"cannot go with SyncConfig\.delta")
    with WeightSyncSession(delta) as session, refused:
        session.update(_tensors(3), subset={"o"})
    with WeightSyncSession(CONFIG) as session, pytest.raises(ConfigError, match="not one string"):
        session.update(_tensors(3), subset="o")
