"""Verified writes through sglang's own ``/weights_checker``, for engines without digests.

sglang 0.5.23's ``/weights_checker`` answers ``{"action": "checksum"}`` with one hash per
parameter (and persistent buffer) per TP rank, computed on the engine's own device
(``facade.weights_checker_hash``). The scheduler runs it whether or not an update
session is open (``WeightUpdater.check_weights`` is not gated on ``begin``), so it is
asked after every trainer rank's writes landed and before ``end_weight_update``: the
parameters then hold exactly the reload-layout bytes the writes put there, not yet
re-laid by sglang's postprocess. Each trainer rank compares the hash of every parameter
it wrote with the same hash of what it staged (``verification.checksums``).

What the check sees: every written parameter's bytes on every rank, as one hash of the
whole parameter (sha256 on a CPU engine, sglang's 64-bit GPU hash on a GPU one): a
missing, partial, misplaced or stale write, or any changed byte. What it cannot see:
what ``end_weight_update`` does afterwards (it re-derives and may repack the weights;
write digests are taken at the same point and see no more), parameters nobody wrote,
and fp8 block-quantized weights, which sglang hashes dequantized with their scales: an
engine publishing ``*.weight_scale_inv`` is not checked this way (``why_not``; it needs
write digests). It costs the engine one hash of all its weights inside the pause.

An engine qualifies when it runs sglang 0.5.23 or later and says which device it holds
its weights on (``device`` in its server info; the local engine adds
``p2pweights_engine_device``), and, for a GPU engine, the trainer has CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from p2pweights.engines.concurrency import concurrently
from p2pweights.engines.fleet import ConnectedEngine
from p2pweights.errors import EngineError, TransferError, some_of
from p2pweights.wire.publication import Runner

logger = logging.getLogger(__name__)

__all__ = [
    "METHOD",
    "CheckerShare",
    "CheckerTarget",
    "check",
    "checker_device",
    "checksums_by_rank",
    "why_not",
]

METHOD: Literal["weights_checker"] = "weights_checker"
"""``EngineReport.verified_by``'s name for this check."""
FIRST_RELEASE = (0, 5, 23)
"""The first sglang release whose ``/weights_checker`` was read for this check."""


@dataclass(frozen=True)
class CheckerTarget:
    """An engine checked through its weight checker, and the kind of device it hashes on."""

    engine: ConnectedEngine
    device: str


@dataclass(frozen=True)
class CheckerShare:
    """How the sending trainer ranks share one checker answer per engine (``check``)."""

    gather: Callable[[object], list[object]]
    """Every sending rank's object, in one order on every rank (an all-gather)."""
    me: tuple[int, int]
    """This rank, as (pipeline stage, trainer rank): unique among the sending ranks; the
    lowest rank that wrote a runner role of an engine asks its checker."""


Ask = tuple[str, str]
"""(engine URL, runner role): one ``/weights_checker`` checksum call."""
Answer = list[dict[str, str]] | str
"""Per TP rank, parameter -> checksum; or why the checker gave none."""


def checker_device(engine: ConnectedEngine) -> str | None:
    """The kind of device ("cpu" or "cuda") the engine's ranks hold their weights on, as
    it reports it; None where it does not say."""
    info = engine.server_info
    device = info.get("p2pweights_engine_device") or info.get("device")
    return device if device in ("cpu", "cuda") else None


def why_not(engine: ConnectedEngine) -> str | None:
    """Why the engine's writes cannot be checked through its ``/weights_checker``; None
    where they can."""
    version = str(engine.server_info.get("version") or "")
    if _release(version) < FIRST_RELEASE:
        return (
            f"its sglang ({version or 'version not reported'}) is older than "
            f"{'.'.join(map(str, FIRST_RELEASE))}, whose /weights_checker checksum this check reads"
        )
    scales = sorted(
        name
        for pub in engine.publications
        for name in pub.regions
        if name.endswith("weight_scale_inv")
    )
    if scales:
        return (
            f"it holds fp8 block-quantized weights ({scales[0]!r} and {len(scales) - 1} more "
            f"scales), which sglang's checker hashes dequantized with their scales, not as "
            f"the bytes written"
        )
    device = checker_device(engine)
    if device is None:
        return "it does not report the device it holds its weights on (server info 'device')"
    if device == "cuda" and not torch.cuda.is_available():
        return (
            "it holds its weights on a GPU, where sglang hashes them with its GPU kernel, and "
            "this trainer has no CUDA to compute the same hash"
        )
    return None


