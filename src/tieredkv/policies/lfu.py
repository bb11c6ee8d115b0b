"""Least frequently used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from ..meta import KVMeta, MetadataView
from .base import shielded

__all__ = ["LFU"]


class LFU:
    """Evict the session accessed least often since it became resident; ties go to the
    least recently used.

    State: session -> (bytes, count), and one LRU-ordered map per count. Admission starts a
    session at count 1; each access of a resident session moves it one count up (O(1)).
    :meth:`victims` visits the counts in increasing order (sorting the distinct counts,
    which stay few: the number of turns of the longest conversation) and walks each map
    from its least recent end, skipping protected sessions.

    A conversation-oblivious baseline of the Bidaw paper.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, int]] = {}  # session -> (bytes, count)
        self._by_count: dict[int, OrderedDict[str, None]] = {}
        self._bytes = 0

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        entry = self._entries.get(session)
        if entry is not None:
            size, count = entry
            self._move(session, count, count + 1)
            self._entries[session] = (size, count + 1)

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        entry = self._entries.get(session)
        if entry is None:
            self._entries[session] = (meta.nbytes, 1)
            self._by_count.setdefault(1, OrderedDict())[session] = None
            self._bytes += meta.nbytes
        else:
            size, count = entry
            self._entries[session] = (meta.nbytes, count)
            self._bytes += meta.nbytes - size

    def on_remove(self, session: str) -> None:
        entry = self._entries.pop(session, None)
        if entry is not None:
            size, count = entry
            self._bytes -= size
            self._move(session, count, None)

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        chosen: list[str] = []
        freed = 0
        if need <= 0:
            return chosen
        protected = shielded(protected, view, now)
        for count in sorted(self._by_count):
            for session in self._by_count[count]:
                if session in protected:
                    continue
                chosen.append(session)
                freed += self._entries[session][0]
                if freed >= need:
                    return chosen
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def resident_bytes(self) -> int:
        return self._bytes

    def _move(self, session: str, old: int, new: int | None) -> None:
        bucket = self._by_count[old]
        del bucket[session]
        if not bucket:
            del self._by_count[old]
        if new is not None:
            self._by_count.setdefault(new, OrderedDict())[session] = None
