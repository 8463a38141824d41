"""Pipeline stages as sender groups, against the fake engines of test_session_sequence.

Two stages of two trainer ranks each run in threads, with ``agree`` and ``gather``
exchanged between the threads as an all-reduce and an all-gather would. Stage 0 holds
q, k and v (one parameter group, ``qkv``), stage 1 holds o. Each stage writes its own
parameters to every engine rank; only stage 0's rank 0 drives the engines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from test_session_sequence import (  # the fake engines, client, replica and transport
    FakeEngine,
    FakeHandle,
    engines,  # noqa: F401  (the fixture)
)

from p2pweights import (
    ConfigError,
    P2PWeightsError,
    SyncConfig,
    TrainerTopology,
    WeightSyncSession,
)
from p2pweights import sync_connection as connection_module
from p2pweights.adapters.torch_distributed import stage_ranks
from p2pweights.update_attempt import UpdateAttempt

STAGE_NAMES = {0: ("q", "k", "v"), 1: ("o",)}
URLS = ["http://e0", "http://e1"]


class CheckedHandle(FakeHandle):
    """Refuses inputs that leave a parameter unfed, as the sglang replica does."""

    def groups(self, specs):
        groups = super().groups(specs)
        unfed = [g.param_names for g in groups if not g.hf_names <= specs.keys()]
        if unfed:
            raise ConfigError(f"no HF tensor of this update feeds parameter(s) {unfed}")
        return groups


@pytest.fixture
def checked(engines, monkeypatch):  # noqa: F811
    monkeypatch.setattr(connection_module, "replica_for", lambda *a: CheckedHandle())
    return engines


class Collectives:
    """``agree`` and ``gather`` among threads (an all-reduce and an all-gather)."""

    def __init__(self, size: int):
        self._barrier = threading.Barrier(size, timeout=30)
        self._slots: list[object] = [None] * size
        self.gathers = 0

    def _exchange(self, rank: int, obj: object) -> list[object]:
        self._slots[rank] = obj
        self._barrier.wait()
        everyone = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before all have read them
        return everyone

    def agree(self, rank: int) -> Callable[[bool], bool]:
        return lambda ok: all(self._exchange(rank, ok))

    def gather(self, rank: int) -> Callable[[object], list[object]]:
        def gather(obj: object) -> list[object]:
            if rank == 0:
                self.gathers += 1
            return self._exchange(rank, obj)

        return gather


def _tensors(stage: int, value: int, names=None):
    names = STAGE_NAMES[stage] if names is None else names[stage]
    return [(n, torch.full((2,), value, dtype=torch.uint8)) for n in names]


def _run_stages(body, num_stages: int = 2, per_stage: int = 2, collectives=None):
    """Run ``body(session, stage, rank)`` on every rank; returns each rank's result or error."""
    collectives = collectives or Collectives(num_stages * per_stage)
    results: dict[tuple[int, int], object] = {}

    def run(stage: int, rank: int) -> None:
        index = stage * per_stage + rank
        topology = TrainerTopology(
            rank=rank, num_ranks=per_stage, pipeline_stage=stage, num_pipeline_stages=num_stages
        )
        session = WeightSyncSession(
            SyncConfig(buffer_bytes="1MiB"),
            topology=topology,
            agree=collectives.agree(index),
            gather=collectives.gather(index),
        )
        try:
            session.connect(URLS)
            results[(stage, rank)] = body(session, stage, rank)
        except Exception as exc:
            results[(stage, rank)] = exc
        finally:
            session.close()

    ranks = [(s, r) for s in range(num_stages) for r in range(per_stage)]
    threads = [threading.Thread(target=run, args=rank) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _holds(engine: FakeEngine, value: int) -> bool:
    return all(bool((t == value).all()) for t in engine.memory.values())


def test_each_stage_writes_its_parameters_to_every_engine_rank(checked):
    collectives = Collectives(4)

    def body(session, stage, rank):
        return [session.update(_tensors(stage, value)) for value in (3, 5)]

    results = _run_stages(body, collectives=collectives)
    for (stage, _rank), reports in results.items():
        assert not isinstance(reports, Exception), reports
        # the stage's two ranks split the two engine ranks: one each, every update
        assert [len(r.bytes_by_target) for r in reports] == [1, 1]
        assert {r.version for r in reports} <= {"1", "2"}
        written = {t for (s, _), rs in results.items() if s == stage for t in rs[0].bytes_by_target}
        assert written == {(url, 0) for url in URLS}
    for url in URLS:
        engine = checked[url]
        assert _holds(engine, 5) and engine.running and engine.version == "2"
        assert engine.violations == []
        control = [e for e in engine.events if not e.startswith("write")]
        assert control.count("begin") == 2 and control.count("continue") == 2  # one leader
    assert collectives.gathers == 1  # the first update's inputs; nothing later


@pytest.mark.parametrize("after_open", [False, True])
def test_a_failure_on_one_rank_fails_every_rank_with_the_same_error(
    checked, monkeypatch, after_open
):
    """A rank failing while it stages, before the engines opened (every rank then fails
    the 'open' step: nothing was written), or after (the 'write' step)."""
    original = UpdateAttempt._run
    failed = threading.Event()

    def run(self, tensors, checked_inputs, before_writes, **kwargs):
        config = self.config
        if (config.pipeline_stage, config.trainer_rank) == (1, 1) and not failed.is_set():
            failed.set()
            if after_open:
                before_writes()
            raise RuntimeError("injected write failure")
        return original(self, tensors, checked_inputs, before_writes, **kwargs)

    monkeypatch.setattr(UpdateAttempt, "_run", run)

    def body(session, stage, rank):
        try:
            session.update(_tensors(stage, 3))
        except P2PWeightsError as exc:
            error = exc
        else:
            raise AssertionError("the update should have failed")
        report = session.update(_tensors(stage, 4))  # the retry converges
        return error, report

    results = _run_stages(body)
    errors = {key: value[0] for key, value in results.items()}
    messages = {str(e) for e in errors.values()}
    assert len(messages) == 1, messages
    (message,) = messages
    step = "write" if after_open else "open"
    assert message.startswith(f"pipeline stage 1 trainer rank 1 failed the '{step}' step")
    assert message.endswith("RuntimeError: injected write failure")
    assert {type(e) for e in errors.values()} == {P2PWeightsError}
    assert isinstance(errors[(1, 1)].__cause__, RuntimeError)  # the failing rank's traceback
    for url in URLS:
        assert _holds(checked[url], 4) and checked[url].running
        assert checked[url].violations == []


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ({0: ("q", "k", "v", "o"), 1: ("o",)}, "'o' was sent by pipeline stages 0 and 1"),
        ({0: ("q", "k"), 1: ("v", "o")}, "one stage must send all of them"),
        ({0: ("q", "k", "v"), 1: ()}, "no HF tensor of this update feeds"),
    ],
    ids=["sent-twice", "group-split", "unfed"],
)
def test_the_stages_together_must_feed_every_parameter_once(checked, names, expected):
    def body(session, stage, rank):
        session.update(_tensors(stage, 3, names))

    results = _run_stages(body)
    messages = {str(e) for e in results.values()}
    assert len(messages) == 1 and expected in messages.pop()
    for url in URLS:  # refused before the engines were touched
        assert checked[url].running and "pause" not in checked[url].events
        assert _holds(checked[url], 0)


