"""Running engine calls at once: on several engines, or independent calls to one engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from p2pweights.errors import EngineError, P2PWeightsError, UnsettledWrite

T = TypeVar("T")

__all__ = ["concurrently", "at_once"]


def concurrently(call: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
    """``call`` on every item at once; after all finished, raise naming every failure.

    The first item runs on the calling thread (one thread fewer to start), the others
    on a pool. Returns only once every call returned, also when interrupted (Ctrl-C),
    so no call still runs on an engine while the caller goes on (e.g. to ``abort()`` it).
    """
    if len(items) <= 1:
        return [call(item) for item in items]
    pool = ThreadPoolExecutor(min(len(items) - 1, 16))
    first: Future[T] = Future()
    try:
        futures = [pool.submit(call, item) for item in items[1:]]
        try:
            first.set_result(call(items[0]))
        except Exception as exc:
            first.set_exception(exc)
        wait(futures)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    everything = [first, *futures]
    errors = [e for e in (f.exception() for f in everything) if e is not None]
    if len(errors) == 1:
        raise errors[0]
    if errors:
        message = "; ".join(dict.fromkeys(str(e) for e in errors))  # each failure once
        raise _shared_class(errors)(message) from errors[0]
    return [f.result() for f in everything]


def at_once(*actions: Callable[[], object]) -> None:
    """Run independent calls at once (see ``concurrently``)."""
    concurrently(lambda action: action(), actions)


def _shared_class(errors: Sequence[BaseException]) -> type[P2PWeightsError]:
    """The most specific p2pweights error class every one of ``errors`` is (so a caller
    catching ``EngineStateError`` or ``EngineUnreachable`` still can), else
    ``EngineError``. Never ``UnsettledWrite``: one error cannot settle several writes."""
    for cls in type(errors[0]).__mro__:
        if cls is P2PWeightsError or not issubclass(cls, P2PWeightsError):
            break
        if cls is not UnsettledWrite and all(isinstance(e, cls) for e in errors):
            return cls
    return EngineError
