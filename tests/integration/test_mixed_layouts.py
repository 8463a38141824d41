"""Engines of different layouts in one connect: each layout its own replica, every rank
bit-exact (sglang's own ``load_weights`` of the same tensors into a real model of that rank)."""

from __future__ import annotations

import pytest
import torch
from _bit_exact import engine_mismatches

from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
from p2pweights.engines.client import EngineClient
from p2pweights.testing import synthetic_weights
from p2pweights.wire.delta import HEADER_BYTES, SCRATCH_NAME
from p2pweights.wire.landed import LANDED_NAME

pytestmark = pytest.mark.integration


def _weights(folder, seed):
    return list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))


def _published_bytes(engine) -> dict[tuple[str, int], int]:
    client = EngineClient(engine.url)
    try:
        return {
            (engine.url, rank): sum(
                # a rank publishing a delta scratch region gets a header there every
                # update (without deltas one with no entries), not a weight's bytes; its
                # landed-flags region is written only with digest_as_written
                HEADER_BYTES if name == SCRATCH_NAME else 0 if name == LANDED_NAME else r.num_bytes
                for name, r in client.publication(rank).regions.items()
            )
            for rank in range(engine.tp)
        }
    finally:
        client.close()


@pytest.mark.parametrize(
    ("model", "layouts"),
    [
        ("qwen3-tiny", [4, 2]),
        ("qwen3-moe-tiny", [(2, {"ep_size": 2}), (2, {"ep_size": 1})]),
    ],
    ids=["tp4+tp2", "tp2ep2+tp2ep1"],
)
def test_mixed_layouts_in_one_connect_are_bit_exact(model, layouts, model_dir, shared_engines):
    folder = model_dir(model)
    engines = shared_engines(folder, layouts, seed=0)
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([e.url for e in engines])
        # one replica per layout: no two ranks of these engines share one
        replica_of = {
            (pub.engine_url, pub.engine_rank): key
            for key, pubs in session._connection.targets.items()
            for pub in pubs
        }
        assert len(replica_of) == len(set(replica_of.values())) == sum(e.tp for e in engines)
        published = {k: v for e in engines for k, v in _published_bytes(e).items()}
        for seed in (61, 62):
            report = session.update(_weights(folder, seed))
            # every rank got exactly its own bytes (every parameter it publishes)
            assert report.bytes_by_target == published
            for engine in engines:
                mismatches = engine_mismatches(engine.url, lambda seed=seed: _weights(folder, seed))
                assert mismatches == {r: [] for r in range(engine.tp)}, f"{engine.url}"
