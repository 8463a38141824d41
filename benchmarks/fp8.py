"""fp8 engines: the sender's block quantization cost, the fused kernel's launch settings,
and the fp8 replica against sglang's own fp8 code on a device.

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
    Case(
        "replica",
        "fp8_replica",
        "fp8 replica vs sglang's fp8 code on a device (bit-exact)",
        "gpu_fp8_replica",
    ),
]

if __name__ == "__main__":
    sys.exit(main(__file__, __doc__, CASES))
