"""Several sending trainer ranks ask each engine's ``/weights_checker`` once, not once each.

The checker hashes every weight of the engine (inside its pause) on each call. With a
gather between the ranks, the lowest rank that wrote an engine asks it and hands the
answer to the others; each rank still compares what it wrote itself, so a mismatch is
named by the rank that wrote the wrong engine rank. Without a gather each rank asks.
The ranks are threads here, the gather a barrier over a shared list.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from p2pweights.verification.checker import CheckerShare, CheckerTarget, check
from p2pweights.wire.publication import Runner

URLS = ("http://a", "http://b")
HELD = {  # what each engine's two TP ranks hold: parameter -> checksum
    url: [{"w": f"{url}-w{rank}", "b": f"{url}-b{rank}"} for rank in range(2)] for url in URLS
}


class CountingClient:
    """An engine's client whose weight checker answers ``HELD`` as sglang 0.5.23 does and
    counts the checksum calls."""

    def __init__(self, url: str, calls: Counter[str]) -> None:
        self.url, self.calls = url, calls
        self.lock = threading.Lock()

    def weights_checker(self, action: str, **options: object) -> dict:
        assert action == "checksum"
        with self.lock:
            self.calls[self.url] += 1
        ranks = [
            {"checksums": sums, "parallelism_info": [{"tp_rank": rank, "role": "target"}]}
            for rank, sums in enumerate(HELD[self.url])
        ]
        return {"success": True, "ranks": ranks}


def _targets(calls: Counter[str]) -> dict[str, CheckerTarget]:
    engines = {
        url: type("E", (), {"url": url, "client": CountingClient(url, calls)})() for url in URLS
    }
    return {url: CheckerTarget(engine, "cpu") for url, engine in engines.items()}  # type: ignore[arg-type]


def _all_gather(size: int) -> Callable[[int], Callable[[object], list[object]]]:
    """``gather_for(rank)``: an all-gather among ``size`` threads, in rank order."""
    slots: list[object] = [None] * size
    barrier = threading.Barrier(size, timeout=10)

    def gather_for(rank: int) -> Callable[[object], list[object]]:
        def gather(own: object) -> list[object]:
            slots[rank] = own
            barrier.wait()
            everyone = list(slots)
            barrier.wait()  # nobody overwrites a slot before all have read them
            return everyone

        return gather

    return gather_for


def _staged(url: str, rank: int, wrong: str | None = None) -> dict[Runner, dict[str, str]]:
    held = dict(HELD[url][rank])
    if wrong is not None:
        held[wrong] = "not what the engine holds"
    return {Runner(url, rank, "target"): held}


def _run_ranks(
    staged: list[dict[Runner, dict[str, str]]], shared: bool
) -> tuple[Counter[str], list[list[tuple[Runner, str]]]]:
    """Each rank's ``check`` of its own ``staged``, all at once; the checker calls per
    engine and each rank's problems."""
    calls: Counter[str] = Counter()
    targets = _targets(calls)
    gather_for = _all_gather(len(staged))
    found: list[list[tuple[Runner, str]]] = [[] for _ in staged]

    def rank(me: int) -> None:
        share = CheckerShare(gather_for(me), (0, me)) if shared else None
        found[me] = check(targets, staged[me], share)

    _in_threads(rank, len(staged))
    return calls, found


