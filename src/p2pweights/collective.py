"""How several sending trainer ranks fail together: every step ends with ``agree``.

Each step of an update (prepare, open, write, close, check, finish) runs on every
sending trainer rank, of every pipeline stage, and ends with ``agree(ok)``: an
all-reduce of success flags. If any rank failed, every rank raises: with ``gather``,
the first failing rank's error (same class where it is p2pweights', same message,
naming that rank) on every rank; without it, the failing rank its own error and the
others a ``TransferError`` naming the step. So no rank reports success for an update
another rank failed, and every rank runs the same collectives in the same order.

A step may run inside another (the write step opens the engines once its first
buffer is staged): a failure agreed on inside is raised as it is by the outer step,
after the outer step's own ``agree``, instead of being wrapped again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, TypeVar, cast

from p2pweights import errors
from p2pweights.errors import ConfigError, P2PWeightsError, TransferError
from p2pweights.plan.owners import Claim, Ownership, ownership_of
from p2pweights.source.inputs import InputSpec

if TYPE_CHECKING:
    import torch

__all__ = ["Collective"]

T = TypeVar("T")

_ERRORS: dict[str, type[P2PWeightsError]] = {
    name: cls
    for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, P2PWeightsError)
}
"""p2pweights' error classes by name: a failed step raises the failing rank's class everywhere."""

_AGREED = "_p2pweights_agreed"
"""Set on an error every rank raised for the same failed step."""


class Collective:
    """The ``agree`` / ``gather`` protocol of one trainer rank."""

    def __init__(
        self,
        rank_name: str,
        agree: Callable[[bool], bool] | None = None,
        gather: Callable[[object], list[object]] | None = None,
        *,
        stage: int = 0,
        num_stages: int = 1,
    ):
        self.rank_name = rank_name
        self._agree = agree or (lambda ok: ok)
        self._gather = gather
        self._stage, self._num_stages = stage, num_stages

    def step(self, name: str, action: Callable[[], T]) -> T:
        """Run ``action``; every trainer rank learns whether all of them succeeded.

        An interrupt (``KeyboardInterrupt``, a ``SystemExit`` from a preemption handler)
        is agreed on like any failure, then re-raised as it was: the other ranks fail the
        step instead of waiting in the agreement for a rank that left it."""
        error: BaseException | None = None
        try:
            result = action()
        except BaseException as exc:
            error = exc
        if self._agree(error is None):
            if error is not None:  # an agree that says yes for a failed rank: it still fails
                raise error
            return result
        if error is not None and getattr(error, _AGREED, False):
            self._gather_failure(name, error)  # the other ranks gather too
            raise error
        failure = self._gather_failure(name, error)
        if error is not None and not isinstance(error, Exception):
            setattr(error, _AGREED, True)  # an outer step raises it as it is
            raise error
        setattr(failure, _AGREED, True)
        if failure is error:
            raise failure
        raise failure from error

    def _gather_failure(self, name: str, error: BaseException | None) -> BaseException:
        """What this rank raises for a failed step: with ``gather``, the first failing
        rank's error on every rank (same class where it is p2pweights', same message)."""
        another = TransferError(
            f"{self.rank_name}: another trainer rank failed the '{name}' step of this "
            f"update (its error names the engine)"
        )
        if self._gather is None:
            return another if error is None else error
        mine = None if error is None else (self.rank_name, type(error).__name__, str(error))
        failures = [cast(tuple[str, str, str], f) for f in self._gather(mine) if f is not None]
        if not failures:  # agree() said a rank failed, but none reported an error
            return another if error is None else error
        who, kind, message = failures[0]
        others = f" ({len(failures) - 1} other rank(s) failed too)" if len(failures) > 1 else ""
        cls = _ERRORS.get(kind, P2PWeightsError)
        prefix = "" if cls.__name__ == kind else f"{kind}: "
        return cls(f"{who} failed the '{name}' step of this update{others}: {prefix}{message}")

    def same_input_kind(self, given: object) -> None:
        """Every sending rank was given the same kind of input: all read whole (a mapping
        or a sequence) or all streamed (an iterator, e.g. FSDP2's gathering generator).
        Mixed, the ranks would run their collectives in different orders (and an
        iterator's own gathers) and hang until the process group's timeout; instead every
        rank raises ``ConfigError`` naming what each passed (with ``gather``). Two
        all-reduces (one with ``gather`` on a mismatch); nothing is read from ``given``."""
        streamed = isinstance(given, Iterator)
        all_whole = self._agree(not streamed)
        all_streamed = self._agree(streamed)
        if all_whole or all_streamed:
            return
        mine = f"{self.rank_name}: {_kind(given)}"
        said = (
            "; ".join(str(entry) for entry in self._gather(mine))
            if self._gather is not None
            else f"this rank ({mine}) and another differ"
        )
        raise ConfigError(
            "the sending trainer ranks passed update() different kinds of input, some read "
            f"whole (a mapping or a list) and some streamed (an iterator): {said}. Pass the "
            "same on every rank (e.g. hf_named_tensors(model) everywhere: its FSDP2 gathers "
            "run on every rank); nothing was read, paused or written"
        )

    def claims(self, claim: Claim | None) -> tuple[dict[str, InputSpec], Ownership] | None:
        """Every rank's inputs as one and who owns what (``plan.owners``): one all-gather of
        every rank's claim where ranks can gather (first update only); None if a rank
        (``claim`` None here) failed before it. Without ``gather``: ``stage_inputs``, and
        owned inputs are refused (owner sends need every rank's claim)."""
        if self._gather is None:
            if claim is not None and (claim.owned or claim.shards):
                raise ConfigError(
                    f"{self.rank_name} sends owned HF tensors ({sorted(claim.owned)[:2]}), "
                    f"which needs every trainer rank's claim: pass gather= to the session "
                    f"(e.g. p2pweights.torch_gather())"
                )
            specs = self.stage_inputs(None if claim is None else dict(claim.specs))
            return None if specs is None else (specs, Ownership({}))
        gathered = self._gather(claim)
        if any(entry is None for entry in gathered):
            return None
        claims = cast(list[Claim], gathered)
        if not any(c.owned or c.shards for c in claims):  # no owners: the stages' rules, as before
            return union_of_stages([(c.owner[0], c.specs) for c in claims]), Ownership({})
        return ownership_of(claims)

    def gathered_tensor(
        self, name: str, tensor: torch.Tensor, held: tuple[int, int, int]
    ) -> tuple[torch.Tensor, int]:
        """HF tensor ``name`` whole, from every holder's slice (owner sends' fallback for a
        tensor its holders cannot write alone, ``plan.owners``), and the bytes this rank
        received. ``tensor``: this rank's input, whole-shaped with its slice ``held``
        (dim, start, stop). One all-gather (of CPU copies of the slices) among the sending
        ranks, which must all hold a slice and reach this tensor in the same order."""
        import torch

        if self._gather is None:
            raise ConfigError(f"gathering HF tensor {name!r} needs gather= on the session")
        dim, start, stop = held
        mine = tensor.narrow(dim, start, stop - start).detach().to("cpu", copy=True)
        entries = cast(
            list[tuple[str, tuple[int, int, int], torch.Tensor]],
            self._gather((name, held, mine)),
        )
        names = sorted({entry[0] for entry in entries})
        if names != [name]:
            raise ConfigError(
                f"{self.rank_name}: the sending ranks reached different sharded HF tensors "
                f"({names[:3]}) when gathering one; yield the tensors in the same order on "
                f"every rank"
            )
        whole = torch.empty_like(tensor)
        received = 0
        for _, (_, first, last), part in entries:
            whole.narrow(dim, first, last - first).copy_(part)
            if first != start:
                received += part.numel() * part.element_size()
        return whole, received

    def gather(self, own: object) -> list[object]:
        """Every sending rank's ``own``, in one order on every rank; ``[own]`` without
        ``gather`` (each rank then acts on its own alone)."""
        return [own] if self._gather is None else self._gather(own)

    def stage_inputs(self, own: dict[str, InputSpec] | None) -> dict[str, InputSpec] | None:
        """With pipeline stages: the inputs of every stage (one all-gather, first update
        only), checked for tensors sent by two stages; None if a rank (``own`` None here)
        failed before it. With one stage: ``own``."""
        if self._num_stages == 1:
            return own
        assert self._gather is not None, "pipeline stages need gather="
        gathered = self._gather(None if own is None else (self._stage, own))
        if any(entry is None for entry in gathered):
            return None
        return union_of_stages(cast(list[tuple[int, Mapping[str, InputSpec]]], gathered))


def _kind(given: object) -> str:
    what = type(given).__name__
    if isinstance(given, Mapping):
        return f"a mapping ({what}), read whole"
    if isinstance(given, Iterator):
        return f"an iterator ({what}), streamed"
    return f"a sequence ({what}), read whole"


def union_of_stages(
    gathered: list[tuple[int, Mapping[str, InputSpec]]],
) -> dict[str, InputSpec]:
    """Every stage's inputs as one; a tensor may come from one stage only, and the ranks
    of one stage must send the same tensors."""
    by_stage: dict[int, Mapping[str, InputSpec]] = {}
    for stage, specs in gathered:
        if by_stage.setdefault(stage, specs) != specs:
            raise ConfigError(
                f"the trainer ranks of pipeline stage {stage} sent different HF tensors; the "
                f"ranks of one stage must send the same (gathered) tensors"
            )
    union: dict[str, InputSpec] = {}
    owner: dict[str, int] = {}
    for stage, specs in sorted(by_stage.items()):
        for name, spec in specs.items():
            if name in owner:
                raise ConfigError(
                    f"HF tensor {name!r} was sent by pipeline stages {owner[name]} and {stage}; "
                    f"each tensor must come from one stage (drop tied copies on all but one)"
                )
            owner[name], union[name] = stage, spec
    return union
