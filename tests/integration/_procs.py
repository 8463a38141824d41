"""The multiprocessing context integration tests start trainer processes with.

``"forkserver"`` with torch imported in the server: each trainer is still a process of its
own, forked from a bare interpreter that imported torch once (not from the test process,
so it inherits none of the test's state), instead of a spawned interpreter importing torch
anew (2-5 s a process on a 2-core host, several per test). Each child gets the test
process's ``sys.path`` and working directory, as a spawned one does, and, as a spawned one
does, the test process's environment at the time it is started (the server's own is that
of whichever test started the first trainer: a variable one test set must not reach
another's trainers).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

PRELOAD = ["torch", "torch.distributed"]


def _with_env(env: Mapping[str, str], target: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    os.environ.clear()
    os.environ.update(env)
    return target(*args, **kwargs)


class _TrainerContext(ForkServerContext):
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
    ctx = _TrainerContext()
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
