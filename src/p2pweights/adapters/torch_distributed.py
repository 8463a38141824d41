"""Trainer ranks that use torch.distributed: the ``agree`` hook of a multi-rank session."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def torch_agree(group: Any = None) -> Callable[[bool], bool]:
    """``agree(ok)``: True iff every rank of ``group`` passed True (an all-reduce MIN).

    Give it the group of the sending trainer ranks (those holding the same gathered
    weights). Works on gloo (CPU) and NCCL (current CUDA device) groups.
    """
    import torch.distributed as dist

    def agree(ok: bool) -> bool:
        on_gpu = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree
