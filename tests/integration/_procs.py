"""The multiprocessing context integration tests start trainer processes with.

``"forkserver"`` with torch imported in the server: each trainer is still a process of its
own, forked from a bare interpreter that imported torch once (not from the test process,
so it inherits none of the test's state), instead of a spawned interpreter importing torch
anew (2-5 s a process on a 2-core host, several per test). Each child gets the test
process's ``sys.path`` and working directory, as a spawned one does, but the environment of
the server, which starts with the run's first trainer: pass what a trainer needs as
arguments, not through ``os.environ``.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import ForkServerContext

PRELOAD = ["torch", "torch.distributed"]


def trainer_context() -> ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
