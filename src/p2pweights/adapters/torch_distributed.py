"""Trainer ranks that use torch.distributed: the ``agree`` and ``gather`` hooks of a session.

``WeightSyncSession.from_torch_distributed(config, group=...)`` builds both over one
group and fills in each rank's place among its pipeline stage's ranks
(``torch_stage_ranks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from p2pweights.errors import ConfigError

__all__ = ["stage_ranks", "torch_agree", "torch_gather", "torch_stage_ranks"]


def torch_agree(group: Any = None) -> Callable[[bool], bool]:
    """``agree(ok)``: True iff every rank of ``group`` passed True (an all-reduce MIN).

    Works on gloo (CPU) and NCCL (current CUDA device) groups.

    Args:
        group: The ``torch.distributed`` group of every sending trainer rank, of every
            pipeline stage (default: the whole world).

    Returns:
        The ``agree`` callable ``WeightSyncSession`` takes.
    """
    import torch.distributed as dist

    def agree(ok: bool) -> bool:
        on_gpu = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree


def torch_gather(group: Any = None) -> Callable[[object], list[object]]:
    """``gather(obj)``: every rank's ``obj`` in ``group`` rank order (``all_gather_object``).

    The session uses it at the first update (what each rank sends), when a step failed
    (each rank's error), and, under owner sends, to all-gather the slices of a sharded
    tensor its holders cannot write alone (``plan.owners``; CPU copies of the slices,
    one tensor at a time); otherwise never on the path of a successful later update.

    Args:
        group: The ``torch.distributed`` group of every sending trainer rank (default:
            the whole world).

    Returns:
        The ``gather`` callable ``WeightSyncSession`` takes.
    """
    import torch.distributed as dist

    def gather(obj: object) -> list[object]:
        out: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather


def stage_ranks(stages: Sequence[tuple[int, int]], index: int) -> tuple[int, int]:
    """(rank ``index``'s place among its stage's ranks, how many ranks each stage has).

    ``stages[i]``: rank ``i``'s (pipeline stage, number of stages). Ranks keep their
    order within a stage. Raises ``ConfigError`` unless all ranks agree on the number of
    stages and every stage has the same number of ranks.
    """
    num_stages = stages[index][1]
    counts = dict.fromkeys(range(num_stages), 0)
    for rank, (stage, total) in enumerate(stages):
        if total != num_stages or stage not in counts:
            raise ConfigError(
                f"rank {rank} of the group is pipeline stage {stage} of {total}, rank {index} "
                f"says there are {num_stages} stages; give every rank the same "
                f"num_pipeline_stages"
            )
        counts[stage] += 1
    if len(set(counts.values())) != 1:
        raise ConfigError(
            f"every pipeline stage needs the same number of sending ranks, got {counts} "
            f"(stage -> ranks)"
        )
    stage = stages[index][0]
    place = sum(1 for other, _ in stages[:index] if other == stage)
    return place, counts[stage]


def torch_stage_ranks(
    pipeline_stage: int, num_pipeline_stages: int, group: Any = None
) -> tuple[int, int]:
    """``stage_ranks`` for this rank of ``group`` (one all-gather over it)."""
    import torch.distributed as dist

    stages = torch_gather(group)((pipeline_stage, num_pipeline_stages))
    return stage_ranks(stages, dist.get_rank(group))  # type: ignore[arg-type]
