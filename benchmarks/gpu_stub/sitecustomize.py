"""On the lent GPU machine only: sglang's dual-GEMM decode kernel is not selected.

On CUDA, sglang's ``DualGemm`` (built in every Qwen2/Qwen3 MLP) imports its CuTe DSL
kernel module to decide whether small decode batches may use a fused gate/up GEMM;
that module needs ``cutlass`` (nvidia-cutlass-dsl), which the lent image lacks. The
choice only routes the forward pass and changes no weight, so when ``cutlass`` is
absent this hook makes ``DualGemm._select_mode`` return None (the unfused path, as
on any host without CUDA). Benchmarks record that it was applied.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

PATCHED: list[str] = []
_TARGET = "sglang.srt.layers.dual_gemm"


class _PatchDualGemm(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _TARGET or importlib.util.find_spec("cutlass") is not None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            module.DualGemm._select_mode = lambda self, *args, **kwargs: None
            PATCHED.append(f"{_TARGET}.DualGemm._select_mode -> None (no cutlass)")

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchDualGemm())
