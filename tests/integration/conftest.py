"""Shared fixtures for integration tests: model folders and local engines in their own processes.

``start_engines`` / ``start_module_engines``: engines of the test's (module's) own, stopped
after it; for tests that kill, freeze or restart an engine, or need its start weights.
``shared_engines``: engines from a pool for the whole run, keyed by what they were started
with, for tests whose first update resets what an earlier test left.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _procs import ForkedEngine

from p2pweights.engines.client import EngineClient
from p2pweights.engines.update_state import UPDATING_PREFIX
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
        self, folder: Path, tps: list, transport: str = "mooncake", *, wait: bool = True, **kwargs
    ) -> list[LocalEngine]:
        """``tps``: TP sizes, or (TP size, extra sglang server args) pairs. ``wait=False``:
        started, not waited for (the caller calls ``wait_ready()``, say after taking
        ``shared_engines``, so that the pool's engines start beside these)."""
        layouts = [tp if isinstance(tp, tuple) else (tp, {}) for tp in tps]
        engines = [
            ForkedEngine(folder, tp=tp, transport=transport, server_args=extra, **kwargs)
            for tp, extra in layouts
        ]
        self.started.extend(engines)
        for engine in engines:
            engine.start()
        for engine in engines if wait else []:
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


_Key = tuple[str, int, str, str, str, int]


class _EnginePool:
    """Local engines kept running across tests, one per (model folder, TP, extra server
    args, transport, start arguments).

    At most ``max_engines`` processes stay up (each holds about 1 GB and idles at no CPU);
    when one more is needed, the idle engine lent the fewest times is stopped (the least
    recently used of those), so the layouts many files use outlive one file's matrix of
    layouts used once. An engine is checked before it is handed out again: one that died,
    or was left paused, torn or with an update session open, is replaced by a fresh one.
    A test that failed does not give its engines back (they are stopped): it may have left
    a state the check cannot see.
    """

    def __init__(self, max_engines: int = 6) -> None:
        self.max_engines = max_engines
        self._idle: OrderedDict[_Key, LocalEngine] = OrderedDict()
        self._lent: dict[_Key, int] = {}  # times each key was lent, over the run

    def take(
        self, folder: Path, tps: list, transport: str, kwargs: dict
    ) -> list[tuple[_Key, LocalEngine]]:
        keys: list[_Key] = []
        for tp in tps:
            size, extra = tp if isinstance(tp, tuple) else (tp, {})
            base = (str(folder), size, json.dumps(extra, sort_keys=True), transport)
            base += (json.dumps(kwargs, sort_keys=True, default=str),)
            keys.append((*base, sum(k[:-1] == base for k in keys)))  # the same twice: two
        found: dict[_Key, LocalEngine] = {}
        for key in keys:
            engine = self._idle.pop(key, None)
            if engine is not None and _healthy(engine):
                found[key] = engine
            elif engine is not None:
                engine.stop()
        missing = [k for k in keys if k not in found]
        self._evict(len(keys))
        fresh = [
            ForkedEngine(
                folder, tp=k[1], transport=transport, server_args=json.loads(k[2]), **kwargs
            )
            for k in missing
        ]
        try:
            for engine in fresh:
                engine.start()
            for engine in fresh:
                engine.wait_ready()
        except BaseException:
            for engine in [*fresh, *found.values()]:
                engine.stop()
            raise
        _POOL_COUNTS["started"] += len(fresh)
        _POOL_COUNTS["reused"] += len(found)
        found.update(zip(missing, fresh, strict=True))
        for key in keys:
            self._lent[key] = self._lent.get(key, 0) + 1
        return [(k, found[k]) for k in keys]

    def give_back(self, lent: list[tuple[_Key, LocalEngine]], healthy: bool = True) -> None:
        """``healthy``: the test passed; otherwise its engines are stopped, not kept."""
        for key, engine in lent:
            if healthy:
                self._idle[key] = engine
            else:
                engine.stop()
        self._evict(0)

    def _evict(self, num_needed: int) -> None:
        while self._idle and len(self._idle) + num_needed > self.max_engines:
            # the fewest lends first, the least recently given back among those (the
            # OrderedDict's order; min keeps the first of equals)
            key = min(self._idle, key=lambda k: self._lent.get(k, 0))
            self._idle.pop(key).stop()

    def stop(self) -> None:
        while self._idle:
            self._idle.popitem()[1].stop()


_POOL_COUNTS = {"started": 0, "reused": 0}
"""Engines the pool started and lent again in this run, printed at the end (a pool that
stops reusing, say because ``_healthy`` turned strict, only shows as a slower suite)."""


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if any(_POOL_COUNTS.values()):
        terminalreporter.write_line(
            f"shared engines: {_POOL_COUNTS['started']} started, "
            f"{_POOL_COUNTS['reused']} lent again"
        )


def _healthy(engine: LocalEngine) -> bool:
    """Running, resumed, no update session open, and a version that is not a torn marker."""
    if engine._process is None or engine._process.poll() is not None:
        return False
    client = EngineClient(engine.url)
    try:
        state = client.server_info().get("p2pweights_engine_state")
        version = client.weight_version()
    except Exception:
        return False
    finally:
        client.close()
    running = state == {"paused": False, "update_open": False}
    return running and not version.startswith(UPDATING_PREFIX)


@pytest.fixture(scope="session")
def _engine_pool() -> Iterator[_EnginePool]:
    pool = _EnginePool()
    yield pool
    pool.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Each phase's report on the test item (``item.report_call``), for fixtures that
    tear down differently after a failure."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def shared_engines(
    _engine_pool: _EnginePool, request: pytest.FixtureRequest
) -> Iterator[Callable[..., list[LocalEngine]]]:
    """``shared_engines(folder, [2, 1], transport=..., seed=0)``: as ``start_engines``, but
    the engines come from a pool for the whole run. They may have served earlier tests (their
    weights and weight version are what those left: the first update resets the weights, and
    a session numbers its versions on from theirs) and may serve later ones. For tests that
    neither kill, freeze nor restart an engine, and that do not rely on its start weights.
    A test writes seeds no other test writes into engines of the same key: a bit-exact check
    after an update that wrote nothing would otherwise pass on an earlier test's bytes
    (``_bit_exact.engine_mismatches`` fails a check that finds the tensors another test last
    found on that engine)."""
    lent: list[tuple[_Key, LocalEngine]] = []

    def take(folder: Path, tps: list, transport: str = "mooncake", **kwargs) -> list[LocalEngine]:
        assert not lent, "one shared_engines call per test"
        # LocalEngine's default seed named, so that leaving it out keys the same engines
        lent.extend(_engine_pool.take(folder, tps, transport, {"seed": 0, **kwargs}))
        return [engine for _, engine in lent]

    yield take
    call = getattr(request.node, "report_call", None)
    _engine_pool.give_back(lent, healthy=call is not None and call.passed)
