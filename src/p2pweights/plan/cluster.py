"""One update at cluster scale: who writes what, how many bytes, and how long it must take.

Pure: built from what each engine rank holds (``EngineLoad``: bytes per rank, split by
the trainer's pipeline stages, from the replicas), the number of sending trainer ranks
and stages, and the cost models of ``plan.cost``. The assignment is the session's
(``plan.assignment``, on the bytes of whole ranks, the same in every stage); each
stage's senders write that stage's bytes to every engine rank.

A broadcast of the same update brings every engine GPU the whole update in the
engine's checkpoint format (``broadcast_bytes_by_stage``), whatever its shard.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from p2pweights.errors import ConfigError
from p2pweights.plan.assignment import Target, assign_targets
from p2pweights.plan.cost import (
    GB,
    Bound,
    LinkModel,
    PipelineModel,
    Prediction,
    ReceiverLoad,
    SenderLoad,
    broadcast_lower_bound,
    delta_bytes,
    p2p_lower_bound,
    predict,
)

__all__ = [
    "RankLoad",
    "EngineLoad",
    "SenderPlan",
    "ClusterPlan",
    "DeltaPlan",
    "plan_cluster",
    "pipeline_stage_of",
]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def pipeline_stage_of(name: str, num_layers: int, num_stages: int) -> int:
    """The trainer pipeline stage holding parameter or HF tensor ``name``.

    Layers are split into ``num_stages`` contiguous, near-equal runs (Megatron's even
    split); layers past ``num_layers`` (MTP) go to the last stage, as do the head and
    the final norm; the embedding and anything else to the first.
    """
    if num_stages == 1:
        return 0
    match = _LAYER.search(name)
    if match is not None:
        return min(int(match.group(1)) * num_stages // max(num_layers, 1), num_stages - 1)
    if name.startswith("lm_head") or name.endswith(("model.norm.weight", "final_layernorm.weight")):
        return num_stages - 1
    return 0


@dataclass(frozen=True, kw_only=True)
class RankLoad:
    """What one update writes to one engine rank, split by the trainer's pipeline stages."""

    layout_key: Hashable
    """Equal for ranks that receive the same bytes (one replica)."""
    bytes_by_stage: tuple[int, ...]
    loader_inputs_by_stage: tuple[int, ...] | None = None
    """HF tensors the rank's loaders read, per stage (for the predicted time only)."""
    quantized_by_stage: tuple[Mapping[str, tuple[int, int]], ...] | None = None
    """HF tensors quantized for this rank (fp8 engines), per stage: (bf16 bytes of the
    blocks it reads, of the whole tensor). A sender quantizes only the blocks its ranks'
    loaders read (``source/fp8_regions.py``), each tensor once however many of its ranks
    read it (one conversion per format): a routed expert's share under expert TP, other
    weights whole (attention is partly replicated; not told apart here). An estimate:
    the shares of a sender's layouts are summed, capped at the whole, where the sender
    quantizes one bounding box (ranks 0 and 3 of 4: the whole, charged a half; a TP 2
    and a TP 4 layout overlap: charged more than it does)."""

    bytes_by_itemsize_by_stage: tuple[Mapping[int, int], ...] | None = None
    """The same bytes by element size (2: bf16; 1: fp8 weights; 4: their float32 scales),
    per stage: what a delta update sends of them (None: all bf16)."""

    expert_bytes_by_stage: tuple[int, ...] | None = None
    """Of ``bytes_by_stage``, the routed experts' (``plan.owner_cost``; None: unknown, 0)."""

    @property
    def num_bytes(self) -> int:
        return sum(self.bytes_by_stage)

    def expert_bytes(self, stage: int) -> int:
        return 0 if self.expert_bytes_by_stage is None else self.expert_bytes_by_stage[stage]

    def delta_bytes_all(self, fraction: float) -> int:
        """Bytes a delta update writes to this rank, every stage."""
        return sum(self.delta_bytes(stage, fraction) for stage in range(len(self.bytes_by_stage)))

    def changed_elements(self, stage: int, fraction: float) -> int:
        """Elements of this rank's bytes in ``stage`` changed at ``fraction``."""
        if self.bytes_by_itemsize_by_stage is None:
            return round(fraction * (self.bytes_by_stage[stage] // 2))
        sizes = self.bytes_by_itemsize_by_stage[stage]
        return sum(round(fraction * (n // size)) for size, n in sizes.items())

    def delta_bytes(self, stage: int, fraction: float) -> int:
        """Bytes a delta update writes to this rank in ``stage`` at ``fraction`` changed."""
        if self.bytes_by_itemsize_by_stage is None:
            return delta_bytes({2: self.bytes_by_stage[stage]}, fraction)
        return delta_bytes(self.bytes_by_itemsize_by_stage[stage], fraction)

    def loader_inputs(self, stage: int) -> int:
        return 0 if self.loader_inputs_by_stage is None else self.loader_inputs_by_stage[stage]

    def quantized(self, stage: int) -> Mapping[str, tuple[int, int]]:
        return {} if self.quantized_by_stage is None else self.quantized_by_stage[stage]


@dataclass(frozen=True, kw_only=True)
class EngineLoad:
    """One engine: its layout as given, and every rank's load."""

    layout: Mapping[str, Any]
    ranks: tuple[RankLoad, ...]


@dataclass(frozen=True)
class SenderPlan:
    """One sending trainer rank: its stage, its targets and what it moves."""

    rank: int
    stage: int
    targets: tuple[tuple[int, int], ...]
    """(engine index, engine rank) it writes."""
    load: SenderLoad


@dataclass(frozen=True)
class DeltaPlan:
    """The same update sent as a delta, at ``fraction`` of the engines' values changed:
    the same assignment; each sender still loads every byte and compares it with the
    previous update's, and writes only the changed elements (index and value each)."""

    fraction: float
    p2p_bytes: int
    full_bytes: int
    p2p_bound: Bound
    prediction: Prediction

    def to_json(self) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "p2p_bytes": self.p2p_bytes,
            "bytes_fraction": self.p2p_bytes / self.full_bytes if self.full_bytes else 0.0,
            "lower_bound_s": self.p2p_bound.seconds,
            "busiest_link": _link_json(self.p2p_bound),
            "predicted_s": self.prediction.as_dict(),
        }

    def render(self, full: ClusterPlan) -> list[str]:
        share = self.p2p_bytes / self.full_bytes if self.full_bytes else 0.0
        p = self.prediction
        return [
            f"delta update at {100 * self.fraction:g} % changed: p2p {_gb(self.p2p_bytes)} "
            f"({100 * share:.1f} % of the full update's), lower bound "
            f"{self.p2p_bound.seconds:.3g} s ({_describe(self.p2p_bound)})",
            f"predicted delta update: {p.seconds:.3g} s (full: {full.prediction.seconds:.3g}) "
            f"= transfer {p.transfer_s:.3g} ({p.slowest}; load and compare {p.load_s:.3g}, "
            f"write {p.write_s:.3g}) + control {p.control_s:.3g} + engine {p.engine_s:.3g}",
        ]


@dataclass(frozen=True)
class ClusterPlan:
    """The assignment, the bytes, the bounds and the prediction of one update."""

    engines: tuple[EngineLoad, ...]
    num_stages: int
    senders: tuple[SenderPlan, ...]
    writers: Mapping[tuple[int, int], tuple[int, ...]] = field(repr=False)
    """(engine index, engine rank) -> its writer in each stage (global sender ranks)."""
    broadcast_bytes_by_stage: tuple[int, ...]
    links: LinkModel
    pipeline: PipelineModel
    p2p_bound: Bound
    broadcast_bound: Bound
    prediction: Prediction
    delta: DeltaPlan | None = None
    """The same update as a delta (``plan_cluster(delta_fraction=...)``)."""

    @property
    def p2p_bytes(self) -> int:
        return sum(rank.num_bytes for engine in self.engines for rank in engine.ranks)

    @property
    def broadcast_bytes(self) -> int:
        """Every engine GPU receives the whole update."""
        num_gpus = sum(len(engine.ranks) for engine in self.engines)
        return num_gpus * sum(self.broadcast_bytes_by_stage)

    def to_json(self) -> dict[str, Any]:
        """The plan as the ``--json`` output of ``p2pweights plan``.

        ``engines[i].ranks[r].sender`` is the rank's writer (a list of one writer per
        stage when there are several pipeline stages); ``senders[s].bytes`` what sender
        ``s`` writes.
        """

        def sender_of(key: tuple[int, int]) -> int | list[int]:
            writers = self.writers[key]
            return writers[0] if self.num_stages == 1 else list(writers)

        out = {
            "engines": [
                {
                    "layout": dict(engine.layout),
                    "ranks": [
                        {"rank": r, "bytes": rank.num_bytes, "sender": sender_of((e, r))}
                        for r, rank in enumerate(engine.ranks)
                    ],
                }
                for e, engine in enumerate(self.engines)
            ],
            "senders": [
                {
                    "rank": s.rank,
                    "bytes": s.load.write_bytes,
                    "stage": s.stage,
                    "loaded_bytes": s.load.load_bytes,
                    "targets": [list(t) for t in s.targets],
                }
                for s in self.senders
            ],
            "p2p_bytes": self.p2p_bytes,
            "broadcast_bytes": self.broadcast_bytes,
            "lower_bound_s": {
                "p2p": self.p2p_bound.seconds,
                "broadcast": self.broadcast_bound.seconds,
            },
            "busiest_link": {
                "p2p": _link_json(self.p2p_bound),
                "broadcast": _link_json(self.broadcast_bound),
            },
            "predicted_s": self.prediction.as_dict(),
            "link_model": self.links.as_dict(),
            "pipeline_model": self.pipeline.as_dict(),
        }
        if self.delta is not None:
            out["delta"] = self.delta.to_json()
        return out

    def render(self) -> str:
        """The plan for a terminal: assignment, bytes, bounds, prediction."""
        lines = [
            f"{len(self.engines)} engine(s), {sum(len(e.ranks) for e in self.engines)} engine "
            f"rank(s); {len(self.senders)} sender(s) in {self.num_stages} pipeline stage(s)",
            "",
            "assignment (engine rank: bytes <- sender):",
        ]
        for e, engine in enumerate(self.engines):
            layout = ",".join(f"{k}={v}" for k, v in engine.layout.items())
            lines.append(f"  engine {e} ({layout}):")
            for r, rank in enumerate(engine.ranks):
                writers = "/".join(str(s) for s in self.writers[(e, r)])
                lines.append(f"    rank {r:3d}: {_gb(rank.num_bytes)} <- sender {writers}")
        lines.append("senders (bytes written, loaded once per layout):")
        for s in self.senders:
            stage = f" stage {s.stage}" if self.num_stages > 1 else ""
            lines.append(
                f"  sender {s.rank:3d}{stage}: writes {_gb(s.load.write_bytes)} to "
                f"{len(s.targets)} rank(s), loads {_gb(s.load.load_bytes)}"
            )
        idle = [s for s in self.senders if not s.targets]
        if idle:
            num_ranks = sum(len(engine.ranks) for engine in self.engines)
            lines.append(
                f"  {len(idle)} of {len(self.senders)} sender(s) write nothing: each engine "
                f"rank has one writer per pipeline stage, and there are {num_ranks} engine "
                f"rank(s) for {len(self.senders) // self.num_stages} sender(s) per stage"
            )
        ratio = self.broadcast_bytes / self.p2p_bytes if self.p2p_bytes else float("nan")
        prediction = self.prediction
        lines += [
            "",
            f"bytes moved: p2p {_gb(self.p2p_bytes)}, NCCL broadcast {_gb(self.broadcast_bytes)} "
            f"({ratio:.1f}x)",
            f"lower bound: p2p {self.p2p_bound.seconds:.3g} s (busiest link: "
            f"{_describe(self.p2p_bound)})",
            f"             broadcast {self.broadcast_bound.seconds:.3g} s (busiest link: "
            f"{_describe(self.broadcast_bound)})",
            f"predicted p2p update: {prediction.seconds:.3g} s = transfer "
            f"{prediction.transfer_s:.3g} ({prediction.slowest}; load {prediction.load_s:.3g}, "
            f"write {prediction.write_s:.3g}, {prediction.num_flushes} flush(es)) + control "
            f"{prediction.control_s:.3g} + engine {prediction.engine_s:.3g}; "
            f"{prediction.seconds / self.p2p_bound.seconds if self.p2p_bound.seconds else 0:.2f}x "
            f"the bound",
            f"staging in {self.links.staging} memory; NIC {self.links.nic_gbps:g} GB/s, host "
            f"{self.links.host_gbps:g} GB/s, NVLink {self.links.nvlink_gbps:g} GB/s per GPU",
        ]
        if self.delta is not None:
            lines += self.delta.render(self)
        return "\n".join(lines)


def _gb(num_bytes: int) -> str:
    """Bytes in the largest decimal unit that keeps at least one whole unit."""
    for unit, size in (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return (
                f"{num_bytes / size:.3g} {unit}"
                if num_bytes < 100 * size
                else (f"{num_bytes / size:.0f} {unit}")
            )
    return f"{num_bytes} B"


def _describe(bound: Bound) -> str:
    return f"{bound.link}, {_gb(bound.link_bytes)} at {bound.link_gbps:g} GB/s"


def _link_json(bound: Bound) -> dict[str, Any]:
    return {"link": bound.link, "bytes": bound.link_bytes, "gbps": bound.link_gbps}


def plan_cluster(
    engines: Sequence[EngineLoad],
    *,
    num_senders: int,
    num_stages: int = 1,
    broadcast_bytes_by_stage: Sequence[int],
    links: LinkModel | None = None,
    pipeline: PipelineModel | None = None,
    delta_fraction: float | None = None,
) -> ClusterPlan:
    """Assign every engine rank a writer per stage and cost the update.

    ``num_senders`` counts the sending trainer ranks of every stage (each stage has
    ``num_senders / num_stages``, as ``SyncConfig.num_senders``). With ``delta_fraction``
    the same update is also costed as a delta at that fraction of values changed.
    """
    if delta_fraction is not None and not 0 <= delta_fraction <= 1:
        raise ConfigError(f"the delta fraction must be in [0, 1], got {delta_fraction}")
    if not engines:
        raise ConfigError("plan at least one engine")
    if num_stages < 1 or num_senders < num_stages or num_senders % num_stages:
        raise ConfigError(
            f"{num_senders} sender(s) cannot form {num_stages} pipeline stage(s) of equal size; "
            f"give --senders as a multiple of --stages"
        )
    if len(broadcast_bytes_by_stage) != num_stages:
        raise ConfigError("broadcast_bytes_by_stage needs one entry per stage")
    for engine in engines:
        for rank in engine.ranks:
            if len(rank.bytes_by_stage) != num_stages:
                raise ConfigError("every rank's bytes_by_stage needs one entry per stage")
    links = links or LinkModel()
    pipeline = pipeline or PipelineModel()
    per_stage = num_senders // num_stages
    ranks = {
        (e, r): rank for e, engine in enumerate(engines) for r, rank in enumerate(engine.ranks)
    }
    targets = [Target(e, r, rank.layout_key, rank.num_bytes) for (e, r), rank in ranks.items()]
    assignment = assign_targets(per_stage, targets)  # the same in every stage, as the session
    senders: list[SenderPlan] = []
    writers: dict[tuple[int, int], list[int]] = {key: [] for key in ranks}
    for stage in range(num_stages):
        for local, assigned in enumerate(assignment):
            rank_id = stage * per_stage + local
            keys = [(t.engine_index, t.engine_rank) for t in assigned]
            for key in keys:
                writers[key].append(rank_id)
            distinct = {ranks[key].layout_key: ranks[key] for key in keys}.values()
            quantized: dict[str, tuple[int, int]] = {}  # name -> (blocks read, whole)
            for rank in distinct:  # TP ranks read disjoint blocks; other layouts may overlap
                for name, (share, whole) in rank.quantized(stage).items():
                    read = quantized.get(name, (0, whole))[0] + share
                    quantized[name] = (min(read, whole), whole)
            load = SenderLoad(
                rank=rank_id,
                write_bytes=sum(ranks[key].bytes_by_stage[stage] for key in keys),
                load_bytes=sum(rank.bytes_by_stage[stage] for rank in distinct),
                loader_inputs=sum(rank.loader_inputs(stage) for rank in distinct),
                quantized_bytes=sum(read for read, _ in quantized.values()),
                quantized_inputs=len(quantized),
            )
            senders.append(SenderPlan(rank_id, stage, tuple(keys), load))
    receivers = [
        ReceiverLoad(name=f"engine {e} rank {r}", num_bytes=rank.num_bytes)
        for (e, r), rank in ranks.items()
    ]
    sender_loads = [s.load for s in senders]
    delta = None
    if delta_fraction is not None:
        delta = _delta_plan(
            delta_fraction, ranks, senders, receivers, len(engines), links, pipeline
        )
    return ClusterPlan(
        engines=tuple(engines),
        num_stages=num_stages,
        senders=tuple(senders),
        writers={key: tuple(value) for key, value in writers.items()},
        broadcast_bytes_by_stage=tuple(broadcast_bytes_by_stage),
        links=links,
        pipeline=pipeline,
        p2p_bound=p2p_lower_bound(sender_loads, receivers, links),
        broadcast_bound=broadcast_lower_bound(broadcast_bytes_by_stage, len(receivers), links),
        prediction=predict(sender_loads, receivers, len(engines), links, pipeline),
        delta=delta,
    )


def _delta_plan(
    fraction: float,
    ranks: Mapping[tuple[int, int], RankLoad],
    senders: Sequence[SenderPlan],
    receivers: Sequence[ReceiverLoad],
    num_engines: int,
    links: LinkModel,
    pipeline: PipelineModel,
) -> DeltaPlan:
    """The assignment's senders writing deltas: every byte loaded and compared, only the
    changed elements written."""
    loads = [
        replace(
            s.load,
            write_bytes=sum(ranks[key].delta_bytes(s.stage, fraction) for key in s.targets),
            compared_bytes=s.load.load_bytes,
            changed_elements=sum(
                rank.changed_elements(s.stage, fraction)
                for rank in {ranks[key].layout_key: ranks[key] for key in s.targets}.values()
            ),
        )
        for s in senders
    ]
    delta_receivers = [
        ReceiverLoad(name=r.name, num_bytes=ranks[key].delta_bytes_all(fraction))
        for r, key in zip(receivers, ranks, strict=True)
    ]
    return DeltaPlan(
        fraction=fraction,
        p2p_bytes=sum(r.num_bytes for r in delta_receivers),
        full_bytes=sum(r.num_bytes for r in receivers),
        p2p_bound=p2p_lower_bound(loads, delta_receivers, links),
        prediction=predict(loads, delta_receivers, num_engines, links, pipeline),
    )
