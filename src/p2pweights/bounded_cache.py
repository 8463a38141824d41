"""A mapping that keeps its most recently used entries, up to a bound.

For caches keyed on what a user hands p2pweights (configs, tensor names and shapes):
a trainer that keeps sending new keys must not grow the process without end.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import TypeVar

__all__ = ["LruCache"]

K = TypeVar("K")
V = TypeVar("V")


class LruCache(MutableMapping[K, V]):
    """At most ``maxsize`` entries; adding one more drops the least recently used.

    Reading (``[]``, ``get``) and writing an entry make it the most recent. Safe to use
    from several threads (each operation holds a lock).
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"an LruCache holds at least one entry, not {maxsize}")
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def __getitem__(self, key: K) -> V:
        with self._lock:
            value = self._entries[key]
            self._entries.move_to_end(key)
            return value

    def __setitem__(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        with self._lock:
            del self._entries[key]

    def __iter__(self) -> Iterator[K]:
        with self._lock:
            return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"LruCache(maxsize={self.maxsize}, {len(self)} entries)"
