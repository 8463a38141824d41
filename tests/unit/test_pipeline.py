"""The staging pipeline with an in-process fake transport (unit level only).

The fake copies bytes with ctypes.memmove from the staging buffer into tensors
standing for engine memory, so these tests check the byte plan, buffer reuse,
the one-writer-per-engine rule and failure reporting. Real transports between
processes are tested in tests/integration.
"""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from p2pweights.engines.published import RankPublication, WeightRegion
from p2pweights.errors import TransferError
from p2pweights.transfer.buffers import ALIGNMENT_BYTES, StagingBuffers, aligned
from p2pweights.transfer.pipeline import UpdatePipeline
from p2pweights.transfer.transports.base import Transport, Write
from p2pweights.transfer.writers import EngineWriter


class CopyingTransport(Transport):
    """Copies in-process; records which thread wrote to which engine."""

    name = "fake"

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None):
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.registered: list[int] = []
        self.threads: dict[str, set[str]] = {}
        self.lock = threading.Lock()

    def register(self, buffer: torch.Tensor) -> None:
        self.registered.append(buffer.data_ptr())

    def connect(self, target: RankPublication) -> None:
        pass

    def write(self, target, writes, timeout_s):
        with self.lock:
            self.threads.setdefault(target.engine_url, set()).add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.fail_on == target.engine_url:
            raise TransferError(f"engine {target.engine_url} rank {target.engine_rank}: status -1")
        for w in writes:
            ctypes.memmove(w.dst_address, w.src_address, w.num_bytes)

    def close(self) -> None:
        pass


def _engine(url: str, rank: int, params: dict[str, torch.Tensor]) -> RankPublication:
    regions = {
        n: WeightRegion(t.data_ptr(), t.numel() * t.element_size()) for n, t in params.items()
    }
    return RankPublication(url, rank, "fake", regions, session_id="x")


def _copy_load(loads):
    """A replica stand-in: each input is one parameter's bytes; records every call."""

    def load(key, inputs, views):
        loads.append((key, [name for name, _ in inputs]))
        for name, value in inputs:
            views[name].copy_(value.view(torch.uint8))

    return load


def _setup(transport, buffer_bytes, urls=("http://a", "http://b"), timeout_s=5.0, loads=None):
    buffers = StagingBuffers(buffer_bytes, torch.device("cpu"), transport.register)
    writers = {u: EngineWriter(u, transport, timeout_s) for u in urls}
    load = _copy_load([] if loads is None else loads)
    return buffers, writers, UpdatePipeline(buffers, writers, timeout_s, load)


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(300 + 17 * i, generator=g).to(torch.bfloat16) for i in range(12)}


def _stage_all(pipeline, source, targets, key="replica"):
    for name, value in source.items():
        sizes = {name: value.numel() * value.element_size()}
        pipeline.stage(key, sizes, [(name, value)], targets)


def test_bytes_land_bit_exact_across_flushes_and_targets():
    transport = CopyingTransport(delay_s=0.01)
    loads: list = []
    # a buffer holding about two parameters forces many flushes and buffer reuse
    _, _, pipeline = _setup(transport, 2 * aligned(600), loads=loads)
    source = _params(0)
    engines = [{n: torch.zeros_like(t) for n, t in source.items()} for _ in range(2)]
    targets = [_engine("http://a", 0, engines[0]), _engine("http://b", 0, engines[1])]
    _stage_all(pipeline, source, targets)
    stats = pipeline.finish()
    for engine in engines:
        for name, value in source.items():
            assert torch.equal(engine[name].view(torch.uint8), value.view(torch.uint8)), name
    assert stats.num_flushes > 2
    # each group loaded once for both targets, in one call per flushed buffer
    assert sorted(n for _, names in loads for n in names) == sorted(source)
    assert len(loads) == stats.num_flushes
    assert stats.bytes_written == 2 * sum(t.numel() * 2 for t in source.values())
    assert len(transport.registered) == 2  # both buffers registered once


def test_one_writer_thread_per_engine():
    transport = CopyingTransport()
    _, _, pipeline = _setup(transport, aligned(1000))
    source = _params(1)
    sinks = {
        u: {n: torch.zeros_like(t) for n, t in source.items()} for u in ("http://a", "http://b")
    }
    targets = [_engine(u, 0, sinks[u]) for u in sinks]
    _stage_all(pipeline, source, targets)
    pipeline.finish()
    assert all(len(threads) == 1 for threads in transport.threads.values())
    assert transport.threads["http://a"] != transport.threads["http://b"]


def test_failed_write_fails_the_update_naming_engine_rank_and_parameter():
    _, _, pipeline = _setup(CopyingTransport(fail_on="http://b"), 1 << 20)
    source = _params(2)
    sinks = [{n: torch.zeros_like(t) for n, t in source.items()} for _ in range(2)]
    targets = [_engine(u, 3, sink) for u, sink in zip(("http://a", "http://b"), sinks, strict=True)]
    _stage_all(pipeline, source, targets)
    with pytest.raises(TransferError, match=r"engine http://b rank 3 parameters p0, p1"):
        pipeline.finish()


_KEEP_ALIVE: list[object] = []  # the late write lands after its test ended; keep its memory


def test_late_write_fails_the_update():
    _, _, pipeline = _setup(CopyingTransport(delay_s=1.5), 1 << 20, timeout_s=0.3)
    source = _params(3)
    sink = {n: torch.zeros_like(t) for n, t in source.items()}
    _KEEP_ALIVE.append((sink, pipeline))
    targets = [_engine("http://a", 0, sink)]
    _stage_all(pipeline, source, targets)
    with pytest.raises(
        TransferError, match=r"still running after transfer_timeout_s=0.3.*http://a rank 0"
    ):
        pipeline.finish()


def test_refuses_to_write_outside_published_region():
    _, _, pipeline = _setup(CopyingTransport(), 1 << 20)
    small = {"p0": torch.zeros(10, dtype=torch.bfloat16)}
    target = _engine("http://a", 1, small)
    with pytest.raises(TransferError, match=r"http://a rank 1 parameter 'p0'.*outside"):
        pipeline.stage("r", {"p0": 40}, [], [target])
    with pytest.raises(TransferError, match=r"parameter 'zz' was not published"):
        pipeline.stage("r", {"zz": 20}, [], [target])


def test_group_larger_than_buffer_is_refused():
    _, _, pipeline = _setup(CopyingTransport(), ALIGNMENT_BYTES * 4)
    with pytest.raises(TransferError, match="raise buffer_bytes"):
        pipeline.stage("r", {"big": ALIGNMENT_BYTES * 5}, [], [])


def test_write_batches_name_their_parameters():
    w = Write(1, 2, 3)
    assert (w.src_address, w.dst_address, w.num_bytes) == (1, 2, 3)
