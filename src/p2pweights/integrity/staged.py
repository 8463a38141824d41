"""The sender side of verified writes: the digest of every staged slot, per runner.

The executor calls ``StagedDigests.add_spans`` once per flushed staging buffer, after
its writes were handed to the writers (the writers and this only read the buffer), and
``add`` for what a direct load left in an engine's memory: each slot is digested once
and filed under every runner (engine URL, rank, role) it is written to. On a GPU the
sums are left on the device, in the stream's order (before any later load refills the
buffer), and copied to the host and hashed once, by ``into``, which the update calls
on another thread while the engines end their sessions (``digest.lane_sums`` says what
still waits: a layout's first use, and small regions where the kernel does not run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, MutableMapping

import torch

from p2pweights.wire.digest import Lanes, hex_digests, lane_sums, span_sums
from p2pweights.wire.publication import Runner

__all__ = ["StagedDigests"]


class StagedDigests:
    """The slots digested so far in one update, and the runners each one went to."""

    def __init__(self) -> None:
        self._sums: dict[str, Lanes] = {}
        self._filed: list[tuple[str, str, Iterable[Runner]]] = []
        self._done: list[tuple[torch.cuda.Event, torch.cuda.Stream]] = []
        """Per GPU batch, an event recorded in its stream after its sums, and the stream:
        ``into`` may run on another thread, whose own streams would not wait for them."""

    def add(self, slots: Iterable[tuple[str, torch.Tensor, Iterable[Runner]]]) -> None:
        """``slots``: (parameter name, its bytes, the runners it goes to)."""
        listed = list(slots)
        keys = self._file((param, runners) for param, _, runners in listed)
        self._keep(lane_sums(dict(zip(keys, (view for _, view, _ in listed), strict=True))))

    def add_spans(
        self, buffer: torch.Tensor, slots: Iterable[tuple[str, int, int, Iterable[Runner]]]
    ) -> None:
        """``slots``: (parameter name, byte offset in ``buffer``, byte length, the runners
        it goes to): a staging buffer's slots, read where they lie."""
        listed = list(slots)
        keys = self._file((param, runners) for param, _, _, runners in listed)
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

    def into(self, out: MutableMapping[Runner, dict[str, str]]) -> None:
        """Every digest so far, under each runner its slot went to (waits for the device;
        from any thread)."""
        with contextlib.ExitStack() as scope:
            # each device's copy to the host on the stream the sums were taken on (not a
            # default stream another thread's work may hold up), with that device current
            # (not a context made on device 0 by a thread that never chose one)
            for stream in {stream for _, stream in self._done}:
                scope.enter_context(torch.cuda.stream(stream))
            for done, _ in self._done:
                done.synchronize()
            found = hex_digests(self._sums)
        for key, param, runners in self._filed:
            for runner in runners:
                out.setdefault(runner, {})[param] = found[key]
        self._sums, self._filed, self._done = {}, [], []
