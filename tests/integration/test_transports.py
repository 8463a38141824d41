"""Real transports between two processes on loopback: bytes land bit-exact, dead peers fail fast.

An engine process (spawned) allocates weights, publishes them through the
transport's ``Publisher`` and answers sha256 digests; this process parses the
publication as sglang would serve it and writes through the ``Transport``.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

from p2pweights.config import MooncakeConfig, NixlConfig
from p2pweights.errors import TransferError, UnsettledWrite
from p2pweights.transports import Write, create_publisher, create_transport
from p2pweights.wire.publication import RankPublication, parse_publication

pytestmark = pytest.mark.integration

KINDS = ["mooncake", "nixl"]
ENGINE_URL = "http://engine-under-test:30000"
PUBLISHER_OPTIONS: dict[str, dict[str, Any]] = {
    "mooncake": {"hostname": "127.0.0.1", "protocol": "tcp"},
    "nixl": {"backend": "UCX"},
}
TRANSPORT_CONFIGS: dict[str, Any] = {
    "mooncake": MooncakeConfig(protocol="tcp", local_hostname="127.0.0.1"),
    "nixl": NixlConfig(backend="UCX"),
}


def _engine_weights() -> dict[str, torch.Tensor]:
    """One flat storage with several parameter views, plus a separate tensor."""
    flat = torch.zeros(1 << 20, dtype=torch.float32)  # 4 MiB
    return {
        "layers.0.qkv_proj.weight": flat[:3072].view(48, 64),
        "layers.0.o_proj.weight": flat[3072:7168].view(64, 64),
        "layers.0.mlp.gate_up_proj.weight": flat[7168 : 7168 + 600_000],
        "embed_tokens.weight": torch.zeros(1000, 300, dtype=torch.bfloat16),
    }


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _engine_main(kind: str, conn: Any) -> None:
    weights = _engine_weights()
    publisher = create_publisher(kind, **PUBLISHER_OPTIONS[kind])
    publisher.register(weights)
    conn.send(publisher.publication(weights))
    while (command := conn.recv()) != "exit":
        assert command in ("digests", "close")
        if command == "close":  # the weights stay allocated: they can be digested after
            publisher.close()
        conn.send({name: _digest(t) for name, t in weights.items()})
    publisher.close()
    conn.send("closed")


class _Engine:
    def __init__(self, kind: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_engine_main, args=(kind, child), daemon=True)
        self.process.start()
        assert self.conn.poll(60), "engine process did not publish within 60 s"
        self.body = {"rank": 0, "remote_instance_transfer_engine_info": self.conn.recv()}

    def publication(self) -> RankPublication:
        return parse_publication(ENGINE_URL, 0, self.body)

    def digests(self) -> dict[str, str]:
        self.conn.send("digests")
        return self.conn.recv()

    def close_publisher(self) -> dict[str, str]:
        """Close the engine's publisher; the digests of its weights right after."""
        self.conn.send("close")
        return self.conn.recv()

    def stop(self) -> int | None:
        if self.process.is_alive():
            self.conn.send("exit")
            assert self.conn.recv() == "closed"
        self.process.join(30)
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()
        self.process.join(30)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def test_writes_land_bit_exact(kind: str) -> None:
    engine = _Engine(kind)
    try:
        target = engine.publication()
        assert target.backend == kind
        expected = {name: t.clone() for name, t in _engine_weights().items()}
        staging = torch.empty(16 << 20, dtype=torch.uint8)
        generator = torch.Generator().manual_seed(1234)
        staging.copy_(torch.randint(0, 256, staging.shape, dtype=torch.uint8, generator=generator))

        writes: list[Write] = []
        cursor = 4096  # writes start at offsets into the staging buffer

        def add(name: str, byte_offset: int, num_bytes: int) -> None:
            nonlocal cursor
            region = target.regions[name]
            writes.append(
                Write(staging.data_ptr() + cursor, region.address + byte_offset, num_bytes)
            )
            dst = expected[name].view(-1).view(torch.uint8)
            dst[byte_offset : byte_offset + num_bytes] = staging[cursor : cursor + num_bytes]
            cursor += num_bytes + 123  # unaligned gaps between sources

        add("layers.0.qkv_proj.weight", 0, target.regions["layers.0.qkv_proj.weight"].num_bytes)
        add("layers.0.o_proj.weight", 1000, 5000)  # part of a parameter
        add("layers.0.mlp.gate_up_proj.weight", 0, 2_400_000)
        add("embed_tokens.weight", 0, 600_000)
        client = create_transport(TRANSPORT_CONFIGS[kind])
        try:
            client.register(staging)
            client.register(staging)  # once per buffer; a second call is a no-op
            client.connect(target)
            client.write(target, writes[:2], timeout_s=20)
            client.write(target, writes[2:], timeout_s=20)
            # one write spanning two adjacent parameters of the flat storage
            qkv, o_proj = (
                target.regions[n] for n in ("layers.0.qkv_proj.weight", "layers.0.o_proj.weight")
            )
            assert qkv.end == o_proj.address
            span = qkv.num_bytes + o_proj.num_bytes
            client.write(target, [Write(staging.data_ptr(), qkv.address, span)], timeout_s=20)
            # (a write leaving the published regions is refused by the byte plan, before any
            # transport sees it: tests/unit/test_executor.py)
        finally:
            client.close()
        both = torch.cat(
            [expected[n].view(-1) for n in ("layers.0.qkv_proj.weight", "layers.0.o_proj.weight")]
        )
        both.view(torch.uint8)[:] = staging[:span]
        expected["layers.0.qkv_proj.weight"] = both[:3072]
        expected["layers.0.o_proj.weight"] = both[3072:]

        assert engine.digests() == {name: _digest(t) for name, t in expected.items()}
        assert engine.stop() == 0  # the engine process exits cleanly
    finally:
        engine.kill()


