"""Updates on GPUs (the lent H200 machines): full updates over CUDA IPC against the NCCL
broadcast they replace, and where to stage (device or pinned host memory, NIXL writes).
Both need a CUDA host; docs/benchmarks-archive.md ("Full updates on GPUs") has the
machine's set-up.

    PYTHONPATH=/tmp/site:benchmarks/gpu_stub:src python3 benchmarks/gpu.py update --help
"""

import sys

from harness import Case, main

CASES = [
    Case(
        "update",
        "gpu_update",
        "full updates vs NCCL broadcast, ceilings, colocated",
        "gpu_update",
        needs_cuda=True,
    ),
    Case(
        "real-colocated",
        "real_colocated",
        "a real sglang server on the trainer's GPU: paused_s vs update_weights_from_tensor",
        "real_colocated_gpu",
        needs_cuda=True,
    ),
    Case(
        "staging",
        "gpu_staging",
        "device vs pinned host staging into another process's GPU",
        "gpu_staging",
        needs_cuda=True,
    ),
]

if __name__ == "__main__":
    sys.exit(main(__file__, __doc__, CASES))
