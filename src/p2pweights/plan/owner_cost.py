"""Owner sends against gathered sends at cluster scale (``p2pweights plan --owners EP``).

Pure, from a ``ClusterPlan`` whose engine ranks know their routed-expert bytes
(``RankLoad.expert_bytes_by_stage``) and the trainer's expert bytes per stage:

- **gathered** (today's Megatron / FSDP2 path): before any byte moves, each expert-parallel
  group of ``ep`` trainer ranks all-gathers its experts, so every sending rank receives
  ``(ep - 1) / ep`` of its stage's expert bytes (over NVLink when the group fits in a node,
  else over its NIC) and holds them while they are sent; then the plan's update, as
  planned (each sender writes whole engine ranks). Counted one after the other: an
  exporter that streams buckets overlaps the two in part, so this is the pessimistic end.
- **owner**: nothing is gathered; each sender writes the non-expert bytes of the engine
  ranks it is assigned (as before), plus ``1 / ranks per stage`` of every engine rank's
  expert bytes (its own experts, written to every engine rank that holds them; where
  experts have data-parallel replicas, the holders split the engine ranks). Loader
  inputs and fp8 quantization are taken as the gathered plan's (an estimate).

Both are costed with the same link and pipeline models (``plan.cost``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from p2pweights.errors import ConfigError
from p2pweights.plan.cluster import ClusterPlan
from p2pweights.plan.cost import (
    GB,
    Bound,
    Prediction,
    ReceiverLoad,
    SenderLoad,
    p2p_lower_bound,
    predict,
)

__all__ = ["OwnerComparison", "compare_owner_sends"]


@dataclass(frozen=True)
class OwnerComparison:
    """One update sent by owners, and the same update gathered first."""

    ep: int
    gathered_bytes_per_rank: int
    """Bytes the busiest sending rank receives in the experts' all-gather (gathered)."""
    gather_s: float
    gather_link: str
    gathered_bound: Bound
    gathered: Prediction
    owner_bound: Bound
    owner: Prediction
    owner_write_bytes: int
    """Bytes the busiest owner writes."""
    gathered_write_bytes: int

    @property
    def gathered_s(self) -> float:
        return self.gather_s + self.gathered.seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "ep": self.ep,
            "gathered": {
                "gathered_bytes_per_rank": self.gathered_bytes_per_rank,
                "gather_s": self.gather_s,
                "gather_link": self.gather_link,
                "busiest_link": self.gathered_bound.link,
                "lower_bound_s": self.gathered_bound.seconds,
                "predicted_s": self.gathered_s,
                "busiest_sender_write_bytes": self.gathered_write_bytes,
            },
            "owner": {
                "gathered_bytes_per_rank": 0,
                "busiest_link": self.owner_bound.link,
                "lower_bound_s": self.owner_bound.seconds,
                "predicted_s": self.owner.seconds,
                "busiest_sender_write_bytes": self.owner_write_bytes,
            },
        }

    def render(self) -> str:
        gb = 1e9
        return "\n".join(
            [
                f"owner sends vs gathered sends (trainer expert parallelism {self.ep}):",
                f"  gathered: each rank receives {self.gathered_bytes_per_rank / gb:.2f} GB of "
                f"experts first ({self.gather_s:.3f} s over {self.gather_link}); busiest link "
                f"{self.gathered_bound.link} {self.gathered_bound.seconds:.3f} s; predicted "
                f"{self.gathered_s:.3f} s (gather + update)",
                f"  owner:    nothing gathered; busiest link {self.owner_bound.link} "
                f"{self.owner_bound.seconds:.3f} s ({self.owner_write_bytes / gb:.2f} GB out); "
                f"predicted {self.owner.seconds:.3f} s",
            ]
        )


def compare_owner_sends(
    plan: ClusterPlan, ep: int, trainer_expert_bytes_by_stage: Sequence[int]
) -> OwnerComparison:
    """Cost ``plan``'s update sent by owners and gathered first (module docstring)."""
    per_stage = len(plan.senders) // plan.num_stages
    if not 1 <= ep <= per_stage or per_stage % ep:
        raise ConfigError(
            f"--owners {ep}: the expert-parallel size must divide the {per_stage} sending "
            f"ranks of each pipeline stage"
        )
    if len(trainer_expert_bytes_by_stage) != plan.num_stages:
        raise ConfigError("trainer_expert_bytes_by_stage needs one entry per stage")
    ranks = {
        (e, r): rank for e, engine in enumerate(plan.engines) for r, rank in enumerate(engine.ranks)
    }
    layouts = {rank.layout_key: rank for rank in ranks.values()}
    owners: list[SenderLoad] = []
    for sender in plan.senders:
        stage = sender.stage
        assigned = [ranks[key] for key in sender.targets]
        distinct = {rank.layout_key: rank for rank in assigned}.values()
        write = sum(r.bytes_by_stage[stage] - r.expert_bytes(stage) for r in assigned)
        write += sum(r.expert_bytes(stage) for r in ranks.values()) // per_stage
        load = sum(r.bytes_by_stage[stage] - r.expert_bytes(stage) for r in distinct)
        load += sum(r.expert_bytes(stage) for r in layouts.values()) // per_stage
        owners.append(replace(sender.load, write_bytes=write, load_bytes=load))
    receivers = [
        ReceiverLoad(name=f"engine {e} rank {r}", num_bytes=rank.num_bytes)
        for (e, r), rank in ranks.items()
    ]
    links = plan.links
    received = max(trainer_expert_bytes_by_stage) * (ep - 1) // ep
    in_node = ep <= links.gpus_per_node
    rate = links.nvlink_gbps if in_node else links.nic_gbps
    gathered_loads = [s.load for s in plan.senders]
    return OwnerComparison(
        ep=ep,
        gathered_bytes_per_rank=received,
        gather_s=received / (rate * GB),
        gather_link="NVLink" if in_node else "the NIC",
        gathered_bound=plan.p2p_bound,
        gathered=plan.prediction,
        owner_bound=p2p_lower_bound(owners, receivers, links),
        owner=predict(owners, receivers, len(plan.engines), links, plan.pipeline),
        owner_write_bytes=max(s.write_bytes for s in owners),
        gathered_write_bytes=max(s.write_bytes for s in gathered_loads),
    )
