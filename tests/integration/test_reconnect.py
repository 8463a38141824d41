"""``connect()`` again with a changed engine list, real engines in their own processes.

After a first update into engines A (TP 2) and B: B is removed from the list, C is
added, A is restarted on a new port. The second connect keeps the replicas and the
registered staging buffers, drops every writer and transport connection of B and of
A's old process, and the next update is bit-exact on the new A and on C while B, still
running, keeps the first update's weights: nothing was written to a stale registration.
"""

from __future__ import annotations

import pytest
from _bit_exact import assert_bit_exact, seed_weights
from _procs import ForkedEngine

from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
from p2pweights.engines.client import EngineClient
from p2pweights.engines.inspect import inspect_engine
from p2pweights.wire.delta import HEADER_BYTES

pytestmark = pytest.mark.integration


def _peers(engine) -> set[str]:
    client = EngineClient(engine.url)
    try:
        return {client.publication(rank).peer for rank in range(engine.tp)}
    finally:
        client.close()


def test_reconnect_with_engines_removed_added_and_restarted(
    model_dir, start_engines, shared_engines
):
    folder = model_dir("qwen3-tiny")
    (a,) = start_engines(folder, [2], seed=0, wait=False)  # its own: it is stopped
    b, c = shared_engines(folder, [1, 1], seed=0)
    a.wait_ready()
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([a.url, b.url])
        session.update(seed_weights(folder, 73))
        assert_bit_exact([a], folder, 73)
        assert_bit_exact([b], folder, 73)
        executor = session._connection.executor
        assert executor is not None
        buffers = [buffer.tensor.data_ptr() for buffer in executor._buffers.buffers]
        replicas = dict(session._connection.replicas)
        stale_peers = _peers(a) | _peers(b)

        a.stop()
        restarted = ForkedEngine(folder, tp=2, seed=0)  # a new process on a new port
        start_engines.started.append(restarted)
        restarted.start().wait_ready()
        assert restarted.url != a.url
        session.connect([restarted.url, c.url])

        connected = {(url, rank) for url, rank, _ in executor.connected}
        assert connected == {(restarted.url, 0), (restarted.url, 1), (c.url, 0)}
        assert executor.writer_keys == connected
        assert executor.transport.peers == _peers(restarted) | _peers(c)
        assert not executor.transport.peers & stale_peers
        # replicas and registered buffers kept (the new engines have the old layouts)
        assert all(session._connection.replicas[key] is handle for key, handle in replicas.items())
        assert [buffer.tensor.data_ptr() for buffer in executor._buffers.buffers] == buffers

        report = session.update(seed_weights(folder, 74))
        assert set(report.bytes_by_target) == connected
        assert_bit_exact([restarted], folder, 74)
        assert_bit_exact([c], folder, 74)
        assert_bit_exact([b], folder, 73)  # removed, still serving: never written again

    found = inspect_engine(restarted.url)
    assert found["layout"]["tp_size"] == 2 and found["transport"] == ["mooncake"]
    assert found["weight_version"] == report.version
    # each rank's weights, and the header every update writes to its delta scratch region
    written = sum(report.bytes_by_target[(restarted.url, r)] for r in (0, 1))
    assert found["bytes"] + 2 * HEADER_BYTES == written
    assert found["update_state"]["mid_update"] is False
