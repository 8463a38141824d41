"""fp8 engines: the sender's block quantization cost and the fused kernel's launch
settings.

    .venv/bin/python benchmarks/fp8.py convert --shapes 256x512 --devices cpu --repeats 2
"""

import sys

from harness import Case, main

CASES = [
    Case(
        "convert",
        "fp8_convert",
        "block quantization GB/s (torch and the fused kernel)",
        "fp8_convert",
    ),
    Case(
        "kernel",
        "fp8_kernel",
        "the fused fp8 kernel's launch settings",
        "fp8_kernel_variants",
        needs_cuda=True,
    ),
]

if __name__ == "__main__":
    sys.exit(main(__file__, __doc__, CASES))
