"""Reconnecting the executor to a changed engine list (unit level, an in-process transport).

An engine removed, one added, one restarted at the same URL on new addresses: the
staging buffers stay registered, stale publications lose their writer and their
transport connection, and the next run writes only through current publications.
"""

from __future__ import annotations

import ctypes

import torch

from p2pweights.plan.byte_plan import build_byte_plan
from p2pweights.testing.loaders import FnLoader
from p2pweights.transfer.executor import TransferExecutor
from p2pweights.transports.base import Transport
from p2pweights.wire.publication import RankPublication, WeightRegion


class RecordingTransport(Transport):
    """Copies in-process; records connections, disconnections and each write's peer."""

    name = "fake"

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.events: list[tuple[str, str]] = []
        self.connected: set[str] = set()
        self.written_peers: list[str] = []

    def register(self, buffer: torch.Tensor) -> None:
        self.registered.append(buffer.data_ptr())

    def unregister(self, buffer: torch.Tensor) -> None:
        self.registered.remove(buffer.data_ptr())

    def connect(self, target: RankPublication) -> None:
        assert target.session_id is not None
        if target.session_id not in self.connected:
            self.events.append(("connect", target.session_id))
        self.connected.add(target.session_id)

    def disconnect(self, target: RankPublication) -> None:
        assert target.session_id is not None
        self.events.append(("disconnect", target.session_id))
        self.connected.discard(target.session_id)

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self.connected)

    def write(self, target, writes, timeout_s):
        assert target.session_id in self.connected, f"write to unconnected {target.session_id}"
        self.written_peers.append(target.session_id)
        for w in writes:
            ctypes.memmove(w.dst_address, w.src_address, w.num_bytes)

    def close(self) -> None:
        pass


SOURCE = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(16, dtype=torch.float32)}


def _engine(url: str, rank: int, peer: str) -> tuple[RankPublication, dict[str, torch.Tensor]]:
    memory = {name: torch.zeros_like(t) for name, t in SOURCE.items()}
    regions = {
        name: WeightRegion(t.data_ptr(), t.numel() * t.element_size()) for name, t in memory.items()
    }
    return RankPublication(url, rank, "fake", regions, session_id=peer), memory


def _run(executor: TransferExecutor, targets: list[RankPublication]) -> None:
    plan = build_byte_plan(
        {"r": [(frozenset({n}), (n,)) for n in SOURCE]},
        {"r": {n: t.numel() * t.element_size() for n, t in SOURCE.items()}},
        {"r": targets},
        2**20,
    )
    executor.reserve(plan.buffer_bytes)

    def load(key, inputs, views):
        for name, value in inputs:
            views[name].copy_(value.view(torch.uint8))

    ready = ((plan.group("r", i), [(n, SOURCE[n])]) for i, n in enumerate(SOURCE))
    executor.run(plan, ready, {"r": FnLoader("r", load)}).raise_if_failed()


def test_reconnect_drops_stale_publications_and_keeps_the_buffers():
    transport = RecordingTransport()
    executor = TransferExecutor(transport, torch.device("cpu"), 5.0)
    a0, a0_mem = _engine("http://a", 0, "a0")  # memories stay alive: they are written
    a1, a1_mem = _engine("http://a", 1, "a1")
    b0, b_mem = _engine("http://b", 0, "b0")
    r0, r_old = _engine("http://r", 0, "r0-before")
    executor.connect([a0, a1, b0, r0])
    _run(executor, [a0, a1, b0, r0])
    buffers = list(transport.registered)

    # engine a removed, c added, r restarted at the same URL on new addresses
    c0, c_mem = _engine("http://c", 0, "c0")
    r0_new, r_new = _engine("http://r", 0, "r0-after")
    transport.written_peers.clear()
    executor.connect([b0, c0, r0_new])

    assert transport.peers == {"b0", "c0", "r0-after"}
    assert set(executor.connected) == {("http://b", 0, "target"), ("http://c", 0, "target"),
                                       ("http://r", 0, "target")}  # fmt: skip
    assert executor.connected[("http://r", 0, "target")] is r0_new
    assert executor.writer_keys == {("http://b", 0), ("http://c", 0), ("http://r", 0)}
    assert ("disconnect", "b0") not in transport.events  # an unchanged engine stays connected
    assert {e for e in transport.events if e[0] == "disconnect"} == {
        ("disconnect", "a0"),
        ("disconnect", "a1"),
        ("disconnect", "r0-before"),
    }

    for memory in (a0_mem, a1_mem, b_mem, c_mem, r_new, r_old):
        for tensor in memory.values():
            tensor.zero_()
    _run(executor, [b0, c0, r0_new])
    assert set(transport.written_peers) == {"b0", "c0", "r0-after"}
    for memory in (b_mem, c_mem, r_new):
        for name, value in SOURCE.items():
            assert torch.equal(memory[name], value)
    for stale in (a0_mem, a1_mem, r_old):  # removed engines, the restarted one's old memory
        assert all(not tensor.any() for tensor in stale.values())
    assert transport.registered == buffers  # the staging buffers were never registered again

    executor.close()
    assert transport.peers == frozenset() and executor.writer_keys == frozenset()
