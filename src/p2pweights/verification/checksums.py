"""The sender side of the weight-checker check: sglang's hash of every staged slot.

An engine that records no write digests (released sglang publishing through its own
Mooncake flag, or the plugin started with ``P2PWEIGHTS_WRITE_DIGESTS=0``) still answers
``/weights_checker`` ``{"action": "checksum"}`` with one hash per parameter per rank
(``verification.checker``). To compare, the sender hashes the bytes it staged for each
parameter with sglang's own function (``facade.weights_checker_hash``) on the kind of
device the engine holds it on: sglang hashes a CPU tensor with sha256 and a CUDA one
with its own Triton kernel, and the two answers differ for the same bytes. For a GPU
engine the sender therefore hashes on CUDA: a slot staged in host memory is copied to
the trainer's current GPU first (a trainer without CUDA cannot check a GPU engine this
way; ``verification.checker`` says so at connect).

The executor calls ``add_spans`` once per flushed staging buffer (the buffer that opens
the engines just before it does, outside their pause; any later one after its writes
were handed to the writers, before the buffer is refilled) and ``add`` for what a
direct load left in an engine's memory. Hashing is synchronous: sha256 releases the GIL
while the writer threads send the same bytes, and the GPU hash waits for its own kernel.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch

from p2pweights.wire.publication import Runner

__all__ = ["StagedChecksums"]


class StagedChecksums:
    """sglang weight-checker hashes of the slots staged so far in one update."""

    def __init__(self, devices: Mapping[str, str]) -> None:
        # Engine URL -> the kind of device ("cpu" or "cuda") its ranks hold weights on,
        # for each engine checked this way; slots going elsewhere are not hashed.
        self.devices = dict(devices)
        # Runner -> parameter -> hash of the bytes staged for it.
        self.found: dict[Runner, dict[str, str]] = {}
        self.seconds = 0.0

    def __bool__(self) -> bool:
        return bool(self.devices)

    def add_spans(
        self, buffer: torch.Tensor, slots: Iterable[tuple[str, int, int, Iterable[Runner]]]
    ) -> None:
        """``slots``: (parameter name, byte offset in ``buffer``, byte length, the runners
        it goes to): a staging buffer's slots, hashed where they lie."""
        flat = buffer.reshape(-1).view(torch.uint8)
        self.add((param, flat[at : at + size], runners) for param, at, size, runners in slots)

    def add(self, slots: Iterable[tuple[str, torch.Tensor, Iterable[Runner]]]) -> None:
        """``slots``: (parameter name, its bytes, the runners it goes to)."""
        from p2pweights.replica.sglang import facade

        started = time.perf_counter()
        for param, data, runners in slots:
            by_kind: dict[str, list[Runner]] = {}
            for runner in runners:
                url, _, _ = runner  # a runner unpacks as the tuple it replaced
                kind = self.devices.get(url)
                if kind is not None:
                    by_kind.setdefault(kind, []).append(runner)
            for kind, kept in by_kind.items():
                value = facade.weights_checker_hash(_on(kind, data))
                for runner in kept:
                    self.found.setdefault(runner, {})[param] = value
        self.seconds += time.perf_counter() - started


def _on(kind: str, data: torch.Tensor) -> torch.Tensor:
    """``data`` where sglang hashes it as an engine on a ``kind`` device does."""
    if kind == "cuda":
        return data if data.is_cuda else data.to("cuda", non_blocking=False)
    return data.cpu() if data.is_cuda else data
