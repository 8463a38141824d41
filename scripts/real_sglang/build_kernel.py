"""Build sglang's CPU kernels (the ``sgl_kernel.common_ops`` extension) with setuptools.

Upstream builds them with CMake, whose ``find_package(Torch)`` refuses a CUDA build of
torch on a host without the CUDA toolkit (PyPI's torch 2.14.1 is a CUDA 13 build). The
sources and compile flags are upstream's (``csrc/cpu/CMakeLists.txt``, x86_64): the
AMX and AVX-512 code paths are compiled whatever this CPU has, and sglang picks one at
run time. Run by scripts/real-sglang.sh as
``SGL_AOT_DIR=<aot> python build_kernel.py build_ext -b <out>``.
"""

from __future__ import annotations

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

AOT = os.environ["SGL_AOT_DIR"]
CPU = os.path.join(AOT, "csrc", "cpu")
# Other architectures' folders and upstream's micro-benchmarks are not part of the x86 build.
SKIP = {"aarch64", "ppc64", "ppc64le", "riscv64", "benchmark"}

sources = sorted(
    path
    for path in glob.glob(os.path.join(CPU, "**", "*.cpp"), recursive=True)
    if os.path.relpath(path, CPU).split(os.sep)[0] not in SKIP
)
print(f"build_kernel: {len(sources)} sources from {CPU}")

setup(
    name="sgl_kernel_cpu_p2pweights_test",
    ext_modules=[
        CppExtension(
            name="sgl_kernel.common_ops",
            sources=sources,
            include_dirs=[CPU, os.path.join(AOT, "csrc"), os.path.join(AOT, "include")],
            define_macros=[("SGLANG_CPU_FP8_CVT_FTZ", None)],
            extra_compile_args=[
                "-O3",
                "-Wno-unknown-pragmas",
                "-march=x86-64-v4",
                "-mavx512bf16",
                "-mavx512vnni",
                "-mamx-tile",
                "-mamx-bf16",
                "-mamx-int8",
                "-fopenmp",
            ],
            extra_link_args=["-fopenmp"],
            libraries=["numa"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
