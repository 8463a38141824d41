"""NIXL writes that fail release what they made (a fake agent: unit level only; real NIXL
writes between processes are tested in tests/integration/test_transports.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from p2pweights.engines.published import RankPublication, WeightRegion
from p2pweights.errors import TransferError
from p2pweights.transfer.transports.base import Write
from p2pweights.transfer.transports.nixl import NixlTransport, _RemoteAgent
from p2pweights.transfer.transports.regions import RegionIndex


class RefusingAgent:
    """Makes transfer handles, then refuses to start them (as a dead peer makes NIXL do)."""

    name = "p2pweights_trainer_test"

    def __init__(self) -> None:
        self.made: list[object] = []
        self.released: list[object] = []

    def get_xfer_descs(self, descs, mem_type):
        return (tuple(descs), mem_type)

    def initialize_xfer(self, op, local, remote, peer):
        handle = object()
        self.made.append(handle)
        return handle

    def transfer(self, handle):
        raise RuntimeError("nixlRemoteDisconnectError (injected)")

    def release_xfer_handle(self, handle):
        self.released.append(handle)


def _transport(agent: RefusingAgent, staging: torch.Tensor) -> NixlTransport:
    transport = NixlTransport.__new__(NixlTransport)  # no real agent: the fake stands in
    transport._agent = agent
    transport._lock = threading.Lock()
    address, num_bytes = staging.data_ptr(), staging.numel()
    transport._local = {"DRAM": [(address, num_bytes)]}
    transport._local_index = {"DRAM": RegionIndex([(address, num_bytes)])}
    transport._local_device = {address: 0}
    transport._descs, transport._registered = {}, []
    transport._remote = {"engine_agent": _RemoteAgent("DRAM", {0: RegionIndex([(4096, 64)])})}
    return transport


def test_a_refused_transfer_releases_its_handle_and_fails_naming_the_engine() -> None:
    staging = torch.zeros(64, dtype=torch.uint8)
    agent = RefusingAgent()
    transport = _transport(agent, staging)
    target = RankPublication(
        "http://e:1",
        2,
        "nixl",
        {"w": WeightRegion(4096, 64, 0)},
        agent_name="engine_agent",
        agent_metadata=b"m",
    )
    with pytest.raises(TransferError, match=r"engine http://e:1 rank 2 .*refused the transfer"):
        transport.write(target, [Write(staging.data_ptr(), 4096, 64, 0)], timeout_s=1.0)
    assert agent.made and agent.released == agent.made
