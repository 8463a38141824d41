"""``Collective.step`` on several trainer ranks (threads standing in for processes, an
all-reduce of success flags and an all-gather as the process group would do them):
an interrupt on one rank fails the step on every rank instead of leaving the others
blocked in the agreement (issue 39 item 5)."""

from __future__ import annotations

import threading

import pytest

from p2pweights.collective import Collective
from p2pweights.errors import P2PWeightsError, TransferError


class Group:
    """An all-reduce (AND) and an all-gather over ``size`` threads, each bounded by 10 s."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=10.0)
        self._values: dict[int, object] = {}

    def agree(self, rank: int):
        def agree(ok: bool) -> bool:
            self._values[rank] = ok
            self._barrier.wait()
            result = all(self._values[r] for r in range(self.size))
            self._barrier.wait()
            return result

        return agree

    def gather(self, rank: int):
        def gather(value: object) -> list[object]:
            self._values[rank] = value
            self._barrier.wait()
            result = [self._values[r] for r in range(self.size)]
            self._barrier.wait()
            return result

        return gather


def _run_ranks(actions, gather: bool):
    group = Group(len(actions))
    raised: dict[int, BaseException | None] = {}

    def rank(index: int) -> None:
        collective = Collective(
            f"trainer rank {index}",
            group.agree(index),
            group.gather(index) if gather else None,
        )
        try:
            collective.step("write", actions[index])
            raised[index] = None
        except BaseException as exc:  # what each rank raised is the result
            raised[index] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(actions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    return raised


def _interrupted() -> None:
    raise KeyboardInterrupt


def _preempted() -> None:
    raise SystemExit(143)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("interrupt", [_interrupted, _preempted])
def test_an_interrupt_on_one_rank_fails_the_step_on_every_rank(interrupt, gather):
    raised = _run_ranks([interrupt, lambda: None], gather)
    assert type(raised[0]) in (KeyboardInterrupt, SystemExit)  # re-raised as it was
    assert isinstance(raised[1], P2PWeightsError)  # not blocked until the group's timeout
    assert "trainer rank 0" in str(raised[1]) or "another trainer rank" in str(raised[1])
    assert not isinstance(raised[1], threading.BrokenBarrierError)


def test_an_agree_that_says_yes_for_a_failed_rank_still_raises_its_error():
    collective = Collective("trainer rank 0", agree=lambda ok: True)

    def fails() -> None:
        raise TransferError("engine http://e rank 0: write failed")

    with pytest.raises(TransferError, match="write failed"):
        collective.step("write", fails)


def test_a_gather_without_failures_after_a_failed_agree_raises_a_clear_error():
    collective = Collective("trainer rank 1", agree=lambda ok: False, gather=lambda m: [None])
    with pytest.raises(TransferError, match="'write' step"):
        collective.step("write", lambda: None)
