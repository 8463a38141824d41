"""Progress bars for long steps, shown only on a terminal.

``with progress("connect: building replicas", total=3) as advance: ... advance(1)``
draws a tqdm bar on stderr when stderr is a terminal, and does nothing otherwise: not
when output goes to a file or a pipe (CI logs stay clean), not when the user turned it
off (``set_progress(False)``, or ``P2PWEIGHTS_PROGRESS=0``; see ``environment``), and
not when tqdm is not installed. Bars disappear when their step ends; what a step
cost is logged, not drawn. The library adds no logging handlers; this is its only
direct output.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from p2pweights.environment import progress_allowed

__all__ = ["progress", "progress_enabled", "set_progress"]

_forced: bool | None = None
_REDRAW_S = 0.5


def set_progress(enabled: bool | None) -> None:
    """Force progress bars on (``True``) or off (``False``) for this process; ``None``
    restores the default (on when the stream is a terminal)."""
    global _forced
    _forced = enabled


def progress_enabled(stream: IO[str] | None = None) -> bool:
    """Whether a bar would be drawn on ``stream`` (default: ``sys.stderr``)."""
    if _forced is not None:
        return _forced
    if not progress_allowed():
        return False
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _ignore(_amount: float = 1) -> None:
    pass


@contextmanager
def progress(
    description: str,
    total: float | None = None,
    *,
    unit: str = "it",
    unit_scale: bool = False,
    stream: IO[str] | None = None,
) -> Iterator[Callable[[float], None]]:
    """A bar for one step; yields ``advance(amount=1)``. ``total=None`` shows a counter
    and the elapsed time (for steps of unknown length)."""
    stream = sys.stderr if stream is None else stream
    if not progress_enabled(stream):
        yield _ignore
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield _ignore
        return
    bar: Any = tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=unit_scale,
        file=stream,
        leave=False,
        dynamic_ncols=True,
        mininterval=0.2,
        bar_format=None if total is not None else "{desc} ... {elapsed}",
    )
    done = threading.Event()
    # Redraw now and then, so the elapsed time moves while one long call runs.
    ticker = threading.Thread(target=_tick, args=(bar, done), name="p2pweights-progress")
    ticker.daemon = True
    ticker.start()
    try:
        yield bar.update
    finally:
        done.set()
        ticker.join()
        bar.close()


def _tick(bar: Any, done: threading.Event) -> None:
    while not done.wait(_REDRAW_S):
        bar.refresh()