def test_a_session_with_stages_needs_gather():
    stage = TrainerTopology(num_pipeline_stages=2, pipeline_stage=1)
    with pytest.raises(ConfigError, match="gather="):
        WeightSyncSession(SyncConfig(), topology=stage, agree=lambda ok: ok)
    with pytest.raises(ConfigError, match="agree="):
        WeightSyncSession(SyncConfig(), topology=stage)
    config = SyncConfig().with_topology(stage)
    assert not config.leads and SyncConfig().leads and config.num_senders == 2


@pytest.mark.parametrize(
    ("stages", "index", "expected"),
    [
        ([(0, 1)], 0, (0, 1)),
        ([(0, 1), (0, 1), (0, 1)], 2, (2, 3)),
        ([(0, 2), (1, 2), (0, 2), (1, 2)], 2, (1, 2)),  # interleaved: group order kept
        ([(0, 2), (1, 2), (0, 2), (1, 2)], 1, (0, 2)),
        ([(1, 2), (1, 2), (0, 2), (0, 2)], 3, (1, 2)),
    ],
)
def test_stage_ranks(stages, index, expected):
    assert stage_ranks(stages, index) == expected


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ([(0, 2), (0, 2), (1, 2)], "same number of sending ranks"),
        ([(0, 2), (1, 3)], "same num_pipeline_stages"),
        ([(0, 2), (0, 2)], "same number of sending ranks"),  # stage 1 has none
    ],
)
def test_stage_ranks_refused(stages, match):
    with pytest.raises(ConfigError, match=match):
        stage_ranks(stages, 0)


@pytest.mark.parametrize(
    "fields",
    [
        {"pipeline_stage": 2, "num_pipeline_stages": 2},
        {"pipeline_stage": -1, "num_pipeline_stages": 2},
        {"num_pipeline_stages": 0},
    ],
)
def test_stage_fields_are_validated(fields):
    with pytest.raises(ConfigError):
        TrainerTopology(**fields)


# -- ranks given different kinds of input (issue 41 item 13) -----------------------------------


def test_ranks_given_a_list_and_an_iterator_fail_at_once_naming_what_each_passed(checked):
    """Under torchrun one rank passing a list and another FSDP2's generator used to hang
    both until gloo's timeout: now every rank raises, before any is read, saying which
    rank passed what; the next update with the same kind everywhere goes through."""
    read = []
    every = {0: ("q", "k", "v", "o")}  # one stage sends every parameter

    def stream(stage):
        for pair in _tensors(stage, 3, every):
            read.append(pair[0])
            yield pair

    def body(session, stage, rank):
        given = _tensors(stage, 3, every) if rank == 0 else stream(stage)
        try:
            session.update(given)
        except ConfigError as exc:
            error = exc
        else:
            raise AssertionError("the update should have been refused")
        return error, session.update(_tensors(stage, 4, every))

    results = _run_stages(body, num_stages=1, per_stage=2)
    assert all(isinstance(value, tuple) for value in results.values()), results
    for error, report in results.values():
        message = str(error)
        assert "different kinds of input" in message, message
        assert "trainer rank 0: a sequence (list), read whole" in message
        assert "trainer rank 1: an iterator (generator), streamed" in message
        assert report.version
    assert read == []  # refused before the iterator was read
    for url in URLS:
        assert checked[url].running and checked[url].violations == []
