"""An engine rank's before-end steps: run in order on the written parameters, their
record tied to the update session, a failing step recorded instead of raised."""

from __future__ import annotations

import torch

from p2pweights.engine_side import steps
from p2pweights.engine_side.steps import BeforeEnd, RankSide
from p2pweights.wire.digest import digest


def test_each_session_gets_a_new_number_and_begin_clears_the_digests():
    side = RankSide(3, "draft", write_digests=True)
    assert side.after_begin() == {"update": 1, "role": "draft", "digests": None, "error": None}
    params = {"w": torch.arange(10, dtype=torch.float32)}
    record = side.before_end(params)
    assert record["update"] == 1 and record["digests"] == {"w": digest(params["w"])}
    assert side.after_begin()["update"] == 2


def test_a_step_that_changes_bytes_runs_before_the_digest(monkeypatch):
    def add_one(context: BeforeEnd) -> None:
        for tensor in context.params.values():
            tensor.add_(1)

    monkeypatch.setattr(steps, "BEFORE_END_STEPS", [add_one, steps.record_digests])
    params = {"w": torch.zeros(4)}
    record = RankSide(0, write_digests=True).before_end(params)
    assert record["digests"] == {"w": digest(torch.ones(4))}


def test_a_failing_step_is_recorded_not_raised(monkeypatch):
    def broken(context: BeforeEnd) -> None:
        raise RuntimeError("no memory")

    monkeypatch.setattr(steps, "BEFORE_END_STEPS", [broken])
    record = RankSide(0, write_digests=True).before_end({"w": torch.zeros(1)})
    assert record["digests"] is None and record["error"] == "RuntimeError: no memory"


def test_an_engine_that_does_not_digest_records_no_digests():
    """Digests sit in the engine's pause: an engine started without them (the plugin's
    default) records none, and trainers skip its check ("auto") or refuse it ("always")."""
    record = RankSide(0, write_digests=False).before_end({"w": torch.ones(4)})
    assert record["digests"] is None and record["error"] is None


def test_write_digests_default_and_override(monkeypatch):
    from p2pweights import environment

    monkeypatch.delenv("P2PWEIGHTS_WRITE_DIGESTS", raising=False)
    assert environment.write_digests(default=False) is False
    assert environment.write_digests(default=True) is True
    monkeypatch.setenv("P2PWEIGHTS_WRITE_DIGESTS", "1")
    assert environment.write_digests(default=False) is True
    monkeypatch.setenv("P2PWEIGHTS_WRITE_DIGESTS", "0")
    assert environment.write_digests(default=True) is False


def test_a_delta_payload_left_from_an_earlier_session_is_never_applied():
    """A payload still in the scratch region when a new update session begins (one whose
    end raised before clearing it, or a late header write that landed after the end) is
    cleared at that begin, never applied by this session's end. (A sender that died with
    the engine's session open is covered by the next update's own header: see
    test_delta_executor.)"""
    from p2pweights.wire.delta import SCRATCH_NAME, encode, pack_payload

    weights = {"w": torch.zeros(256, dtype=torch.bfloat16)}
    scratch = torch.zeros(4096, dtype=torch.uint8)
    side = RankSide(5, write_digests=False)
    side.after_begin(scratch)
    side.before_end({**weights, SCRATCH_NAME: scratch})  # a full first update
    # a payload (w[:8] = 1) is left in the scratch region outside any session
    changed = weights["w"].clone()
    changed[:8] = 1.0
    entry = encode(weights["w"].view(torch.uint8), changed.view(torch.uint8), 2)
    assert entry is not None
    pack_payload([entry], sequence=2, base_sequence=0, out=scratch)
    # a new session writes every byte: all 2.0, and no payload
    side.after_begin(scratch)
    weights["w"].fill_(2.0)
    record = side.before_end({**weights, SCRATCH_NAME: scratch})
    assert record["error"] is None and "delta" not in record
    assert torch.equal(weights["w"], torch.full((256,), 2.0, dtype=torch.bfloat16))
