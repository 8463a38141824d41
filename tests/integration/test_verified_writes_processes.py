"""Verified writes between real processes: a local engine over real Mooncake and NIXL,
sglang's own model code. A bit flipped in one parameter after the writes (the engine's
test-only ``/p2pweights/corrupt_at_end``) fails the update naming the engine URL, rank
and parameter, leaves that engine paused and torn through ``abort()``, and the next
update converges bit-exact."""

from __future__ import annotations

import httpx
import pytest
import torch
from _bit_exact import assert_bit_exact, seed_weights

from p2pweights import MooncakeConfig, NixlConfig, SyncConfig, TransferError, WeightSyncSession
from p2pweights.engines.client import EngineClient
from p2pweights.engines.update_state import UPDATING_PREFIX

pytestmark = pytest.mark.integration

TRANSPORTS = {
    "mooncake": MooncakeConfig(protocol="tcp", local_hostname="127.0.0.1"),
    "nixl": NixlConfig(backend="UCX"),
}
PARAM = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("kind", list(TRANSPORTS))
def test_a_parameter_changed_after_the_writes_fails_the_update(kind, model_dir, shared_engines):
    folder = model_dir("qwen3-tiny")
    engine, other = shared_engines(folder, [2, 1], transport=kind, seed=0)
    config = SyncConfig(transport=TRANSPORTS[kind], buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([engine.url, other.url])
        first = session.update(seed_weights(folder, 91))  # verified, and passes
        protocol = "tcp" if kind == "mooncake" else "UCX"
        for local, num_ranks in ((engine, 2), (other, 1)):
            seen = first.engines[local.url]
            assert seen.verified_by == ("write_digests",) and seen.unverified_reason is None
            assert (seen.transport, seen.protocol) == (kind, protocol)
            assert seen.num_ranks_written == num_ranks and seen.bytes_written > 0
            assert seen.pause_made and seen.paused_s is not None
            assert 0 < seen.paused_s < first.seconds
        assert "verified by write digests: 2 engine(s)" in first.summary()
        # the local engine answered its end with every rank's record: none was read after
        for connected in session._connection.fleet.engines:
            ranks = {rank for rank, _ in connected.update.end_records}
            assert ranks == set(range(connected.num_ranks)), connected.url
        answer = httpx.post(
            f"{engine.url}/p2pweights/corrupt_at_end", json={"rank": 1, "param": PARAM}
        )
        assert answer.status_code == 200
        with pytest.raises(TransferError) as failed:
            session.update(seed_weights(folder, 92))
        assert f"engine {engine.url} rank 1" in str(failed.value) and PARAM in str(failed.value)
        assert f"engine {engine.url} rank 0" not in str(failed.value)
        report = session.abort()
        assert report.left_paused == [engine.url]
        client = EngineClient(engine.url)
        assert client.weight_version() == f"{UPDATING_PREFIX}{int(first.version) + 1}"
        assert client.engine_state() == {"paused": True, "update_open": False}
        client.close()
        session.update(seed_weights(folder, 93))  # rewritten whole, verified, resumed
    assert_bit_exact([engine, other], folder, 93)


def test_an_engine_without_digests_is_verified_by_its_weight_checker(
    model_dir, shared_engines, monkeypatch
):
    """A local engine started with P2PWEIGHTS_WRITE_DIGESTS=0 records no digests: its
    writes are checked by sglang's own ``/weights_checker`` before its end. One byte
    written wrong through the transport after the writes fails the update, naming engine,
    rank and parameter; the engine stays paused and torn; the next update converges."""
    from _wrong_byte import wrong_byte_after_writes

    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [1], seed=0, env={"P2PWEIGHTS_WRITE_DIGESTS": "0"})
    config = SyncConfig(transport=TRANSPORTS["mooncake"], buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([engine.url])
        first = session.update(seed_weights(folder, 94))
        seen = first.engines[engine.url]
        assert seen.verified_by == ("weights_checker",) and seen.unverified_reason is None
        assert "verify_checker" in first.stage_seconds
        sent = dict(seed_weights(folder, 95))[PARAM]  # TP 1: the engine holds it as sent
        wrong = int(sent.reshape(-1).view(torch.uint8)[0]) ^ 0x01
        with (
            wrong_byte_after_writes(monkeypatch, session, engine.url, 0, PARAM, wrong),
            pytest.raises(TransferError) as failed,
        ):
            session.update(seed_weights(folder, 95))
        assert f"engine {engine.url} rank 0" in str(failed.value) and PARAM in str(failed.value)
        assert "/weights_checker" in str(failed.value)
        client = EngineClient(engine.url)
        assert client.weight_version() == f"{UPDATING_PREFIX}{int(first.version) + 1}"
        assert client.engine_state() == {"paused": True, "update_open": True}
        report = session.abort()
        assert report.left_paused == [engine.url]
        assert client.engine_state() == {"paused": True, "update_open": False}
        client.close()
        last = session.update(seed_weights(folder, 96))  # rewritten whole, verified, resumed
        assert last.engines[engine.url].verified_by == ("weights_checker",)
    assert_bit_exact([engine], folder, 96)


@pytest.mark.parametrize("kind", list(TRANSPORTS))
def test_engine_ranks_digest_parameters_as_their_writes_land(kind, model_dir, shared_engines):
    """``digest_as_written``: the local engine's ranks digest each parameter once the sender
    flagged its writes as landed; only the last flush's are digested at the end. The
    update is verified and bit-exact."""
    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [2], transport=kind, seed=0)
    config = SyncConfig(transport=TRANSPORTS[kind], buffer_bytes="1MiB", digest_as_written=True)
    with WeightSyncSession(config) as session:
        session.connect([engine.url])
        report = session.update(seed_weights(folder, 97))
        assert report.engines[engine.url].verified_by == ("write_digests",)
        (connected,) = session._connection.fleet.engines
        records = connected.update.end_records
        assert set(records) == {(0, "target"), (1, "target")}
        for record in records.values():  # several 1 MiB flushes: all but the last early
            assert 0 < record["digested_early"] < len(record["digests"])
    assert_bit_exact([engine], folder, 97)
