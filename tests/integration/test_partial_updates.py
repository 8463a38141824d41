"""A partial update into real local engines (issue 41 item 2): a frozen model but for one
decoder layer's MLP and the final norm. Only those are written; every engine rank is then
bit-exact with the mix (the new values where sent, the first update's elsewhere), and the
write digests verified what was sent."""

from __future__ import annotations

import pytest
from _bit_exact import engine_mismatches, seed_weights

from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession

pytestmark = pytest.mark.integration


def test_a_declared_subset_is_written_and_the_rest_kept_bit_exact(model_dir, shared_engines):
    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [2, 1], transport="mooncake", seed=0)
    first, second = seed_weights(folder, 431), seed_weights(folder, 432)
    trained = {
        n for n, _ in second if n.startswith("model.layers.1.mlp.") or n == "model.norm.weight"
    }
    assert len(trained) == 4  # gate, up, down, the norm
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([e.url for e in engines])
        full = session.update(first, version="all-1")
        report = session.update([(n, t) for n, t in second if n in trained], subset=trained)
    mixed = [(n, t) for n, t in second if n in trained] + [
        (n, t) for n, t in first if n not in trained
    ]
    for engine in engines:
        assert engine_mismatches(engine.url, lambda: mixed) == {r: [] for r in range(engine.tp)}
        assert report.engines[engine.url].verified_by == ("write_digests",)
    assert 0 < report.bytes_written < full.bytes_written / 4
