"""The processes integration tests start: trainers, and local engines forked warm.

Both come from one ``"forkserver"`` whose server imported torch, sglang and the local
engine's modules once (``PRELOAD``). Each trainer and each engine is still a process of its
own, forked from a bare interpreter that only imported modules (not from the test process,
so it inherits none of the test's state), instead of a new interpreter importing them anew:
that import is about 12 of the 13 s a local engine takes to start on a 2-core host, and
2-10 s of every trainer process.

Each child gets the test process's ``sys.path`` and working directory, as a spawned one
does, and, as a spawned one does, the test process's environment at the time it is started
(the server's own is that of whichever test started the first child: a variable one test
set must not reach another's processes). A ``ForkedEngine`` runs the very command line a
``LocalEngine`` would run (``p2pweights.cli.main`` with the same arguments), in a session
of its own, logging to the same file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

from p2pweights.local_engine import LocalEngine

PRELOAD = [
    "torch",
    "torch.distributed",
    "p2pweights.cli",
    "p2pweights.local_engine.serve",
    "sglang",
    "sglang.srt.configs.model_config",
    "sglang.srt.model_loader.loader",
    "sglang.srt.utils.weight_checker",
    "sglang.srt.models.qwen2",
    "sglang.srt.models.qwen3",
    "sglang.srt.models.qwen3_moe",
    "sglang.srt.models.deepseek_v2",
]
"""Imported once by the server (modules only: no thread, no device, no global state set)."""


def _with_env(env: Mapping[str, str], target: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    os.environ.clear()
    os.environ.update(env)
    return target(*args, **kwargs)


class _Context(ForkServerContext):
    def Process(  # type: ignore[override]
        self,
        group: None = None,
        target: Callable[..., Any] | None = None,
        name: str | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        daemon: bool | None = None,
    ) -> ForkServerProcess:
        if target is not None:
            args = (dict(os.environ), target, tuple(args), dict(kwargs or {}))
            target, kwargs = _with_env, None
        return ForkServerProcess(group, target, name, args, kwargs or {}, daemon=daemon)


def trainer_context() -> ForkServerContext:
    ctx = _Context()
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _serve(argv: list[str], log_path: str | None, env: Mapping[str, str]) -> None:
    """The engine's process: what ``python -m p2pweights.cli <argv>`` would do."""
    os.setsid()  # as start_new_session: a test may signal the engine's process group
    os.environ.update(env)
    if log_path is not None:
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    from p2pweights.cli import main

    sys.exit(main(argv))


class _Forked:
    """A forked engine process behind the calls ``LocalEngine`` makes of a ``Popen``."""

    def __init__(self, process: ForkServerProcess):
        self._process = process

    @property
    def pid(self) -> int:
        return int(self._process.pid or 0)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout or 0)
        return self._process.exitcode

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


class ForkedEngine(LocalEngine):
    """A ``LocalEngine`` whose process is forked from the warm server instead of started
    as a new interpreter; everything else (command line, readiness, logs, stop) is
    ``LocalEngine``'s own."""

    def start(self) -> ForkedEngine:
        argv = self.command()[3:]  # [python, -m, p2pweights.cli, engine, ...]
        log = None if self.log_path is None else str(self.log_path)
        process = trainer_context().Process(
            target=_serve, args=(argv, log, dict(self._env or {})), daemon=True
        )
        process.start()
        self._process = _Forked(process)  # type: ignore[assignment]
        return self
