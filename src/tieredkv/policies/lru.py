"""Least recently used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from ..meta import KVMeta, MetadataView

__all__ = ["LRU"]


class LRU:
    """Evict the session whose latest access is oldest.

    State: an ordered map session -> resident bytes, least recently used first. An access
    or an admission moves the session to the most recent end; :meth:`victims` walks from the
    least recent end, skipping protected sessions, until it has ``need`` bytes. Every
    operation is O(1) except :meth:`victims`, which is O(victims + skipped).

    The conversation-oblivious baseline of the Bidaw paper: users think between turns, so
    the least recently used conversation is often the one about to come back.
    """

    name = "lru"

    def __init__(self) -> None:
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        if session in self._sizes:
            self._sizes.move_to_end(session)

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        self._bytes += meta.nbytes - self._sizes.get(session, 0)
        self._sizes[session] = meta.nbytes
        self._sizes.move_to_end(session)

    def on_remove(self, session: str) -> None:
        self._bytes -= self._sizes.pop(session, 0)

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        chosen: list[str] = []
        freed = 0
        for session, size in self._sizes.items():
            if freed >= need:
                break
            if session in protected:
                continue
            chosen.append(session)
            freed += size
        return chosen if freed >= need else None

    def __len__(self) -> int:
        return len(self._sizes)

    def resident_bytes(self) -> int:
        return self._bytes
