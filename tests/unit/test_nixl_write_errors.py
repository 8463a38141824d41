"""NIXL writes that fail release what they made, and a transfer still in progress at the
deadline is kept, not released (a fake agent: unit level only; real NIXL writes between
processes are tested in tests/integration/test_transports.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from p2pweights.errors import TransferError, UnsettledWrite
from p2pweights.transports.base import GivenUp, Write
from p2pweights.transports.nixl import NixlTransport, _RemoteAgent
from p2pweights.transports.regions import RegionIndex
from p2pweights.wire.publication import RankPublication, WeightRegion


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


class SlowAgent(RefusingAgent):
    """Starts transfers that stay in progress ("PROC") until a test sets ``state``; a
    release while one is in progress is a cancel NIXL cannot confirm."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "PROC"
        self.deregistered: list[object] = []
        self.released_in_progress = 0
        self.removed: list[str] = []

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return self.state

    def release_xfer_handle(self, handle):
        if self.state == "PROC":
            self.released_in_progress += 1
        super().release_xfer_handle(handle)

    def deregister_memory(self, descs):
        self.deregistered.append(descs)

    def remove_remote_agent(self, name):
        self.removed.append(name)


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
    transport._given_up = GivenUp("NIXL", "agent", "transfer")
    return transport


TARGET = RankPublication(
    "http://e:1",
    2,
    "nixl",
    {"w": WeightRegion(4096, 64, 0)},
    agent_name="engine_agent",
    agent_metadata=b"m",
)


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


def _late_write(agent: SlowAgent, staging: torch.Tensor) -> UnsettledWrite:
    transport = _transport(agent, staging)
    with pytest.raises(UnsettledWrite, match=r"engine http://e:1 rank 2 .*not done") as caught:
        transport.write(TARGET, [Write(staging.data_ptr(), 4096, 64, 0)], timeout_s=0.0)
    return caught.value


def test_a_transfer_in_progress_at_the_deadline_is_kept_until_nixl_reports_it_ended():
    """Releasing it would ask NIXL to cancel, and a successful release does not confirm
    that nothing lands (UCX's cancel cannot recall a posted put)."""
    staging = torch.zeros(64, dtype=torch.uint8)
    agent = SlowAgent()
    error = _late_write(agent, staging)
    assert agent.released == [] and not error.settle(0.0)
    agent.state = "DONE"
    assert error.settle(0.0)
    assert agent.released == agent.made and agent.released_in_progress == 0


def test_a_late_transfer_that_ends_in_error_settles_and_is_released():
    agent = SlowAgent()
    error = _late_write(agent, torch.zeros(64, dtype=torch.uint8))
    agent.state = "ERR"
    assert error.settle(0.0) and agent.released == agent.made


def test_the_buffer_and_agent_of_a_transfer_in_progress_are_never_released():
    staging = torch.zeros(64, dtype=torch.uint8)
    agent = SlowAgent()
    transport = _transport(agent, staging)
    transport._descs[staging.data_ptr()] = "descs"
    transport._registered.append("descs")
    with pytest.raises(UnsettledWrite):
        transport.write(TARGET, [Write(staging.data_ptr(), 4096, 64, 0)], timeout_s=0.0)
    transport.unregister(staging)
    transport.close()
    assert agent.deregistered == [] and agent.released == []


def test_a_transfer_that_ends_in_error_before_the_deadline_fails_plainly():
    staging = torch.zeros(64, dtype=torch.uint8)
    agent = SlowAgent()
    agent.state = "ERR"
    transport = _transport(agent, staging)
    with pytest.raises(TransferError, match=r"NIXL reported ERR") as caught:
        transport.write(TARGET, [Write(staging.data_ptr(), 4096, 64, 0)], timeout_s=5.0)
    assert not isinstance(caught.value, UnsettledWrite)
    assert agent.released == agent.made


def test_the_engine_agent_of_a_transfer_in_progress_stays_loaded_until_it_ended():
    """NIXL deletes a handle whose remote agent was removed: it could not be polled again."""
    staging = torch.zeros(64, dtype=torch.uint8)
    agent = SlowAgent()
    transport = _transport(agent, staging)
    with pytest.raises(UnsettledWrite) as caught:
        transport.write(TARGET, [Write(staging.data_ptr(), 4096, 64, 0)], timeout_s=0.0)
    transport.disconnect(TARGET)
    assert agent.removed == [] and transport.peers == {"engine_agent"}
    agent.state = "DONE"
    assert caught.value.settle(0.0)
    transport.disconnect(TARGET)
    assert agent.removed == ["engine_agent"] and transport.peers == frozenset()
