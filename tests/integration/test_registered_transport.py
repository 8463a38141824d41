"""A transport registered by name (``p2pweights.transports.register_transport``) writes
into real local engines, bit-exact, as the built-ins do (issue 41 item 6)."""

from __future__ import annotations

import pytest
from _bit_exact import assert_bit_exact, seed_weights

from p2pweights import SyncConfig, WeightSyncSession
from p2pweights.transports import register_transport

pytestmark = pytest.mark.integration


def test_a_registered_transport_updates_engines_bit_exact(model_dir, shared_engines):
    register_transport(
        "loopback_rdma",
        config="_my_transport:LoopbackRdmaConfig",  # imported when first named
        transport="_my_transport:LoopbackRdmaTransport",
        publication="mooncake",  # it writes into engines that publish for Mooncake
        replace=True,
    )
    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [2, 1], transport="mooncake", seed=0)
    config = SyncConfig(transport={"kind": "loopback_rdma"}, buffer_bytes="1MiB")
    import _my_transport

    with WeightSyncSession(config) as session:
        session.connect([e.url for e in engines])
        report = session.update(seed_weights(folder, 417), version="mine-1")
    assert _my_transport.LoopbackRdmaTransport.built == 1
    assert {e.transport for e in report.engines.values()} == {"loopback_rdma"}
    assert_bit_exact(engines, folder, 417)
    assert report.bytes_written > 0
