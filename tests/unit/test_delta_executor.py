"""Delta updates through the executor with the in-process copying transport (unit level):
the engine side applies each rank's payload from its scratch region, bit-exact."""

from __future__ import annotations

import time

import pytest
import torch
from test_executor import CopyingTransport, _engine

from p2pweights.config import DeltaConfig
from p2pweights.engine_side.delta_apply import DeltaReceiver
from p2pweights.plan.byte_plan import aligned, build_byte_plan
from p2pweights.testing.loaders import FnLoader
from p2pweights.transfer.buffers import staged_bytes
from p2pweights.transfer.executor import RunHooks, TransferExecutor
from p2pweights.wire.delta import SCRATCH_NAME


def _source(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(2000 + 17 * i, generator=g).to(torch.bfloat16) for i in range(8)}


def _step(source: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in source.items():
        new = t.clone()
        mask = torch.rand(t.shape, generator=g) < fraction
        new[mask] = (new[mask].float() * 1.05 + 0.01).to(torch.bfloat16)
        out[name] = new
    return out


class _Engine:
    def __init__(self, url: str, source: dict[str, torch.Tensor], scratch_bytes: int) -> None:
        self.params = {n: torch.zeros_like(t) for n, t in source.items()}
        self.scratch = torch.zeros(scratch_bytes, dtype=torch.uint8)
        self.receiver = DeltaReceiver(url)
        self.pub = _engine(url, 0, {**self.params, SCRATCH_NAME: self.scratch})

    def end(self) -> None:
        self.receiver.take(self.scratch, self.params)

    def holds(self, source: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(self.params[n], t) for n, t in source.items())


def _update(executor, source, targets, shared=True):
    """One group per parameter; one replica for every target (``shared``) or one each."""
    keys = {"r": targets} if shared else {f"r{i}": [t] for i, t in enumerate(targets)}
    plan = build_byte_plan(
        {k: [(frozenset({n}), (n,)) for n in source] for k in keys},
        {k: {n: t.numel() * 2 for n, t in source.items()} for k in keys},
        keys,
        3 * aligned(4200),  # a few parameters per buffer: several flushes
    )
    executor.reserve(plan.buffer_bytes)

    def load(key, inputs, views):
        for name, value in inputs:
            views[name].copy_(value.view(torch.uint8))

    ready = ((plan.group(k, i), [(n, source[n])]) for k in keys for i, n in enumerate(source))
    return executor.run(plan, ready, {k: FnLoader(k, load) for k in keys})


def test_deltas_land_bit_exact_over_several_updates_and_send_less():
    source = _source()
    engines = [_Engine("http://a", source, 1 << 16), _Engine("http://b", source, 1 << 16)]
    executor = TransferExecutor(
        CopyingTransport(), torch.device("cpu"), 5.0, DeltaConfig(max_fraction=0.3, mode="always")
    )
    executor.connect([e.pub for e in engines])
    full = _update(executor, source, [e.pub for e in engines])
    for e in engines:
        e.end()
        assert e.holds(source)
    assert full.delta is not None and full.delta.num_delta_slots == 0
    # one copy of the staged bytes, the alignment padding between slots included
    staged = sum(t.numel() * 2 for t in source.values())
    assert staged <= full.delta.store_bytes <= staged_bytes(t.numel() * 2 for t in source.values())
    for step in range(1, 4):
        source = _step(source, 0.02, step)
        result = _update(executor, source, [e.pub for e in engines])
        for e in engines:
            e.end()
            assert e.holds(source), step
        assert result.delta is not None and result.delta.num_delta_slots == 8
        assert result.delta.fraction < 0.15
        assert result.bytes_written == result.delta.sent_bytes
    executor.close()


def test_ranks_sharing_a_layout_get_a_slot_in_full_where_one_has_no_room():
    """A slot goes as a delta only where every rank sharing its staged bytes takes it
    (the entry replaces those bytes in the staging buffer)."""
    source = _source(1)
    engines = [_Engine("http://a", source, 1 << 16), _Engine("http://b", source, 256)]
    executor = TransferExecutor(CopyingTransport(), torch.device("cpu"), 5.0, DeltaConfig())
    targets = [e.pub for e in engines]
    executor.connect(targets)
    _update(executor, source, targets)
    for e in engines:
        e.end()
    source = _step(source, 0.02, 7)
    result = _update(executor, source, targets)
    for e in engines:
        e.end()
        assert e.holds(source)
    assert result.delta is not None and result.delta.num_delta_slots == 0
    assert result.bytes_by_target[("http://a", 0)] == result.bytes_by_target[("http://b", 0)]


def test_a_flush_decides_its_own_slots_only():
    """The decisions of a flush are keyed by its groups' ids, which Python reuses for the
    next flush's groups: a decision must never outlive its flush."""
    from p2pweights.delta.sender import DeltaSender

    source = _source(2)
    engine = _Engine("http://a", source, 1 << 16)
    sender = DeltaSender(DeltaConfig())
    runner = ("http://a", 0, "target")
    buffer = source["p0"].view(torch.uint8).clone()
    sender.store.remember("r", "p0", buffer)
    sender.store.finish(1, [runner])
    run = sender.begin({runner: engine.pub})
    slots = [("p0", 0, buffer.numel())]
    view = lambda o, n: buffer[o : o + n]  # noqa: E731
    run.compare([("r", 7, slots, frozenset({runner}))], view, lambda k, p: 2)
    run.place(view)
    assert run.slot(7, 0) is not None and run.slot(7, 0).num_bytes == 0  # unchanged
    run.place(view)  # the next flush, with nothing staged
    assert run.slot(7, 0) is None


def test_a_reconnect_forgets_only_ranks_whose_weights_moved():
    """Connecting again re-reads publications: a rank whose regions and peer are the same
    (its transport metadata may differ) keeps deltas; a restarted one gets full writes."""
    import dataclasses

    source = _source(3)
    engines = [_Engine("http://a", source, 1 << 16), _Engine("http://b", source, 1 << 16)]
    executor = TransferExecutor(CopyingTransport(), torch.device("cpu"), 5.0, DeltaConfig())
    targets = [e.pub for e in engines]
    executor.connect(targets)
    _update(executor, source, targets, shared=False)
    for e in engines:
        e.end()
    restarted = _Engine("http://b", source, 1 << 16)  # new memory, seed weights
    targets = [dataclasses.replace(engines[0].pub, agent_metadata=b"re-read"), restarted.pub]
    executor.connect(targets)
    source = _step(source, 0.02, 9)
    result = _update(executor, source, targets, shared=False)
    engines[0].end()
    restarted.end()
    assert engines[0].holds(source) and restarted.holds(source)
    sent = result.bytes_by_target
    assert sent[("http://a", 0)] * 4 < sent[("http://b", 0)]


def test_a_rank_that_published_afresh_when_its_session_opened_gets_full_writes():
    """Compared before the engines pause, decided after: a rank whose weights moved at
    the open (a live publication re-read) gets its slots in full."""
    import dataclasses

    from p2pweights.delta.sender import DeltaSender
    from p2pweights.wire.publication import WeightRegion

    source = _source(4)
    engine = _Engine("http://a", source, 1 << 16)
    sender = DeltaSender(DeltaConfig())
    runner = ("http://a", 0, "target")
    buffer = source["p0"].view(torch.uint8).clone()
    sender.store.remember("r", "p0", buffer)
    sender.store.finish(1, [runner])
    connected = {runner: engine.pub}
    run = sender.begin(connected)
    changed = buffer.clone()
    changed.view(torch.bfloat16)[:3] = 7.0
    view = lambda o, n: changed[o : o + n]  # noqa: E731
    run.compare([("r", 1, [("p0", 0, changed.numel())], frozenset({runner}))], view, lambda k, p: 2)
    moved = dict(engine.pub.regions, p0=WeightRegion(12345, changed.numel()))
    connected[runner] = dataclasses.replace(engine.pub, regions=moved)
    run.place(view)
    assert run.slot(1, 0) is None  # written in full
    assert torch.equal(
        changed[:6].view(torch.bfloat16), torch.full((3,), 7.0, dtype=torch.bfloat16)
    )


def test_a_payload_whose_sender_died_before_end_is_not_applied_by_a_full_update():
    """A delta sender wrote its payload and died before the engine's end; the next
    trainer adopts the engine's open update session (no new begin) and writes every byte
    without deltas. Its end must not apply the dead sender's entries over those bytes:
    every update writes a header to each rank publishing a scratch region, one without
    entries where it sends no deltas."""
    source = _source(4)
    engine = _Engine("http://a", source, 1 << 16)
    dying = TransferExecutor(CopyingTransport(), torch.device("cpu"), 5.0, DeltaConfig())
    dying.connect([engine.pub])
    _update(dying, source, [engine.pub])
    engine.end()
    _update(dying, _step(source, 0.05, 9), [engine.pub])  # the payload is in; no end
    dying.close()

    full = TransferExecutor(CopyingTransport(), torch.device("cpu"), 5.0)  # no deltas
    full.connect([engine.pub])
    fresh = _step(source, 0.05, 11)
    _update(full, fresh, [engine.pub])
    engine.end()
    assert engine.holds(fresh)
    full.close()


class _Link(CopyingTransport):
    """A slow link: each write takes ``s_per_byte`` per byte it moves."""

    def __init__(self, s_per_byte: float) -> None:
        super().__init__()
        self.s_per_byte = s_per_byte

    def write(self, target, writes, timeout_s):
        time.sleep(self.s_per_byte * sum(w.num_bytes for w in writes))
        super().write(target, writes, timeout_s)


@pytest.fixture
def slow_compare(monkeypatch):
    """Every flush's compare takes ``seconds`` longer; ``calls`` counts the compares."""
    import p2pweights.delta.store as store

    real = store.encode_flush

    class Slow:
        seconds = 0.1
        calls = 0

        def __call__(self, *args, **kwargs):
            Slow.calls += 1
            time.sleep(Slow.seconds)
            return real(*args, **kwargs)

    monkeypatch.setattr(store, "encode_flush", Slow())
    return Slow


def _full_bytes(source, num_engines: int) -> int:
    return sum(t.numel() * 2 for t in source.values()) * num_engines


def test_a_delta_whose_compare_costs_more_than_its_writes_save_is_sent_in_full(slow_compare):
    """Auto: the first update full (keeping a copy), the second a delta measuring what it
    costs; its compare (0.1 s a flush) against writes that take microseconds: full from
    then on, without comparing or copying, until the update before a probe keeps a copy
    and the probe compares again. Every engine byte exact all along."""
    source = _source(5)
    engines = [_Engine("http://a", source, 1 << 16), _Engine("http://b", source, 1 << 16)]
    executor = TransferExecutor(CopyingTransport(), torch.device("cpu"), 5.0, DeltaConfig())
    targets = [e.pub for e in engines]
    executor.connect(targets)
    decisions = []
    for step in range(8):
        if step:
            source = _step(source, 0.02, 20 + step)
        calls = slow_compare.calls
        result = _update(executor, source, targets)
        for e in engines:
            e.end()
            assert e.holds(source), step
        decision = result.delta.decision
        decisions.append((decision.mode, decision.keep_copy, decision.reason))
        if decision.mode == "full":
            assert slow_compare.calls == calls  # nothing compared
            assert result.bytes_written >= _full_bytes(source, 2)
            assert result.delta.num_delta_slots == 0
        else:
            assert slow_compare.calls > calls
            assert result.bytes_written < _full_bytes(source, 2) / 4
    assert decisions == [
        ("full", True, "no_base"),  # nothing stored yet
        ("delta", True, "probe"),  # nothing measured yet
        ("full", False, "predicted"),
        ("full", False, "predicted"),
        ("full", False, "predicted"),
        ("full", True, "predicted"),  # the next one probes
        ("delta", True, "probe"),  # against the copy kept by the one before: exact
        ("full", False, "predicted"),
    ]
    last = result.delta.decision
    assert last.predicted_delta_s > last.predicted_full_s
    assert "in full" in last.describe()
    executor.close()


def test_always_sends_a_delta_however_much_its_compare_costs(slow_compare):
    source = _source(6)
    engine = _Engine("http://a", source, 1 << 16)
    executor = TransferExecutor(
        CopyingTransport(), torch.device("cpu"), 5.0, DeltaConfig(mode="always")
    )
    executor.connect([engine.pub])
    slow_compare.seconds = 0.02
    for step in range(4):
        if step:
            source = _step(source, 0.02, 30 + step)
        result = _update(executor, source, [engine.pub])
        engine.end()
        assert engine.holds(source)
        assert result.delta.decision.reason == "always"
        assert result.delta.num_delta_slots == (8 if step else 0)
    executor.close()


def test_a_slow_link_keeps_deltas():
    """Writes at 2 us a byte (a full update waits about 70 ms a rank) against a compare of
    a millisecond: deltas every update after the first, predicted faster."""
    source = _source(7)
    engine = _Engine("http://a", source, 1 << 16)
    executor = TransferExecutor(_Link(2e-6), torch.device("cpu"), 5.0, DeltaConfig())
    executor.connect([engine.pub])
    reasons = []
    for step in range(4):
        if step:
            source = _step(source, 0.02, 40 + step)
        result = _update(executor, source, [engine.pub])
        engine.end()
        assert engine.holds(source)
        reasons.append((result.delta.decision.mode, result.delta.decision.reason))
    assert reasons == [
        ("full", "no_base"),
        ("delta", "probe"),
        ("delta", "predicted"),
        ("delta", "predicted"),
    ]
    executor.close()


def _update_one_flush(executor, source, targets):
    """Every parameter in one staging buffer: its compare runs before the engines pause."""
    keys = {"r": targets}
    plan = build_byte_plan(
        {k: [(frozenset({n}), (n,)) for n in source] for k in keys},
        {k: {n: t.numel() * 2 for n, t in source.items()} for k in keys},
        keys,
        sum(aligned(t.numel() * 2) for t in source.values()) + aligned(1 << 16),
    )
    executor.reserve(plan.buffer_bytes)

    def load(key, inputs, views):
        for name, value in inputs:
            views[name].copy_(value.view(torch.uint8))

    ready = ((plan.group(k, i), [(n, source[n])]) for k in keys for i, n in enumerate(source))
    hooks = RunHooks(before_writes=lambda: None)  # the engines pause here, after the compare
    return executor.run(plan, ready, {k: FnLoader(k, load) for k in keys}, hooks)


@pytest.mark.parametrize(("objective", "mode"), [("update", "full"), ("pause", "delta")])
def test_the_objective_decides_whether_a_slow_compare_before_the_pause_counts(
    slow_compare, objective, mode
):
    """One staging buffer, compared (0.1 s) before the engines pause, over a link that
    writes the whole update in 20 ms: the compare makes the update slower than writing
    every byte, but not the pause (issue 41 item 11)."""
    source = _source(7)
    engine = _Engine("http://a", source, 1 << 16)
    config = DeltaConfig(objective=objective)
    link = _Link(0.02 / _full_bytes(source, 1))
    executor = TransferExecutor(link, torch.device("cpu"), 5.0, config)
    executor.connect([engine.pub])
    for step in range(3):
        if step:
            source = _step(source, 0.02, 40 + step)
        result = _update_one_flush(executor, source, [engine.pub])
        engine.end()
        assert engine.holds(source), step
    decision = result.delta.decision
    assert (decision.mode, decision.reason, decision.objective) == (mode, "predicted", objective)
    assert ("pause" in decision.describe()) == (objective == "pause")
    executor.close()