def test_dead_engine_fails_within_timeout(kind: str) -> None:
    engine = _Engine(kind)
    target = engine.publication()
    staging = torch.ones(8 << 20, dtype=torch.uint8)
    region = target.regions["layers.0.mlp.gate_up_proj.weight"]
    with create_transport(TRANSPORT_CONFIGS[kind]) as client:
        client.register(staging)
        client.write(target, [Write(staging.data_ptr(), region.address, 4096)], timeout_s=20)
        engine.kill()
        start = time.monotonic()
        with pytest.raises(TransferError, match=r"engine-under-test:30000 rank 0") as info:
            client.write(
                target,
                [
                    Write(staging.data_ptr() + i * 65536, region.address + i * 65536, 65536)
                    for i in range(8)
                ],
                timeout_s=2,
            )
        elapsed = time.monotonic() - start
    assert elapsed < 2 + 3, f"took {elapsed:.1f} s: {info.value}"


def test_hung_engine_times_out(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stopped process keeps its sockets open, so writes hang instead of failing. UCX
    # on one host would write a stopped peer's memory directly (CMA); TCP needs its
    # progress thread, as RDMA across hosts needs a live peer.
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    engine = _Engine(kind)
    pid = engine.process.pid
    assert pid is not None
    try:
        target = engine.publication()
        staging = torch.ones(8 << 20, dtype=torch.uint8)
        region = target.regions["layers.0.mlp.gate_up_proj.weight"]
        with create_transport(TRANSPORT_CONFIGS[kind]) as client:
            client.register(staging)
            client.write(target, [Write(staging.data_ptr(), region.address, 4096)], timeout_s=20)
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            mib = 1 << 20
            # 16 x 2 MiB into the same 2 MiB of the region: more than loopback socket
            # buffers take, so the writes cannot complete while the engine is stopped
            with pytest.raises(TransferError, match=r"rank 0 .*not done after 2 s"):
                client.write(
                    target,
                    [
                        Write(staging.data_ptr() + (i % 4) * 2 * mib, region.address, 2 * mib)
                        for i in range(16)
                    ],
                    timeout_s=2,
                )
            elapsed = time.monotonic() - start
            assert 1.9 < elapsed < 5
            # the engine resumes and still answers; nothing settles the write given up on
            # (the trainer drives its progress only when it polls), so the trainer's close
            # keeps its side, and the engine closes and exits with that write still on its
            # way (test_nothing_lands_after_publisher_close shows why that is safe)
            os.kill(pid, signal.SIGCONT)
            assert set(engine.digests()) == set(_engine_weights())
        assert engine.stop() == 0
    finally:
        if engine.process.is_alive():
            os.kill(pid, signal.SIGCONT)
        engine.kill()


def test_nothing_lands_after_publisher_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write given up on may still be on its way when the engine closes its publisher
    (the engine then frees that memory): once close returned, none of it lands.

    Over UCX's TCP transport the engine agent's progress thread copies every incoming
    put to its address, registered or not, so NixlPublisher.close must end the agent.
    When it only deregistered, the rest of this write landed after close, and an engine
    that freed its weights before its agent segfaulted at exit (a flake of
    test_hung_engine_times_out[nixl], 3 runs in 20 on two cores).
    """
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    engine = _Engine("nixl")
    pid = engine.process.pid
    assert pid is not None
    try:
        target = engine.publication()
        mib = 1 << 20
        staging = torch.empty(8 * mib, dtype=torch.uint8)
        for k in range(4):  # each 2 MiB source differs, so every further write shows
            staging[k * 2 * mib : (k + 1) * 2 * mib] = k + 1
        region = target.regions["layers.0.mlp.gate_up_proj.weight"]
        with create_transport(TRANSPORT_CONFIGS["nixl"]) as client:
            client.register(staging)
            client.write(target, [Write(staging.data_ptr(), region.address, 4096)], timeout_s=20)
            os.kill(pid, signal.SIGSTOP)
            with pytest.raises(UnsettledWrite) as info:
                client.write(
                    target,
                    [
                        Write(staging.data_ptr() + (i % 4) * 2 * mib, region.address, 2 * mib)
                        for i in range(16)
                    ],
                    timeout_s=2,
                )
            os.kill(pid, signal.SIGCONT)
            closed = engine.close_publisher()
            # polling drives the rest of the write: it ends, failed, as its peer's agent went
            assert info.value.settle(30)
            assert engine.digests() == closed
        assert engine.stop() == 0
    finally:
        if engine.process.is_alive():
            os.kill(pid, signal.SIGCONT)
        engine.kill()
