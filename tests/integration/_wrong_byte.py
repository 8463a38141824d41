"""One wrong byte written into an engine rank's parameter through the session's own
transport, right after an update's writes and before its checks (the weight checker's,
before ``end_weight_update``): what a write that landed wrong, or late, leaves there."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from p2pweights import WeightSyncSession
from p2pweights import update_attempt as update_attempt_module
from p2pweights.transports.base import Write


def write_byte(session: WeightSyncSession, url: str, rank: int, param: str, value: int) -> None:
    """Write ``value`` over the first byte of ``param`` on engine ``url`` rank ``rank``."""
    connection = session._connection
    assert connection.executor is not None
    transport = connection.executor.transport
    (target,) = [
        pub
        for pubs in connection.targets.values()
        for pub in pubs
        if pub.engine_url == url and pub.engine_rank == rank and pub.role == "target"
    ]
    region = target.regions[param]
    source = torch.full((64,), value, dtype=torch.uint8)  # registered whole; one byte sent
    transport.register(source)
    try:
        transport.write(target, [Write(source.data_ptr(), region.address, 1, region.gpu_id)], 60)
    finally:
        transport.unregister(source)


@contextmanager
def wrong_byte_after_writes(
    monkeypatch: pytest.MonkeyPatch,
    session: WeightSyncSession,
    url: str,
    rank: int,
    param: str,
    value: int,
) -> Iterator[None]:
    """Inside: the next update gets ``value`` over ``param``'s first byte once its writes
    landed, before the weight checker is asked (one-shot)."""
    checked = update_attempt_module.UpdateAttempt._verify_before_end
    done: list[bool] = []

    def corrupted(self, result):  # type: ignore[no-untyped-def]
        if not done:
            done.append(True)
            write_byte(session, url, rank, param, value)
        return checked(self, result)

    with monkeypatch.context() as patched:
        patched.setattr(update_attempt_module.UpdateAttempt, "_verify_before_end", corrupted)
        yield
    assert done, "the update never asked the weight checker"
