"""The executor keeps a staging buffer an unsettled write reads out of use, and its
engine rank out of later updates, until the write settled (an in-process fake transport:
unit level only; real transports between processes are tested in tests/integration)."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from p2pweights.errors import TransferError, UnsettledWrite
from p2pweights.plan.byte_plan import aligned, build_byte_plan
from p2pweights.transfer.executor import TransferExecutor
from p2pweights.transfer.writers import FailedTargets, RankWriter, WriteBatch
from p2pweights.transports.base import Transport, Write
from p2pweights.wire.publication import RankPublication, WeightRegion

STUCK, GOOD = "http://stuck", "http://good"


class StaleWrite:
    """A write the fake transport gave up on: it lands (its bytes as they were when it was
    issued) only once the test lets it, and says it settled only then."""

    def __init__(self, writes, events: list[tuple[str, int]]):
        self.copies = [
            (w.dst_address, bytes(ctypes.string_at(w.src_address, w.num_bytes))) for w in writes
        ]
        self.sources = {w.src_address for w in writes}
        self.events = events
        self.may_land = False
        self.landed = False

    def settle(self, timeout_s: float) -> bool:
        if self.may_land and not self.landed:
            for dst, data in self.copies:
                ctypes.memmove(dst, data, len(data))
            self.landed = True
            self.events.append(("settled", 0))
        return self.landed


class StuckOnceTransport(Transport):
    """Copies in-process; the first write to ``STUCK`` is given up on unsettled."""

    name = "fake"

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []  # ("write", engine) / ("settled", 0)
        self.stale: list[StaleWrite] = []
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.lock = threading.Lock()

    def register(self, buffer: torch.Tensor) -> None:
        self.registered.append(buffer.data_ptr())

    def unregister(self, buffer: torch.Tensor) -> None:
        self.unregistered.append(buffer.data_ptr())

    def connect(self, target: RankPublication) -> None:
        pass

    def write(self, target, writes, timeout_s):
        with self.lock:
            self.events.append(("write", target.engine_url))
        if target.engine_url == STUCK and not self.stale:
            stale = StaleWrite(writes, self.events)
            self.stale.append(stale)
            raise UnsettledWrite(
                f"engine {STUCK} rank 0: not done after {timeout_s} s; may land later",
                stale.settle,
            )
        for w in writes:
            ctypes.memmove(w.dst_address, w.src_address, w.num_bytes)

    def close(self) -> None:
        pass


class Replica:
    """Loads each input's bytes into the view of the same name, noting the buffer filled."""

    def __init__(self, events: list[tuple[str, int]]):
        self.events = events

    def load_into(self, inputs, views):
        for name, value in inputs:
            self.events.append(("load", views[name].data_ptr()))
            views[name].copy_(value.view(torch.uint8))


def _params(value: int) -> dict[str, torch.Tensor]:
    return {f"p{i}": torch.full((300,), value + i, dtype=torch.int16) for i in range(8)}


def _engine(url: str, memory: dict[str, torch.Tensor]) -> RankPublication:
    regions = {
        n: WeightRegion(t.data_ptr(), t.numel() * t.element_size()) for n, t in memory.items()
    }
    return RankPublication(url, 0, "fake", regions, session_id=url)


_KEEP_ALIVE: list[object] = []  # memory a stale write of a failed test may still land in


def _setup(transport: StuckOnceTransport):
    memory = {url: {n: torch.zeros_like(t) for n, t in _params(0).items()} for url in (STUCK, GOOD)}
    _KEEP_ALIVE.append(memory)
    targets = [_engine(url, memory[url]) for url in (STUCK, GOOD)]
    source = _params(0)
    plan = build_byte_plan(
        {"replica": [(frozenset({n}), (n,)) for n in source]},
        {"replica": {n: 600 for n in source}},
        {"replica": targets},
        aligned(600),  # one parameter per buffer: a flush (and a write per rank) per group
    )
    executor = TransferExecutor(transport, torch.device("cpu"), 5.0)
    executor.connect(targets)
    executor.reserve(plan.buffer_bytes)
    _KEEP_ALIVE.append(executor)
    return executor, plan, memory


def _update(executor, plan, value: int, events):
    source = _params(value)
    ready = [(plan.group("replica", i), [(n, source[n])]) for i, n in enumerate(source)]
    return executor.run(plan, ready, {"replica": Replica(events)})


