"""Inputs must not change between the moment an update receives them and the moment their
bytes are read (issue 28, item 2).

A group's bytes are loaded only when its staging buffer is flushed, after later tensors
were read from the input; fp8 conversion of a batch waits for the batch. An iterator
that writes into tensors it already yielded (the next bucket copied into the buffer its
earlier tensors are views of) would make the update send bytes other than those
yielded, and the write digests would agree, since sender and engine digest the same
wrong bytes. So each tensor's version counter (``tensor._version``, which every torch
in-place write into its storage moves, through any view of it) and data pointer are
recorded when the update receives it, and compared right before its bytes are read
(each loader call, each conversion); a change raises ``InputChangedError`` naming it.

Detected: in-place torch ops on the tensor, on its base or on any view sharing its
storage (``copy_``, ``add_``, ``out=``, ``torch.no_grad()`` writes, ``set_``, a refill
of the bucket buffer it is a view of, even of another part of that buffer: one counter
covers the whole storage), and a ``.data`` assignment (its data pointer moves).
Not detected: writes that bypass torch's dispatcher (through ``.numpy()`` or DLPack
views, by a Triton / CUDA kernel or a transport given the tensor's address, a
collective writing by pointer, ``untyped_storage()`` copies), and the version of
tensors made under ``torch.inference_mode()`` (they have no counter: only their data
pointer is checked).

Cost: per input tensor, one weak reference, the counter and the pointer on receipt (about
2 us on the 2-core development machine) and the counter and pointer again per read
(about 0.5 us); no byte is touched, and the tensors are not kept alive by it.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

import torch

from p2pweights.errors import InputChangedError

__all__ = ["CheckedLoader", "Receipts", "checked_loaders"]


class Receipts:
    """Each input tensor's version counter and data pointer when the update received it."""

    def __init__(self) -> None:
        self._got: dict[str, tuple[weakref.ref[torch.Tensor], int | None, int]] = {}

    def record(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` arrived as ``name`` (a sparse or otherwise non-strided tensor has no
        data pointer: it is not recorded, and the input check refuses it by name)."""
        if tensor.layout != torch.strided:
            return
        self._got[name] = (weakref.ref(tensor), _version(tensor), tensor.data_ptr())

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """Raise ``InputChangedError`` if ``tensor``, received as ``name``, changed since.
        Tensors made from the inputs (fp8-converted ones) are not inputs: not checked."""
        got = self._got.get(name)
        if got is None:
            return
        ref, version, pointer = got
        if ref() is not tensor:
            return
        now_version, now_pointer = _version(tensor), tensor.data_ptr()
        if now_pointer != pointer:
            what = (
                f"its storage was replaced (a .data assignment or set_?): its data pointer "
                f"moved from {pointer:#x} to {now_pointer:#x}"
            )
        elif now_version != version:
            what = (
                f"it, or a view of its storage, was written in place: its version counter "
                f"went from {version} to {now_version}"
            )
        else:
            return
        raise InputChangedError(
            f"HF tensor {name!r} changed after update() received it and before its bytes "
            f"were read: {what}. Its bytes would have been sent as they are now, not as they "
            f"were given. Inputs must stay unchanged until update() returns: an iterator "
            f"must not refill a buffer whose tensors it already yielded (yield a fresh "
            f"buffer per bucket, or copies)"
        )

    def record_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in self.recording(tensors):
            pass

    def recording(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``tensors``, each recorded as it arrives (anything not a tensor is passed on
        for the input check to refuse)."""
        for name, tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self.record(name, tensor)
            yield name, tensor

    def check_all(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.check(name, tensor)


class CheckedLoader:
    """A loader (``transfer.executor.Loader``) that checks its inputs' receipts first."""

    def __init__(self, loader: object, receipts: Receipts):
        self._loader = loader
        self._receipts = receipts

    @property
    def layouts(self) -> object:
        """The wrapped loader's parameter layouts (the executor reads element sizes)."""
        return getattr(self._loader, "layouts", None)

    def load_into(
        self, inputs: Sequence[tuple[str, torch.Tensor]], views: Mapping[str, torch.Tensor]
    ) -> None:
        self._receipts.check_all(inputs)
        self._loader.load_into(inputs, views)  # type: ignore[attr-defined]


def checked_loaders(
    loaders: Mapping[Hashable, object], receipts: Receipts
) -> dict[Hashable, CheckedLoader]:
    """``loaders`` (the replicas), each checking its inputs' receipts before it loads."""
    return {key: CheckedLoader(loader, receipts) for key, loader in loaders.items()}


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference-mode tensor has no version counter
        return None
