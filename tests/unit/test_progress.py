"""Progress bars: drawn only on a terminal, never when turned off."""

from __future__ import annotations

import io

import pytest

from p2pweights import progress as progress_module
from p2pweights.progress import progress, progress_enabled, set_progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _default_progress(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("P2PWEIGHTS_PROGRESS", raising=False)
    set_progress(None)
    yield
    set_progress(None)


def test_a_terminal_gets_a_bar_that_is_gone_afterwards() -> None:
    stream = _Terminal()
    with progress("building replicas", total=3, stream=stream) as advance:
        advance(1)
        advance(2)
    text = stream.getvalue()
    assert "building replicas" in text
    assert text.endswith("\r")  # leave=False: the bar is erased when the step ends


def test_a_step_of_unknown_length_shows_its_elapsed_time() -> None:
    stream = _Terminal()
    with progress("connecting", stream=stream):
        pass
    assert "connecting ... 00:00" in stream.getvalue()


@pytest.mark.parametrize(
    ("stream", "env", "forced", "drawn"),
    [
        (io.StringIO(), None, None, False),  # a file or a pipe
        (_Terminal(), None, None, True),
        (_Terminal(), "0", None, False),
        (_Terminal(), "1", False, False),
        (io.StringIO(), None, True, True),
    ],
)
def test_when_bars_are_drawn(
    monkeypatch: pytest.MonkeyPatch,
    stream: io.StringIO,
    env: str | None,
    forced: bool | None,
    drawn: bool,
) -> None:
    if env is not None:
        monkeypatch.setenv("P2PWEIGHTS_PROGRESS", env)
    set_progress(forced)
    assert progress_enabled(stream) is drawn
    with progress("step", total=1, stream=stream) as advance:
        advance(1)
    assert bool(stream.getvalue()) is drawn


def test_no_tqdm_no_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name: str, *args, **kwargs):
        if name == "tqdm":
            raise ImportError("no tqdm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    stream = _Terminal()
    with progress("step", total=1, stream=stream) as advance:
        advance(1)
    assert stream.getvalue() == ""
    assert progress_module.progress_enabled(stream)