def _stale_buffer(transport: StuckOnceTransport, executor: TransferExecutor) -> range:
    """The addresses of the staging buffer the stale write reads."""
    (stale,) = transport.stale
    (source,) = stale.sources
    buffers = executor._buffers.buffers  # type: ignore[union-attr]
    spans = [range(b.address, b.address + b.capacity_bytes) for b in buffers]
    return next(span for span in spans if source in span)


def test_a_write_that_never_settles_fails_only_its_engine_rank():
    """A stuck rank holds no staging buffer: the others get every byte while its write
    given up on has not settled (issue 39 item 7); the buffer it reads stays registered."""
    transport = StuckOnceTransport()
    executor, plan, memory = _setup(transport)
    result = _update(executor, plan, 1, transport.events)
    assert not result.complete(STUCK) and result.complete(GOOD)
    assert "may land later" in str(result.failures[(STUCK, 0)])
    assert [e for e in transport.events if e == ("write", STUCK)] == [("write", STUCK)]
    for name, value in _params(1).items():
        assert torch.equal(memory[GOOD][name], value)
    assert ("settled", 0) not in transport.events  # nothing waited for it
    assert executor.unsettled_targets == {(STUCK, 0)}
    stale_buffer = _stale_buffer(transport, executor)
    executor.close()  # still read by the stale write: never deregistered
    assert stale_buffer.start not in transport.unregistered


def test_a_stale_write_landing_late_reaches_only_its_torn_rank():
    transport = StuckOnceTransport()
    executor, plan, memory = _setup(transport)
    result = _update(executor, plan, 1, transport.events)
    transport.stale[0].may_land = True
    assert transport.stale[0].settle(0.0)  # it lands now, after the others were written
    assert not result.complete(STUCK)
    for name, value in _params(1).items():
        assert torch.equal(memory[GOOD][name], value)


def test_the_next_update_fails_before_writing_anything_while_a_write_may_still_land():
    transport = StuckOnceTransport()
    executor, plan, memory = _setup(transport)
    assert not _update(executor, plan, 1, transport.events).complete(STUCK)
    before = list(transport.events)
    with pytest.raises(TransferError, match=r"http://stuck rank 0 .*this update is refused"):
        _update(executor, plan, 2, transport.events)
    assert transport.events == before  # nothing loaded, nothing written
    assert executor.unsettled_targets == {(STUCK, 0)}
    transport.stale[0].may_land = True  # the stale write lands; then the retry writes over it
    result = _update(executor, plan, 3, transport.events)
    assert not result.failures and executor.unsettled_targets == frozenset()
    for url in (STUCK, GOOD):
        for name, value in _params(3).items():
            assert torch.equal(memory[url][name], value)


def test_growing_or_closing_never_releases_a_buffer_an_unsettled_write_reads():
    transport = StuckOnceTransport()
    executor, plan, _ = _setup(transport)
    assert not _update(executor, plan, 1, transport.events).complete(STUCK)
    stale_buffer = _stale_buffer(transport, executor)
    with pytest.raises(TransferError, match=r"growing the staging buffers is refused"):
        executor.reserve(1 << 20)
    assert transport.unregistered == []
    executor.close()
    assert stale_buffer.start not in transport.unregistered and len(transport.unregistered) == 1


class RecordingTransport(StuckOnceTransport):
    def write(self, target, writes, timeout_s):
        self.events.append(("write", target.engine_url))
        if len(self.stale) == 0:
            stale = StaleWrite(writes, self.events)
            self.stale.append(stale)
            raise UnsettledWrite("engine http://stuck rank 0: not done", stale.settle)


def test_a_writer_refuses_its_rank_while_its_write_given_up_on_may_still_land():
    transport = RecordingTransport()
    memory = {"w": torch.zeros(8, dtype=torch.uint8)}
    writer = RankWriter((STUCK, 0), transport, 1.0)
    source = torch.ones(8, dtype=torch.uint8)
    batch = WriteBatch(_engine(STUCK, memory))
    batch.add(Write(source.data_ptr(), memory["w"].data_ptr(), 8), "w")
    with pytest.raises(UnsettledWrite, match=r"write to engine http://stuck rank 0 parameters w"):
        writer.submit(batch, FailedTargets()).result()
    with pytest.raises(TransferError, match=r"refused: an earlier write .* may still land"):
        writer.submit(batch, FailedTargets()).result()
    assert transport.events == [("write", STUCK)]
    transport.stale[0].may_land = True
    writer.submit(batch, FailedTargets()).result()
    assert transport.events[-1] == ("write", STUCK) and len(transport.events) == 3
    writer.close()
