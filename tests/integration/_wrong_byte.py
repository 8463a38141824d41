"""One wrong byte written into an engine rank's parameter through the session's own
transport, right after an update's writes and before its checks (the weight checker's,
before ``end_weight_update``): what a write that landed wrong, or late, leaves there."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
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


def fails_on_a_wrong_byte_then_converges(
    monkeypatch: pytest.MonkeyPatch,
    session: WeightSyncSession,
    url: str,
    weights: Callable[[int], Mapping[str, torch.Tensor]],
    seeds: tuple[int, int, int],
    param: str,
) -> str:
    """Three updates of ``session`` (connected to the engine at ``url``, verified through
    its weight checker), one per seed of ``seeds`` (``weights(seed)``): the first passes;
    the second, with one byte of ``param`` on rank 0 written wrong after its writes, fails
    naming engine, rank and parameter and leaves the engine paused and torn at that
    update's marker; after ``abort()``, which leaves it paused, the third passes. Returns
    the second's error message."""
    from p2pweights.engines.client import EngineClient
    from p2pweights.engines.update_state import UPDATING_PREFIX
    from p2pweights.errors import TransferError

    first, wrong_seed, last = seeds
    report = session.update(dict(weights(first)))
    assert report.engines[url].verified_by == ("weights_checker",)
    sent = dict(weights(wrong_seed))
    wrong = int(sent[param].reshape(-1).view(torch.uint8)[0]) ^ 0x01
    with (
        wrong_byte_after_writes(monkeypatch, session, url, 0, param, wrong),
        pytest.raises(TransferError) as failed,
    ):
        session.update(sent)
    message = str(failed.value)
    assert f"engine {url} rank 0" in message and param in message
    assert EngineClient(url).weight_version() == f"{UPDATING_PREFIX}2"
    assert session.abort().left_paused == [url]
    report = session.update(dict(weights(last)))
    assert report.engines[url].verified_by == ("weights_checker",)
    return message
