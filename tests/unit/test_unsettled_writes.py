"""A Mooncake write given up on at its deadline stays in flight until Mooncake says it
ended: its staging memory stays registered, and it settles only then (a fake engine
answering as the binding does: unit level only; real Mooncake writes between processes
are tested in tests/integration/test_transports.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from p2pweights.config import MooncakeConfig
from p2pweights.errors import TransferError, UnsettledWrite
from p2pweights.transports.base import GivenUp, Write
from p2pweights.transports.mooncake import MooncakeTransport
from p2pweights.transports.regions import RegionIndex
from p2pweights.wire.publication import RankPublication, WeightRegion

_PENDING, _DONE, _FAILED, _TIMED_OUT = 0, 1, -1, -2


class FakeMooncakeEngine:
    """``transfer_submit_write`` / ``transfer_check_status`` as the binding answers them:
    a batch reports ``status[id]`` (pending until a test says otherwise), and one that
    ended (done or failed) is freed, so asking about it again is an error."""

    def __init__(self) -> None:
        self.status: dict[int, int] = {}
        self.freed: set[int] = set()
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def get_rpc_port(self) -> int:
        return 15555

    def register_memory(self, address: int, num_bytes: int) -> int:
        self.registered.append(address)
        return 0

    def unregister_memory(self, address: int) -> int:
        self.unregistered.append(address)
        return 0

    def transfer_submit_write(self, session: str, src: int, dst: int, num_bytes: int) -> int:
        batch_id = 0x1000 + 8 * len(self.status)
        self.status[batch_id] = _PENDING
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        assert batch_id not in self.freed, "asked about a batch the binding freed"
        status = self.status[batch_id]
        if status in (_DONE, _FAILED):
            self.freed.add(batch_id)
        return status

    def end_all(self, status: int = _DONE) -> None:
        for batch_id in self.status:
            if batch_id not in self.freed:
                self.status[batch_id] = status


def _transport(engine: FakeMooncakeEngine) -> MooncakeTransport:
    transport = MooncakeTransport.__new__(MooncakeTransport)  # the fake stands in for the binding
    transport._config = MooncakeConfig()
    transport._engine = engine
    transport._lock = threading.Lock()
    transport._registered = []
    transport._local = RegionIndex([])
    transport._peers = set()
    transport._given_up = GivenUp("Mooncake", "engine", "write")
    return transport


TARGET = RankPublication(
    "http://e:1", 1, "mooncake", {"w": WeightRegion(4096, 128)}, session_id="10.0.0.2:17000"
)


def _late_write(engine: FakeMooncakeEngine, staging: torch.Tensor) -> UnsettledWrite:
    transport = _transport(engine)
    transport.register(staging)
    writes = [Write(staging.data_ptr(), 4096, 64), Write(staging.data_ptr() + 64, 4160, 64)]
    with pytest.raises(UnsettledWrite) as caught:
        transport.write(TARGET, writes, timeout_s=0.0)
    return caught.value


def test_a_batch_still_pending_at_the_deadline_is_unsettled_until_mooncake_says_it_ended():
    engine = FakeMooncakeEngine()
    staging = torch.zeros(128, dtype=torch.uint8)
    error = _late_write(engine, staging)
    assert isinstance(error, TransferError)  # the update fails as for any failed write
    assert "engine http://e:1 rank 1" in str(error) and "may land later" in str(error)
    assert not error.settle(0.0) and not engine.freed
    engine.end_all(_DONE)
    assert error.settle(0.0) and engine.freed == set(engine.status)
    assert error.settle(0.0)  # settled once: the freed batches are not asked again


def test_a_failed_batch_settles_too_it_will_not_land():
    engine = FakeMooncakeEngine()
    error = _late_write(engine, torch.zeros(128, dtype=torch.uint8))
    engine.end_all(_FAILED)
    assert error.settle(0.0)


def test_mooncakes_own_timed_out_status_is_no_verdict_the_batch_may_still_land():
    engine = FakeMooncakeEngine()
    staging = torch.zeros(128, dtype=torch.uint8)
    transport = _transport(engine)
    transport.register(staging)
    engine.transfer_submit_write = _submitting_as(engine, _TIMED_OUT)  # type: ignore[method-assign]
    with pytest.raises(UnsettledWrite, match=r"Mooncake reports it timed out") as caught:
        transport.write(TARGET, [Write(staging.data_ptr(), 4096, 64)], timeout_s=0.0)
    assert not caught.value.settle(0.0)
    engine.end_all(_DONE)
    assert caught.value.settle(0.0)


def _submitting_as(engine: FakeMooncakeEngine, status: int):
    submit = engine.transfer_submit_write

    def submitted(session: str, src: int, dst: int, num_bytes: int) -> int:
        batch_id = submit(session, src, dst, num_bytes)
        engine.status[batch_id] = status
        return batch_id

    return submitted


def test_a_buffer_an_unsettled_batch_reads_stays_registered_until_it_settled():
    engine = FakeMooncakeEngine()
    staging = torch.zeros(128, dtype=torch.uint8)
    transport = _transport(engine)
    transport.register(staging)
    with pytest.raises(UnsettledWrite) as caught:
        transport.write(TARGET, [Write(staging.data_ptr(), 4096, 64)], timeout_s=0.0)
    transport.unregister(staging)
    assert engine.unregistered == []  # Mooncake still reads it
    engine.end_all(_DONE)
    assert caught.value.settle(0.0)
    transport.unregister(staging)
    assert engine.unregistered == [staging.data_ptr()]


def test_closing_with_a_batch_in_flight_keeps_the_engine_and_its_memory():
    engine = FakeMooncakeEngine()
    staging = torch.zeros(128, dtype=torch.uint8)
    transport = _transport(engine)
    transport.register(staging)
    with pytest.raises(UnsettledWrite):
        transport.write(TARGET, [Write(staging.data_ptr(), 4096, 64)], timeout_s=0.0)
    transport.close()
    assert engine.unregistered == []


def test_a_write_whose_batches_all_ended_fails_plainly():
    engine = FakeMooncakeEngine()
    staging = torch.zeros(128, dtype=torch.uint8)
    transport = _transport(engine)
    transport.register(staging)
    engine.transfer_submit_write = _submitting_as(engine, _FAILED)  # type: ignore[method-assign]
    with pytest.raises(TransferError, match=r"engine http://e:1 rank 1 .*failed") as caught:
        transport.write(TARGET, [Write(staging.data_ptr(), 4096, 64)], timeout_s=5.0)
    assert not isinstance(caught.value, UnsettledWrite)
    transport.close()
    assert engine.unregistered == [staging.data_ptr()]


def test_device_copies_given_up_on_settle_once_their_event_fired():
    from p2pweights.transports.cuda_ipc import PendingCopies

    class Event:
        fired = False

        def query(self) -> bool:
            return self.fired

    event = Event()
    error = UnsettledWrite("copies still running", PendingCopies(event, [(0x1000, 64)]).settle)
    assert not error.settle(0.0)
    event.fired = True
    assert error.settle(0.0)


# -- a binding that raises mid-batch (issue 39 item 3) ------------------------------------------


def test_mooncake_submit_raising_mid_batch_keeps_what_it_already_started_in_flight():
    engine = FakeMooncakeEngine()
    staging = torch.zeros(128, dtype=torch.uint8)
    transport = _transport(engine)
    transport.register(staging)
    submit = engine.transfer_submit_write

    def second_raises(session: str, src: int, dst: int, num_bytes: int) -> int:
        if engine.status:
            raise RuntimeError("binding error")
        return submit(session, src, dst, num_bytes)

    engine.transfer_submit_write = second_raises  # type: ignore[method-assign]
    writes = [Write(staging.data_ptr(), 4096, 64), Write(staging.data_ptr() + 64, 4160, 64)]
    with pytest.raises(UnsettledWrite, match=r"binding error") as caught:
        transport.write(TARGET, writes, timeout_s=5.0)
    assert "engine http://e:1 rank 1" in str(caught.value)
    assert not caught.value.settled and not caught.value.settle(0.0)  # the first may land
    transport.close()
    assert engine.unregistered == []  # its staging memory stays registered
    engine.end_all(_DONE)
    assert caught.value.settle(0.0)


def test_mooncake_status_raising_while_polling_leaves_the_write_unsettled():
    engine = FakeMooncakeEngine()
    staging = torch.zeros(128, dtype=torch.uint8)
    transport = _transport(engine)
    transport.register(staging)
    check = engine.transfer_check_status
    broken = {"yes": True}

    def raises_once(batch_id: int) -> int:
        if broken.pop("yes", False):
            raise RuntimeError("status binding error")
        return check(batch_id)

    engine.transfer_check_status = raises_once  # type: ignore[method-assign]
    with pytest.raises(UnsettledWrite, match=r"status binding error") as caught:
        transport.write(TARGET, [Write(staging.data_ptr(), 4096, 64)], timeout_s=5.0)
    assert not caught.value.settle(0.0)
    engine.end_all(_DONE)
    assert caught.value.settle(0.0)


def test_cuda_ipc_copy_raising_mid_batch_keeps_the_copies_it_issued_in_flight(monkeypatch):
    from p2pweights.transports import cuda_ipc

    class Event:
        fired = False

        def record(self, stream) -> None:
            pass

        def query(self) -> bool:
            return self.fired

    events: list[Event] = []

    def new_event() -> Event:
        events.append(Event())
        return events[-1]

    class Runtime:
        issued: list[int] = []

        def copy_async(self, dst: int, src: int, num_bytes: int, stream: object) -> None:
            if self.issued:
                raise RuntimeError("cudaMemcpyAsync failed")
            self.issued.append(dst)

        def on_device(self, device: int):
            import contextlib

            return contextlib.nullcontext()

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(cuda_ipc.torch.cuda, "Event", new_event)
    copies = [cuda_ipc.Write(0x1000, 0x9000, 64), cuda_ipc.Write(0x2000, 0xA000, 64)]
    monkeypatch.setattr(cuda_ipc, "translate", lambda target, opened, sources, w: w)
    monkeypatch.setattr(cuda_ipc, "merge_adjacent", lambda writes: list(writes))
    transport = cuda_ipc.CudaIpcTransport.__new__(cuda_ipc.CudaIpcTransport)
    transport._cuda = Runtime()  # type: ignore[assignment]
    transport._device = 0
    transport._lock = threading.Lock()
    transport._pending = {}
    transport._sources = cuda_ipc.RegisteredRegions()
    transport._opened = {TARGET.peer: object()}  # type: ignore[dict-item]
    transport._stream = lambda: Stream()  # type: ignore[method-assign]
    with pytest.raises(UnsettledWrite, match=r"cudaMemcpyAsync failed") as caught:
        transport.write(TARGET, copies, timeout_s=5.0)
    assert not caught.value.settle(0.0)  # the first copy still runs
    assert transport._pending[TARGET.peer] is events[-1]  # waited for before memory goes
    events[-1].fired = True
    assert caught.value.settle(0.0)


# -- a failure reported as settled (issue 39 item 6) --------------------------------------------


def test_an_unsettled_write_rebuilt_from_its_message_is_never_reported_settled():
    rebuilt = UnsettledWrite("engine http://e:1 rank 1: may land later")  # as another rank's
    assert not rebuilt.settled
    assert not rebuilt.settle(0.0)