def _in_threads(rank: Callable[[int], None], size: int) -> list[BaseException | None]:
    """Run ``rank(me)`` for every rank at once; what each raised (None: returned). Every
    thread must finish: one left waiting in a gather is a hang the test reports."""
    raised: list[BaseException | None] = [None] * size

    def run(me: int) -> None:
        try:
            rank(me)
        except BaseException as exc:  # the test inspects it
            raised[me] = exc

    threads = [threading.Thread(target=run, args=(me,)) for me in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(thread.is_alive() for thread in threads), "a rank is left waiting"
    return raised


def test_two_ranks_writing_the_same_engines_ask_each_checker_once():
    # rank 0 wrote engine rank 0 of both engines, rank 1 engine rank 1
    staged = [
        {**_staged("http://a", 0), **_staged("http://b", 0)},
        {**_staged("http://a", 1), **_staged("http://b", 1)},
    ]
    calls, found = _run_ranks(staged, shared=True)
    assert calls == {"http://a": 1, "http://b": 1}
    assert found == [[], []]


def test_without_a_gather_every_rank_asks():
    staged = [_staged("http://a", 0), _staged("http://a", 1)]
    calls, found = _run_ranks(staged, shared=False)
    assert calls == {"http://a": 2} and found == [[], []]


def test_an_engine_one_rank_wrote_is_asked_by_that_rank_only():
    # rank 1 wrote engine b alone, and no rank 0 answer covers it: rank 1 asks b
    staged = [_staged("http://a", 0), {**_staged("http://a", 1), **_staged("http://b", 0)}]
    calls, found = _run_ranks(staged, shared=True)
    assert calls == {"http://a": 1, "http://b": 1} and found == [[], []]


def test_a_wrong_parameter_is_named_by_the_rank_that_wrote_it_from_the_shared_answer():
    staged = [_staged("http://a", 0), _staged("http://a", 1, wrong="w")]
    calls, found = _run_ranks(staged, shared=True)
    assert calls == {"http://a": 1}  # rank 0 asked; rank 1 compared rank 0's answer
    assert found[0] == []
    ((runner, problem),) = found[1]
    assert runner == ("http://a", 1, "target") and "1 of 2" in problem and "'w'" in problem


def test_an_idle_rank_takes_part_and_asks_nothing():
    staged = [{}, _staged("http://a", 1)]
    calls, found = _run_ranks(staged, shared=True)
    assert calls == {"http://a": 1} and found == [[], []]


def test_a_checker_that_cannot_answer_fails_every_rank_that_wrote_it():
    calls: Counter[str] = Counter()
    targets = _targets(calls)
    broken = targets["http://a"].engine.client

    def refuse(action: str, **options: object) -> dict:
        broken.weights_checker_calls = getattr(broken, "weights_checker_calls", 0) + 1
        raise RuntimeError("connection reset")

    broken.weights_checker = refuse  # type: ignore[method-assign]
    gather_for = _all_gather(2)
    found: list[list[tuple[Runner, str]]] = [[], []]

    def rank(me: int) -> None:
        found[me] = check(targets, _staged("http://a", me), CheckerShare(gather_for(me), (0, me)))

    assert _in_threads(rank, 2) == [None, None]
    assert broken.weights_checker_calls == 1  # asked once; the others were not left waiting
    for me in range(2):
        ((runner, problem),) = found[me]
        assert runner == ("http://a", me, "target")
        assert "checksum could not be read" in problem and "connection reset" in problem


def test_an_interrupted_asker_shares_the_failure_then_re_raises():
    """Ctrl-C (or a preemption's SystemExit) on the rank asking the checker: the other
    rank still gets an answer from the second gather instead of waiting there, and the
    interrupted rank raises the interrupt itself once the gather is done."""
    calls: Counter[str] = Counter()
    targets = _targets(calls)
    client = targets["http://a"].engine.client

    def interrupted(action: str, **options: object) -> dict:
        raise KeyboardInterrupt

    client.weights_checker = interrupted  # type: ignore[method-assign]
    gather_for = _all_gather(2)
    found: list[list[tuple[Runner, str]]] = [[], []]

    def rank(me: int) -> None:
        found[me] = check(targets, _staged("http://a", me), CheckerShare(gather_for(me), (0, me)))

    raised = _in_threads(rank, 2)
    assert isinstance(raised[0], KeyboardInterrupt) and raised[1] is None
    ((runner, problem),) = found[1]
    assert runner == ("http://a", 1, "target") and "KeyboardInterrupt" in problem


def test_one_engine_failing_its_call_names_only_that_engine():
    """A checker call that fails with an unexpected error is that engine's answer; the
    other engine this rank asked is compared as usual."""
    calls: Counter[str] = Counter()
    targets = _targets(calls)

    def broken(action: str, **options: object) -> dict:
        raise RuntimeError("connection reset")

    targets["http://b"].engine.client.weights_checker = broken  # type: ignore[method-assign]
    staged = {**_staged("http://a", 0), **_staged("http://b", 0)}
    ((runner, problem),) = check(targets, staged)
    assert runner == ("http://b", 0, "target") and "connection reset" in problem
