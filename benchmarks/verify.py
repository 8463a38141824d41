"""What verified writes cost: the same updates with verify_writes on and off, the write
digest's throughput, the digest kernel's variants, and the NaN / Inf input check's cost.

    .venv/bin/python benchmarks/verify.py digest --device cpu --layers 2
"""

import sys

from harness import Case, main

CASES = [
    Case(
        "cost",
        "verify_cost",
        "updates with SyncConfig.verify_writes on and off, alternated",
        "verify_cost",
    ),
    Case(
        "checker-real",
        "verify_checker_real",
        "a real sglang server on this CPU: /weights_checker, write digests and no check",
        "verify_checker_real_cpu",
    ),
    Case(
        "digest",
        "verify_digest",
        "the write digest's GB/s, whole and per staging batch",
        "digest_throughput",
    ),
    Case(
        "finite",
        "finite_cost",
        "the NaN / Inf input check's cost: alone, and updates with it off and on",
        "finite_cost",
    ),
    Case(
        "finite-gpu",
        "finite_gpu",
        "the NaN / Inf input check's GB/s on one GPU, bf16 and fp8",
        "finite_gpu",
        needs_cuda=True,
    ),
    Case(
        "digest-kernel",
        "verify_digest_kernel",
        "the digest kernel's shapes vs torch",
        "digest_kernel_variants",
        needs_cuda=True,
    ),
]

if __name__ == "__main__":
    sys.exit(main(__file__, __doc__, CASES))
