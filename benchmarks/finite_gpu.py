"""The NaN / Inf input check (``source.finite.check_finite``) on one GPU: GB/s over 8 GB
of bf16 and of fp8 in tensors of a 4096 x 14336 MLP matrix's size, and what that is of
writing the same bytes at 50 GB/s (one RDMA NIC) and 300 GB/s (NVLink device copies).
Needs only torch and this repository's src/::

    python3 benchmarks/finite_gpu.py

Not run yet (the GPU machine was not lent when it was written): the CPU numbers are
benchmarks/finite_cost.py's.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from p2pweights.source.finite import check_finite

SHAPE = (4096, 14336)


def main() -> None:
    device = torch.device("cuda:0")
    print(torch.cuda.get_device_name(0), torch.__version__)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        count = int(8e9 // (SHAPE[0] * SHAPE[1] * dtype.itemsize))
        tensors = [torch.randn(SHAPE, device=device).to(dtype) for _ in range(count)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        seconds = []
        for _ in range(4):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for index, tensor in enumerate(tensors):
                check_finite(f"t{index}", tensor)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        best = min(seconds[1:])
        print(
            f"{dtype}: {nbytes / 1e9:.2f} GB in {best * 1e3:.2f} ms = "
            f"{nbytes / best / 1e9:.0f} GB/s; "
            f"{100 * best / (nbytes / 50e9):.2f} % of writing them at 50 GB/s, "
            f"{100 * best / (nbytes / 300e9):.2f} % at 300 GB/s"
        )
        del tensors


if __name__ == "__main__":
    main()
