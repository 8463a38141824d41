"""The sender side of verified writes: the digest of every staged slot, per runner.

The executor calls ``StagedDigests.add_spans`` once per flushed staging buffer: for the
buffer that opens the engines just before it does (outside their pause), for any later
one after its writes were handed to the writers (the writers and this only read the
buffer); and
``add`` for what a direct load left in an engine's memory: each slot is digested once
and filed under every runner (engine URL, rank, role) it is written to. On a GPU the
sums are left on the device: a staging buffer's in the stream's order (before any later
load refills the buffer), a direct load's on a stream of their own after its copies (each
flush's copies are waited for, the sums only once, by ``settle`` when the run finishes and
before any engine ends its session: they overlap the next flush's loads). They are copied
to the host and hashed once, by ``into``, which the update calls on another thread while
the engines end their sessions (``digest.lane_sums`` says what still waits: a layout's
first use, and small regions where the kernel does not run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import cast

import torch

from p2pweights.errors import TransferError
from p2pweights.wire.digest import Lanes, hex_digests, lane_sums, lanes_hex, span_sums
from p2pweights.wire.publication import Runner

__all__ = ["Shares", "StagedDigests", "summed_shares", "with_shares"]

Shares = dict[Runner, dict[str, tuple[list[int], int]]]
"""Runner -> parameter -> (lane sums, length) of one owner's share of it
(``StagedDigests.shares``)."""


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
"""Per GPU, the stream direct loads' sums run on (one per process, made on first use; two
threads making it at once leave one spare stream, which is harmless)."""


@contextlib.contextmanager
def _after_current_stream(devices: set[torch.device]) -> Iterator[None]:
    """On one GPU: work queued inside runs on a stream of its own, after everything
    queued on the current stream so far. Elsewhere (CPU, or regions on several GPUs,
    which a direct load does not make): the current stream, unchanged."""
    if len(devices) != 1:
        yield
        return
    (device,) = devices
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


class StagedDigests:
    """The slots digested so far in one update, and the runners each one went to."""

    def __init__(self) -> None:
        self._sums: dict[str, Lanes] = {}
        self._filed: list[tuple[str, str, Iterable[Runner]]] = []
        self._partial: set[str] = set()  # keys of owners' shares (``add_spans(partial=)``)
        # runner -> parameter -> (lane sums, length) of each owner's share ``into`` took
        self.shares: Shares = {}
        # Per GPU batch, an event recorded in its stream after its sums, and the stream: ``into``
        # may run on another thread, whose own streams would not wait for them.
        self._done: list[tuple[torch.cuda.Event, torch.cuda.Stream]] = []

    def add(self, slots: Iterable[tuple[str, torch.Tensor, Iterable[Runner]]]) -> None:
        """``slots``: (parameter name, its bytes, the runners it goes to): what a direct
        load left in an engine's memory. On a GPU the sums are taken on a stream of their
        own, after the work queued so far on the current one (the loads' copies): a
        caller that then waits for its copies does not wait for the sums too, which run
        beside what it does next (the next flush's loads) until ``settle``."""
        listed = list(slots)
        keys = self._file((param, runners) for param, _, runners in listed)
        regions = dict(zip(keys, (view for _, view, _ in listed), strict=True))
        with _after_current_stream({view.device for view in regions.values() if view.is_cuda}):
            self._keep(lane_sums(regions))

    def add_spans(
        self,
        buffer: torch.Tensor,
        slots: Iterable[tuple[str, int, int, Iterable[Runner]]],
        *,
        partial: bool = False,
    ) -> None:
        """``slots``: (parameter name, byte offset in ``buffer``, byte length, the runners
        it goes to): a staging buffer's slots, read where they lie. ``partial``: each is an
        owner's share of its parameter (``into`` gives its lane sums, not a digest)."""
        listed = list(slots)
        if not listed:
            return
        keys = self._file((param, runners) for param, _, _, runners in listed)
        if partial:
            self._partial.update(keys)
        spans = {key: (at, size) for key, (_, at, size, _) in zip(keys, listed, strict=True)}
        self._keep(span_sums(buffer, spans))

    def _keep(self, sums: dict[str, Lanes]) -> None:
        self._sums.update(sums)
        for device in {lanes.rows.device for lanes in sums.values() if lanes.rows.is_cuda}:
            stream = torch.cuda.current_stream(device)
            done = torch.cuda.Event()
            done.record(stream)
            self._done.append((done, stream))

    def _file(self, slots: Iterable[tuple[str, Iterable[Runner]]]) -> list[str]:
        """A key for each slot, filed with its parameter and runners."""
        keys = []
        for param, runners in slots:
            key = str(len(self._filed))
            self._filed.append((key, param, runners))
            keys.append(key)
        return keys

    def settle(self) -> None:
        """Wait until every sum queued so far has been taken: a direct load's read engine
        memory, which the engine may rewrite once it ends its session (sglang's
        postprocess can repack weights in place) and a failed update may unmap."""
        for done, _ in self._done:
            done.synchronize()

    def into(self, out: MutableMapping[Runner, dict[str, str]]) -> None:
        """Every digest so far, under each runner its slot went to (waits for the device;
        from any thread); an owner's shares' lane sums and lengths into ``shares``."""
        with contextlib.ExitStack() as scope:
            # each device's copy to the host on the stream the sums were taken on (not a
            # default stream another thread's work may hold up), with that device current
            # (not a context made on device 0 by a thread that never chose one)
            for stream in {stream for _, stream in self._done}:
                scope.enter_context(torch.cuda.stream(stream))
            for done, _ in self._done:
                done.synchronize()
            found = hex_digests({k: v for k, v in self._sums.items() if k not in self._partial})
            shares = {
                key: (self._sums[key].rows[self._sums[key].row].tolist(), self._sums[key].num_bytes)
                for key in self._partial
            }
        for key, param, runners in self._filed:
            for runner in runners:
                if key in shares:
                    self.shares.setdefault(runner, {})[param] = shares[key]
                else:
                    out.setdefault(runner, {})[param] = found[key]
        self._sums, self._filed, self._done, self._partial = {}, [], [], set()


def with_shares(
    digests: Callable[[], dict[Runner, dict[str, str]]],
    shares: Callable[[], Shares],
    gather: Callable[[object], list[object]],
) -> dict[Runner, dict[str, str]]:
    """Under owner sends: this rank's ``digests()`` with the digest of every parameter
    several owners write, made from every rank's ``shares()`` (one ``gather``, which
    every rank joins, also one whose digests failed)."""
    own: Shares | None = None
    try:
        staged = digests()
        own = shares()
    finally:
        gathered = gather(own)
    return {**staged, **summed_shares(staged, gathered)}


def summed_shares(
    staged: Mapping[Runner, Mapping[str, str]], gathered: Iterable[object]
) -> dict[Runner, dict[str, str]]:
    """``staged`` with, for each of its runners, the digest of every parameter owners
    wrote in shares: their lane sums added (mod 2**64: each share is zero outside its
    owner's bytes, so the sum is the whole parameter's)."""
    totals: Shares = {}
    for shares in gathered:
        if shares is None:
            raise TransferError("another trainer rank failed to digest its writes")
        for runner, params in cast(Shares, shares).items():
            for param, (lanes, num_bytes) in params.items():
                have = totals.setdefault(runner, {}).get(param)
                if have is not None:
                    lanes = [
                        (a + b + (1 << 63)) % (1 << 64) - (1 << 63)
                        for a, b in zip(have[0], lanes, strict=True)
                    ]
                totals[runner][param] = (lanes, num_bytes)
    out = {runner: dict(digests) for runner, digests in staged.items()}
    for runner, params in totals.items():
        mine = out.setdefault(runner, {})
        for param, (lanes, num_bytes) in params.items():
            mine[param] = lanes_hex(torch.tensor(lanes, dtype=torch.int64), num_bytes)
    return out
