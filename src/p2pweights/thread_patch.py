"""Patches no other thread sees: an attribute of a module or class answered per thread.

p2pweights runs inside a trainer, a multi-threaded process (data loaders, NCCL
watchdogs, other libraries). A few globals of sglang, torch and NIXL must read
differently while p2pweights calls into them (sglang's rope must not pick a CUDA
kernel on a CPU host, a loader must not copy on a thread pool, ...). Assigning the
global for the duration of the call would show the change to every thread meanwhile.

``thread_patch(owner, name, replacement, dispatcher)`` instead puts a dispatcher in
place of ``owner.name`` while at least one thread is inside a patch of it: the
dispatcher answers a thread inside the block with ``replacement`` and every other
thread with the original. When the last thread leaves (also on error), the original
goes back, so after the call nothing differs. A dispatcher somebody else replaced
in the meantime is left to them. ``patched_call`` and ``patched_flag`` make the
dispatchers of a function and of a module-level boolean.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["UNSET", "Current", "patched_call", "patched_flag", "thread_patch", "unpatched"]

Current = Callable[[], Any]
"""What a dispatcher asks: this thread's replacement, or ``UNSET`` outside any patch."""

UNSET: Any = object()
"""The answer of ``Current`` in a thread inside no patch of the attribute."""


class _Slot:
    """One patched attribute: its original, its dispatcher and the threads inside."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name
        # Whether the owner itself held the attribute (not a base class).
        self.own = name in vars(owner)
        self.original = getattr(owner, name)
        self.holders = 0
        self.dispatcher: Any = None
        self._local = threading.local()

    def stack(self) -> list[Any]:
        stack: list[Any] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current(self) -> Any:
        stack = self.stack()
        return stack[-1] if stack else UNSET

    def restore(self) -> None:
        if vars(self.owner).get(self.name) is not self.dispatcher:
            return  # replaced by somebody else since: theirs now
        if self.own:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)


_slots: dict[tuple[int, str], _Slot] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def thread_patch(
    owner: Any, name: str, replacement: Any, dispatcher: Callable[[Any, Current], Any]
) -> Iterator[None]:
    """Inside the block, this thread sees ``replacement`` through ``owner.name``'s dispatcher.

    ``dispatcher(original, current)`` makes the object installed in place of the
    attribute; it must behave as ``original`` whenever ``current()`` is ``UNSET``.
    Nestable and reentrant; the original is back once no thread is inside.
    """
    key = (id(owner), name)
    with _lock:
        slot = _slots.get(key)
        if slot is None:
            slot = _Slot(owner, name)
            slot.dispatcher = dispatcher(slot.original, slot.current)
            setattr(owner, name, slot.dispatcher)
            _slots[key] = slot
        slot.holders += 1
    stack = slot.stack()
    stack.append(replacement)
    try:
        yield
    finally:
        stack.pop()
        with _lock:
            slot.holders -= 1
            if slot.holders == 0:
                del _slots[key]
                slot.restore()


def unpatched(owner: Any, name: str, default: Any = None) -> Any:
    """``owner.name`` as it is outside every patch (``default`` where there is none)."""
    with _lock:
        slot = _slots.get((id(owner), name))
        return slot.original if slot is not None else getattr(owner, name, default)


def _call_dispatcher(original: Callable[..., Any], current: Current) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        replacement = current()
        return (original if replacement is UNSET else replacement)(*args, **kwargs)

    return dispatch


def patched_call(
    owner: Any, name: str, replacement: Callable[..., Any]
) -> contextlib.AbstractContextManager[None]:
    """Calls of ``owner.name`` from this thread go to ``replacement`` inside the block.

    Code that looks the function up when it calls it (``module.function(...)`` or a
    global of ``owner``) sees the patch; a reference taken before does not.
    """
    return thread_patch(owner, name, replacement, _call_dispatcher)


class _Flag:
    """A module-level boolean whose truth is the patch's in a thread inside one."""

    def __init__(self, original: Any, current: Current) -> None:
        self._original, self._current = original, current

    def __bool__(self) -> bool:
        value = self._current()
        return bool(self._original if value is UNSET else value)

    def __repr__(self) -> str:
        return repr(bool(self))


def patched_flag(owner: Any, name: str, value: bool) -> contextlib.AbstractContextManager[None]:
    """``owner.name``, a boolean its code tests for truth, is ``value`` for this thread inside."""
    return thread_patch(owner, name, value, _Flag)
