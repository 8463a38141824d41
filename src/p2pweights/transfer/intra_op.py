"""Host-side loads on one intra-op thread, for the calling thread only.

The loaders' work on the host is mostly large ``copy_``s, which torch splits over its
intra-op threads and joins at a barrier; when a writer thread or another process holds
a core, every copy waits for it. Measured on the 2-core machine (benchmarks/footprint.py cpu-cost,
1 GB into a TP-2 engine): the load stage took 1-4 s with two threads while using
0.2-0.4 CPU-s, and 0.055-0.07 s with one.

``torch.set_num_threads`` would do it for the whole process: it also sets MKL's global
count and the default every thread started meanwhile keeps for good. torch's CPU
kernels run on OpenMP, whose thread count is a per-thread setting, so
``one_intra_op_thread`` sets it for the calling thread alone and restores it after.
Where torch is not built with OpenMP (or its runtime cannot be found), nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["one_intra_op_thread"]


@functools.cache
def _openmp() -> Any | None:
    """The OpenMP runtime torch runs on, if its symbols are reachable in this process."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        runtime = ctypes.CDLL(None)
        runtime.omp_get_max_threads.restype = ctypes.c_int
        runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        logger.debug("OpenMP runtime not reachable; host loads keep torch's thread count")
        return None
    return runtime


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Inside, torch's CPU ops called from this thread run on one thread; other
    threads, and this one afterwards, keep their own counts."""
    runtime = _openmp()
    if runtime is None:
        yield
        return
    torch.get_num_threads()  # torch sets a thread's count once, on first use: not inside
    before = runtime.omp_get_max_threads()
    runtime.omp_set_num_threads(1)
    try:
        yield
    finally:
        runtime.omp_set_num_threads(before)
