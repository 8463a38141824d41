"""The local engine's weight arena and its broadcast benchmark routes.

Each rank's parameters live in one contiguous arena (one registered region), and the
broadcast baseline (full HF bytes written into each rank's broadcast area, then
sglang's ``load_weights`` from it) leaves every rank bit-exact with sglang's own
loading of the same tensors.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from p2pweights import MooncakeConfig
from p2pweights.engines.client import EngineClient
from p2pweights.testing import synthetic_weights
from p2pweights.transfer.buffers import aligned
from p2pweights.transports import Write, create_transport
from p2pweights.transports.regions import merge_intervals
from p2pweights.verify import verify_engine
from p2pweights.wire.delta import SCRATCH_NAME
from p2pweights.wire.landed import LANDED_NAME
from p2pweights.wire.publication import parse_publication

pytestmark = pytest.mark.integration


def _weights(folder, seed):
    return list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))


def test_arena_and_broadcast_routes_are_bit_exact(model_dir, start_engines):
    folder = model_dir("qwen3-tiny")
    (engine,) = start_engines(folder, [2])
    client = EngineClient(engine.url)
    for rank in range(2):
        published = client.publication(rank).regions
        # the delta scratch and the landed flags are not weights
        regions = [r for name, r in published.items() if name not in (SCRATCH_NAME, LANDED_NAME)]
        merged = merge_intervals((r.address, aligned(r.num_bytes)) for r in regions)
        assert len(merged) == 1, f"rank {rank} weights span {len(merged)} regions"

    tensors = _weights(folder, seed=7)
    offsets, offset = [], 0
    for _, tensor in tensors:
        offsets.append(offset)
        offset += aligned(tensor.numel() * tensor.element_size())
    source = torch.zeros(offset, dtype=torch.uint8)
    manifest = []
    for (name, tensor), start in zip(tensors, offsets, strict=True):
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        source[start : start + flat.numel()] = flat
        manifest.append([name, list(tensor.shape), "bfloat16", start])

    answer = httpx.post(f"{engine.url}/p2pweights/broadcast_area", json={"num_bytes": offset})
    assert answer.status_code == 200, answer.text
    with create_transport(MooncakeConfig(protocol="tcp")) as transport:
        transport.register(source)
        client.pause_generation("retract")
        client.begin_weight_update("all")
        for entry in answer.json()["ranks"]:
            pub = parse_publication(engine.url, entry["rank"], entry)
            (area,) = pub.regions.values()
            transport.write(pub, [Write(source.data_ptr(), area.address, offset)], 30.0)
        applied = httpx.post(
            f"{engine.url}/p2pweights/apply_broadcast", json={"tensors": manifest}, timeout=60
        )
        assert applied.status_code == 200, applied.text
        client.end_weight_update()
        client.continue_generation()
    assert verify_engine(client, lambda: _weights(folder, seed=7)) == {0: [], 1: []}
    client.close()


def test_apply_broadcast_needs_an_open_update(model_dir, start_engines):
    (engine,) = start_engines(model_dir("qwen3-tiny"), [1])
    httpx.post(f"{engine.url}/p2pweights/broadcast_area", json={"num_bytes": 1024})
    answer = httpx.post(f"{engine.url}/p2pweights/apply_broadcast", json={"tensors": []})
    assert answer.status_code == 400
    assert "begin_weight_update" in answer.text