def _release(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def checksums_by_rank(url: str, answer: Mapping[str, Any]) -> list[dict[str, str]]:
    """Per-tensor checksums, one dict per TP rank in rank order, of a ``/weights_checker``
    checksum answer.

    Each rank's ``parallelism_info`` is one object in the local engine's answers and a
    list (one per runner role, all of one TP rank) in sglang 0.5.23's.

    Args:
        url: The engine's URL, for messages.
        answer: The ``/weights_checker`` answer.

    Returns:
        Per TP rank in rank order, tensor name -> checksum.

    Raises:
        EngineError: The answer cannot be read, or its TP ranks are not 0..N-1 once each.
    """
    try:
        entries = [
            (_tp_rank(entry["parallelism_info"]), dict(entry["checksums"]))
            for entry in answer["ranks"]
        ]
        ranks = dict(entries)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(
            f"engine {url}: /weights_checker answered checksums p2pweights cannot read "
            f"({exc!r}): {str(dict(answer))[:300]}"
        ) from exc
    if sorted(ranks) != list(range(len(ranks))) or len(ranks) != len(entries):
        raise EngineError(
            f"engine {url}: /weights_checker answered TP ranks {[r for r, _ in entries]}"
        )
    return [ranks[rank] for rank in range(len(ranks))]


def _tp_rank(info: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> int:
    infos = [info] if isinstance(info, Mapping) else list(info)
    tp_ranks = {int(i["tp_rank"]) for i in infos}
    if len(tp_ranks) != 1:
        raise ValueError(f"parallelism_info names TP ranks {sorted(tp_ranks)}, expected one")
    return tp_ranks.pop()


def check(
    targets: Mapping[str, CheckerTarget],
    staged: Mapping[Runner, Mapping[str, str]],
    share: CheckerShare | None = None,
) -> list[tuple[Runner, str]]:
    """Ask each engine's checker (one call per engine and runner role, all at once) and
    compare every parameter in ``staged`` (runner -> parameter -> hash of what was staged);
    (runner, problem) for each runner that disagreed or could not be checked.

    With ``share`` the sending ranks ask each checker once between them (it hashes every
    weight of its engine, inside the pause): two gathers, which every rank joins, also
    one that staged nothing: what each rank needs, then the answers of the calls each
    lowest rank needing one made. Without it every rank asks what it needs."""
    # unpacked: a runner unpacks as the (url, rank, role) tuple it replaced
    needed = sorted(
        {(url, role) for (url, _, role), hashes in staged.items() if url in targets and hashes}
    )
    by_ask = _asked(targets, needed) if share is None else _shared(targets, needed, share)
    problems: list[tuple[Runner, str]] = []
    for runner, hashes in staged.items():
        url, rank, role = runner
        if url not in targets or not hashes:
            continue
        problems += [(runner, problem) for problem in _compare(by_ask[(url, role)], rank, hashes)]
    return problems


def _asked(targets: Mapping[str, CheckerTarget], asks: Sequence[Ask]) -> dict[Ask, Answer]:
    """Each checker's answer to this rank's own call."""
    answers = concurrently(lambda ask: _ask(targets[ask[0]].engine, ask[1]), asks)
    return dict(zip(asks, answers, strict=True))


def _shared(
    targets: Mapping[str, CheckerTarget], needed: list[Ask], share: CheckerShare
) -> dict[Ask, Answer]:
    """Every answer any rank needs, each asked by the lowest rank that needs it. Every
    rank reaches the second gather whatever its calls did: a call that fails is answered
    by why, and an interrupt (Ctrl-C, a preemption's ``SystemExit``) is shared as a
    failed answer first and re-raised after, so no rank is left waiting in it."""
    wanted = cast(list[tuple[Sequence[int], list[Ask]]], share.gather((share.me, needed)))
    asker: dict[Ask, tuple[int, int]] = {}
    for who, asks in sorted(wanted, key=lambda entry: tuple(entry[0])):
        for url, role in asks:  # a gather that does not keep tuples hands back lists
            asker.setdefault((url, role), (int(who[0]), int(who[1])))
    mine = [ask for ask in needed if asker.get(ask) == tuple(share.me)]
    interrupted: BaseException | None = None
    try:
        answered = _asked(targets, mine)
    except BaseException as exc:  # answered as failed calls: the others must not hang
        answered = {
            ask: f"its /weights_checker checksum could not be read ({exc!r})" for ask in mine
        }
        if not isinstance(exc, Exception):
            interrupted = exc
    merged: dict[Ask, Answer] = {}
    for answers in cast(list[dict[Ask, Answer]], share.gather(answered)):
        merged.update(answers)
    if interrupted is not None:
        raise interrupted
    missing = [ask for ask in needed if ask not in merged]
    if missing:
        raise TransferError(
            f"no trainer rank asked /weights_checker of {some_of([repr(a) for a in missing])} "
            f"(the session's gather must keep what it gathers; torch_gather does)"
        )
    return merged


def _compare(answer: Answer, rank: int, hashes: Mapping[str, str]) -> list[str]:
    """What is wrong with one runner's written parameters under its checker's answer."""
    if isinstance(answer, str):
        return [answer]
    if rank >= len(answer):
        return [f"its /weights_checker answered {len(answer)} rank(s)"]
    held = answer[rank]
    missing = sorted(name for name in hashes if name not in held)
    wrong = sorted(name for name, value in hashes.items() if held.get(name, value) != value)
    problems = []
    if wrong:
        problems.append(
            f"{len(wrong)} of {len(hashes)} written parameter(s) do not hold the bytes "
            f"staged for them (sglang's /weights_checker checksum, before "
            f"end_weight_update): {some_of([repr(n) for n in wrong], ', ')}"
        )
    if missing:
        problems.append(
            f"its /weights_checker answered no checksum for {len(missing)} written "
            f"parameter(s): {some_of([repr(n) for n in missing], ', ')}"
        )
    return problems


def _ask(engine: ConnectedEngine, role: str) -> list[dict[str, str]] | str:
    """The engine's checksums of ``role``'s runner per rank, or why there are none."""
    try:
        answer = engine.client.weights_checker("checksum", selector=role)
        return checksums_by_rank(engine.url, answer)
    except EngineError as exc:
        return f"its /weights_checker checksum could not be read ({exc})"
    except Exception as exc:  # this engine's failure alone, not the other engines' calls
        return f"its /weights_checker checksum could not be read ({exc!r})"
