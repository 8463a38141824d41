"""The processes integration tests start: trainers, and local engines forked warm.

Both come from one ``"forkserver"`` whose server imported torch, sglang and the local
engine's modules once (``ENGINE_PRELOAD``; on a GPU host torch alone). Each trainer and each
engine is still a process of its own, forked from a bare interpreter that only imported
modules (not from the test process, so it inherits none of the test's state), instead of a
new interpreter importing them anew:
that import is about 12 of the 13 s a local engine takes to start on a 2-core host, and
2-10 s of every trainer process.

Each child gets the test process's ``sys.path`` and working directory, as a spawned one
does, and, as a spawned one does, the test process's environment at the time it is started
(the server's own is that of whichever test started the first child: a variable one test
set must not reach another's processes). What the preloaded modules read at import is the
server's, though: sglang caches a few flags then (``is_cuda()``, ``is_cpu()``,
``SGLANG_USE_CPU_ENGINE``); a test that varies those per process starts its own. A
``ForkedEngine`` runs the very command line a ``LocalEngine`` would run
(``p2pweights.cli.main`` with the same arguments), in a session of its own, logging to the
same file.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import TYPE_CHECKING, Any

import torch

from p2pweights.local_engine import LocalEngine

if TYPE_CHECKING:
    from p2pweights import WeightSyncSession

PRELOAD = ["torch", "torch.distributed"]
ENGINE_PRELOAD = [
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
"""Imported once by the server, on a host without a GPU: modules only (no thread started,
no device used). sglang's model modules ask CUDA about the device at import (``is_cuda()``,
its compute capability), which on a GPU host would initialize CUDA in the server, and a
process forked from it could not use CUDA: there the server imports torch alone (engines
and trainers then import sglang themselves). The server imports by name from the default
path (Python 3.11's forkserver does not take the test's ``sys.path`` for its preloads),
silently skipping what it cannot import."""


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


@contextmanager
def gloo_session(
    rank: int, size: int, port: int, urls: list[str], **settings: Any
) -> Iterator[WeightSyncSession]:
    """In a trainer process: rank ``rank`` of a gloo group of ``size`` at ``port``, and a
    session of every rank (``from_torch_distributed``) connected to ``urls``, over
    Mooncake TCP with 1 MiB buffers unless ``settings`` (``SyncConfig``'s) say otherwise;
    the session is closed and the group destroyed on leaving."""
    import torch.distributed as dist

    from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    config = {"transport": MooncakeConfig(protocol="tcp"), "buffer_bytes": "1MiB", **settings}
    try:
        with WeightSyncSession.from_torch_distributed(SyncConfig(**config)) as session:
            session.connect(urls)
            yield session
    finally:
        dist.destroy_process_group()


def warm_context() -> ForkServerContext:
    """The context trainers and ``ForkedEngine``s are started from."""
    ctx = _Context()
    ctx.set_forkserver_preload(_preload())
    return ctx


@functools.cache
def _preload() -> list[str]:
    """What the server imports on this host (asked once per test process)."""
    # through NVML, which leaves CUDA uninitialized in this process and in the server
    # (started with this process's environment)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return PRELOAD if torch.cuda.is_available() else PRELOAD + ENGINE_PRELOAD


def _serve(argv: list[str], log_path: str, env: Mapping[str, str]) -> None:
    """The engine's process: what ``python -m p2pweights.cli <argv>`` would do."""
    os.setsid()  # as start_new_session: a test may signal the engine's process group
    os.environ.update(env)
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
        pid = self._process.pid
        assert pid is not None, "started before it is wrapped"
        return pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            assert timeout is not None  # join() without one returns only once it exited
            raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout)
        return self._process.exitcode

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


class ForkedEngine(LocalEngine):
    """A ``LocalEngine`` whose process is forked from the warm server instead of started
    as a new interpreter; everything else (command line, readiness, logs, stop) is
    ``LocalEngine``'s own.

    Unlike a new interpreter: the process is a daemon of multiprocessing's (it may not
    start processes of its own, and one a test leaves running is terminated when pytest
    exits, not waited for), it ends through ``os._exit`` (no atexit handlers), and its
    log is a file (``stream_log`` is refused: the server's stderr is not the caller's).
    """

    def start(self) -> ForkedEngine:
        command = self.command()
        assert command[:3] == [sys.executable, "-m", "p2pweights.cli"], command
        if self.log_path is None:
            raise ValueError("a ForkedEngine logs to a file: leave stream_log off")
        process = warm_context().Process(
            target=_serve,
            args=(command[3:], str(self.log_path), dict(self._env or {})),
            daemon=True,
        )
        process.start()
        self._process = _Forked(process)  # type: ignore[assignment]
        return self
