"""This trainer rank's targets: which engine ranks it writes, by replica, and where they live now.

``assign`` splits every engine rank (and its speculative draft) among the sending
trainer ranks, balanced by the bytes each rank published, and checks each of this
rank's targets against its replica. ``moved`` re-reads the live publications of the
targets once their update sessions are open: the p2pweights sglang plugin publishes
afresh when the engine replaced parameter storage (sglang's CPU AMX packing does
after every load), and the old addresses are freed memory by then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence

from p2pweights.engines.concurrency import concurrently
from p2pweights.engines.fleet import ConnectedEngine
from p2pweights.errors import LayoutMismatchError
from p2pweights.plan.assignment import Target, assign_targets
from p2pweights.replica.registry import ReplicaHandle
from p2pweights.wire.publication import RankPublication

logger = logging.getLogger(__name__)

__all__ = ["Targets", "assign", "every", "moved"]

Targets = dict[Hashable, list[RankPublication]]
"""Replica key -> the engine ranks (publications) whose bytes that replica makes."""

ReplicaOf = Callable[[ConnectedEngine, int, str], ReplicaHandle]
"""(engine, engine rank, role) -> the replica of that rank's layout."""


def assign(
    engines: Sequence[ConnectedEngine],
    num_trainer_ranks: int,
    trainer_rank: int,
    replica_of: ReplicaOf,
) -> Targets:
    """``trainer_rank``'s targets by replica, each checked against its replica.

    Targets are balanced by the bytes each engine rank published (its draft's
    included): what every trainer rank reads alike, without building a replica for
    ranks it does not write.
    """
    assignment = assign_targets(
        num_trainer_ranks,
        [
            Target(e.index, rank, replica_of(e, rank, "target").key, e.published_bytes(rank))
            for e in engines
            for rank in range(e.num_ranks)
        ],
    )
    targets: Targets = {}
    for target in assignment[trainer_rank]:
        engine = engines[target.engine_index]
        # the sender of an engine rank also writes its speculative draft, if any
        pubs = [engine.publications[target.engine_rank]]
        if engine.draft_publications:
            pubs.append(engine.draft_publications[target.engine_rank])
        for pub in pubs:
            handle = replica_of(engine, target.engine_rank, pub.role)
            handle.check_published(pub)
            targets.setdefault(handle.key, []).append(pub)
    return targets


def every(engines: Sequence[ConnectedEngine], replica_of: ReplicaOf) -> Targets:
    """Every engine rank (and its draft) by replica, each checked against its replica: what
    an owner writes its owned tensors to (``plan.owners``)."""
    targets: Targets = {}
    for engine in engines:
        for rank in range(engine.num_ranks):
            pubs = [engine.publications[rank]]
            if engine.draft_publications:
                pubs.append(engine.draft_publications[rank])
            for pub in pubs:
                handle = replica_of(engine, rank, pub.role)
                handle.check_published(pub)
                targets.setdefault(handle.key, []).append(pub)
    return targets


def moved(
    targets: Mapping[Hashable, Sequence[RankPublication]],
    engines: Sequence[ConnectedEngine],
    replicas: Mapping[Hashable, ReplicaHandle],
) -> Targets | None:
    """The targets with the publications live publishers re-published since they were
    read, each checked against its replica like a new one; None if none moved.

    Raises ``LayoutMismatchError`` (naming URL, rank and parameter) if a moved
    publication no longer fits its replica (a parameter changed size).
    """
    live = [
        (key, index, pub)
        for key, pubs in targets.items()
        for index, pub in enumerate(pubs)
        if pub.live
    ]
    if not live:
        return None
    clients = {engine.url: engine.client for engine in engines}
    fresh = concurrently(
        lambda item: clients[item[2].engine_url].publication(item[2].engine_rank, item[2].role),
        live,
    )
    out = {key: list(pubs) for key, pubs in targets.items()}
    any_moved = False
    for (key, index, old), new in zip(live, fresh, strict=True):
        if new == old:
            continue
        try:
            replicas[key].check_published(new)
        except LayoutMismatchError as exc:
            raise LayoutMismatchError(
                f"{new.where} published its weights afresh (epoch {old.epoch} -> "
                f"{new.epoch}: the engine replaced parameter storage), and they no longer "
                f"fit its sglang layout, so p2pweights cannot write it: {exc}"
            ) from exc
        logger.info(
            "%s published its weights afresh (epoch %d -> %d); writing to the new addresses",
            new.where,
            old.epoch,
            new.epoch,
        )
        out[key][index] = new
        any_moved = True
    return out if any_moved else None
