"""Inputs changed after update() received them fail the update, naming the tensor
(issue 28, item 2): what ``source.receipts`` detects and what it cannot, then the
session against the fake engines of test_session_sequence (unit level; the local
engine's test is tests/integration/test_failures.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from test_session_sequence import (  # the fixture is used by name
    CONFIG,
    _holds,
    _tensors,
    engines,  # noqa: F401
)

from p2pweights import WeightSyncSession
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.errors import ConfigError, InputChangedError
from p2pweights.source.receipts import CheckedLoader, Receipts

# -- what is detected --------------------------------------------------------------------------


def _received(tensor: torch.Tensor, name: str = "w") -> Receipts:
    receipts = Receipts()
    receipts.record(name, tensor)
    return receipts


def _bucket() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bucket buffer and two tensors yielded as views of it."""
    buffer = torch.arange(8, dtype=torch.float32)
    return buffer, buffer[:4].view(2, 2), buffer[4:]


@pytest.mark.parametrize(
    "change",
    [
        lambda buffer, first, second: buffer.copy_(buffer + 1),  # the next bucket copied in
        lambda buffer, first, second: second.zero_(),  # another part of the same buffer
        lambda buffer, first, second: first.add_(1),
        lambda buffer, first, second: torch.add(buffer, 1, out=buffer),
        lambda buffer, first, second: first.set_(torch.zeros(2, 2)),
    ],
    ids=["copy-into-buffer", "other-view-of-buffer", "in-place-op", "out=", "set_"],
)
def test_an_in_place_write_through_torch_is_detected_naming_the_tensor(change):
    buffer, first, second = _bucket()
    receipts = _received(first, "model.layers.0.mlp.up_proj.weight")
    with torch.no_grad():  # no_grad does not hide a write from the version counter
        change(buffer, first, second)
    with pytest.raises(InputChangedError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'"):
        receipts.check("model.layers.0.mlp.up_proj.weight", first)


def test_a_data_assignment_is_detected_by_its_data_pointer():
    tensor = torch.ones(4)
    receipts = _received(tensor)
    tensor.data = torch.zeros(4)
    with pytest.raises(InputChangedError, match="data pointer moved"):
        receipts.check("w", tensor)


def test_an_unchanged_tensor_passes_and_one_made_from_it_is_not_checked():
    tensor = torch.ones(4)
    receipts = _received(tensor)
    receipts.check("w", tensor)
    converted = tensor * 2  # what a conversion (fp8) hands the loader under the same name
    converted.add_(1)
    receipts.check("w", converted)
    receipts.check("never-received", tensor)


def test_writes_that_bypass_torch_are_not_detected():
    """Documented limits: numpy views (DLPack, kernels and transports writing by
    pointer alike) do not move the version counter."""
    tensor = torch.ones(4)
    receipts = _received(tensor)
    np.asarray(tensor.numpy())[:] = 5
    receipts.check("w", tensor)  # no error: this is not detectable cheaply


def test_an_inference_mode_tensor_is_checked_by_its_pointer_only():
    with torch.inference_mode():
        tensor = torch.ones(4)
    receipts = _received(tensor)
    receipts.check("w", tensor)
    tensor.data = torch.zeros(4)
    with pytest.raises(InputChangedError, match="data pointer"):
        receipts.check("w", tensor)


def test_a_checked_loader_checks_before_it_loads():
    loaded = []

    class Loader:
        layouts = {"p": "layout"}

        def load_into(self, inputs, views):
            loaded.append([name for name, _ in inputs])

    tensor = torch.ones(4)
    receipts = _received(tensor)
    loader = CheckedLoader(Loader(), receipts)
    assert loader.layouts == {"p": "layout"}
    loader.load_into([("w", tensor)], {})
    tensor.add_(1)
    with pytest.raises(InputChangedError):
        loader.load_into([("w", tensor)], {})
    assert loaded == [["w"]]  # the changed input was not loaded


def test_the_error_is_a_config_error():
    assert issubclass(InputChangedError, ConfigError)


# -- the session -------------------------------------------------------------------------------


def _reusing(value: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Two buckets through one buffer: q and k, then v and o copied over them (v and o
    hold ``value + 100``), as a trainer reusing its refit buffer does."""
    buffer = torch.empty(4, dtype=torch.uint8)
    buffer.fill_(value)
    yield "q", buffer[:2]
    yield "k", buffer[2:]
    buffer.copy_(torch.full((4,), value + 100, dtype=torch.uint8))
    yield "v", buffer[:2]
    yield "o", buffer[2:]


def test_a_first_update_from_a_reusing_iterator_fails_naming_the_tensor(engines):  # noqa: F811
    """Read whole (a first update's iterator that does not describe itself), q was
    overwritten by v's bucket before any byte was loaded: before, the update reported
    success with q's slot holding v's bytes."""
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        before = list(engines["http://e0"].events)
        with pytest.raises(InputChangedError, match=r"'[kq]' changed after update\(\) received it"):
            session.update(_reusing(1))
        engine = engines["http://e0"]
        assert engine.events == before and engine.running  # caught before the first write
        session.update(_tensors(2))  # not blamed on the next
    assert _holds(engine, 2)


def test_a_warm_streamed_update_from_a_reusing_iterator_fails_naming_the_tensor(engines):  # noqa: F811
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))
        with pytest.raises(InputChangedError, match=r"'[kq]' changed"):
            session.update(_reusing(2))
        engine = engines["http://e0"]
        assert engine.running and _holds(engine, 1) and engine.version == "1"
        session.update(iter(_tensors(3)))
    assert _holds(engine, 3)


def test_a_change_after_the_engines_opened_leaves_them_paused_and_torn(engines):  # noqa: F811
    """The iterator writes into "o" after yielding it (its last tensor): q, k, v were
    written by then; "o" is loaded at the end. The update fails before the engine is
    closed or resumed, and the next update repairs it."""

    def clears_after_yielding(value):
        pairs = _tensors(value)
        yield from pairs
        pairs[3][1].zero_()  # "cleanup" of a buffer still in use

    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))
        with pytest.raises(InputChangedError, match=r"'o'.*version counter went from") as caught:
            session.update(clears_after_yielding(2))
        assert str(caught.value).count("stay paused") == 1  # said once, by the session
        assert f"'{UPDATING_PREFIX}2'" in str(caught.value)
        engine = engines["http://e0"]
        assert engine.paused and engine.version == f"{UPDATING_PREFIX}2"
        assert "version" not in engine.events[-3:] and "continue" not in engine.events[-3:]
        report = session.update(_tensors(3))
    assert _holds(engine, 3) and engine.running and engine.version == report.version


def test_a_sparse_input_is_left_to_the_input_check_not_a_raw_runtime_error():
    """Found in review: recording a sparse tensor's data pointer raised RuntimeError
    before the input check could look at it; it has no data pointer to watch."""
    receipts = Receipts()
    sparse = torch.ones(4, 4).to_sparse()
    receipts.record("w", sparse)
    receipts.check("w", sparse)  # nothing recorded, nothing to compare
