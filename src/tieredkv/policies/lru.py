"""Least recently used eviction."""

from __future__ import annotations

from ..meta import KVMeta
from .fifo import FIFO

__all__ = ["LRU"]


class LRU(FIFO):
    """Evict the session whose latest access is oldest.

    State: an ordered map session -> resident bytes, least recently used first (FIFO's map,
    reordered). An access or an admission moves the session to the most recent end;
    :meth:`victims` walks from the least recent end, skipping protected sessions, until it
    has ``need`` bytes. Every operation is O(1) except :meth:`victims`, which is
    O(victims + skipped).

    The conversation-oblivious baseline of the Bidaw paper: users think between turns, so
    the least recently used conversation is often the one about to come back.
    """

    name = "lru"

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        if session in self._sizes:
            self._sizes.move_to_end(session)

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        new = session not in self._sizes
        super().on_admit(session, meta, now)
        if new:  # a resident resized (a fork came or went) was not used
            self._sizes.move_to_end(session)
