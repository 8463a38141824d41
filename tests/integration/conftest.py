"""Shared fixtures for integration tests: model folders and local engines in their own processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from p2pweights.local_engine import LocalEngine
from p2pweights.testing import write_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``model_dir("qwen3-tiny")``: a folder holding that shipped config.json (made once)."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            made[name] = write_model_dir(name, tmp_path_factory.mktemp(name))
        return made[name]

    return make


class _Engines:
    """Starts local engines concurrently and stops every one it started."""

    def __init__(self) -> None:
        self.started: list[LocalEngine] = []

    def __call__(
        self, folder: Path, tps: list, transport: str = "mooncake", **kwargs
    ) -> list[LocalEngine]:
        """``tps``: TP sizes, or (TP size, extra sglang server args) pairs."""
        layouts = [tp if isinstance(tp, tuple) else (tp, {}) for tp in tps]
        engines = [
            LocalEngine(folder, tp=tp, transport=transport, server_args=extra, **kwargs)
            for tp, extra in layouts
        ]
        self.started.extend(engines)
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        return engines

    def stop(self) -> None:
        for engine in self.started:
            engine.stop()


@pytest.fixture
def start_engines() -> Iterator[_Engines]:
    """``start_engines(folder, [2, 1], transport=...)``: engines stopped after the test."""
    engines = _Engines()
    yield engines
    engines.stop()


@pytest.fixture(scope="module")
def start_module_engines() -> Iterator[_Engines]:
    """Like ``start_engines``, but the engines live until the end of the module."""
    engines = _Engines()
    yield engines
    engines.stop()
