"""A stand-in for ``sgl_kernel`` on the lent GPU machine, for benchmarks only.

sglang imports ``sgl_kernel`` (its compiled CUDA kernels) at module import time on a
CUDA host, and the lent H200 image has no wheel of it. Weight loading never calls
these kernels, so this package lets the imports succeed and fails loudly if anything
calls one: every attribute is a function that records its name in ``CALLS`` and
raises. ``quantization`` and ``kvcacheio`` import as such stubs too (sglang imports
them unconditionally on CUDA); any other submodule raises ImportError, so sglang
takes its own fallback as if the package lacked it. Benchmarks report ``CALLS``
(it must stay empty) and put this folder on ``PYTHONPATH`` only on that machine.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STUB = True
CALLS: list[str] = []
ACCESSED: set[str] = set()
SUBMODULES = ("quantization", "kvcacheio")


def _stub_function(name: str) -> Any:
    def stub(*args: Any, **kwargs: Any) -> Any:
        CALLS.append(name)
        raise RuntimeError(f"sgl_kernel stub: {name} called")

    stub.__name__ = name.rsplit(".", 1)[-1]
    stub.__qualname__ = name
    return stub


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    ACCESSED.add(name)
    return _stub_function(name)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        ACCESSED.add(full)
        return _stub_function(full)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith("sgl_kernel."):
            if fullname.split(".", 1)[1] in SUBMODULES:
                return importlib.machinery.ModuleSpec(fullname, self)
            raise ImportError(f"{fullname} is not in the sgl_kernel stub")
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())
