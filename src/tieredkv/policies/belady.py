"""Belady's optimal eviction, driven by an oracle's next-access times."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Set

from ..meta import KVMeta, MetadataView
from .base import shielded

__all__ = ["Belady"]

_NEVER = math.inf


class Belady:
    """Evict the session whose next access is furthest in the future (the upper bound).

    The future comes from an oracle: ``KVMeta.next_access``, which the simulator or a trace
    replay fills in with :meth:`tieredkv.meta.MetadataChannel.hint_next_access` before the
    access or admission it concerns. ``None`` means never again, the furthest of all.

    State: session -> (bytes, next access), and a max-heap on the next access with lazy
    deletion (stale entries are skipped, and the heap is rebuilt when they outnumber the
    live ones, so it stays O(resident)). The policy records the next access it is told at
    :meth:`on_access` and :meth:`on_admit`; :meth:`victims` re-reads a candidate's metadata
    from the view and defers it if a later hint moved its next access. O(log n) per
    notification, O((victims + skipped) log n) per :meth:`victims`.

    With equal sizes this is Belady's MIN, optimal among demand-paging policies; with
    unequal sizes it is the usual heuristic, still a strong reference.
    """

    name = "belady"

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, float, int]] = {}  # session -> (bytes, next, stamp)
        self._heap: list[tuple[float, int, str]] = []  # (-next, stamp, session)
        self._stamps = itertools.count()
        self._bytes = 0

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        entry = self._entries.get(session)
        if entry is not None:
            self._set(session, entry[0], _next_of(meta))

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        entry = self._entries.get(session)
        self._bytes += meta.nbytes - (entry[0] if entry is not None else 0)
        self._set(session, meta.nbytes, _next_of(meta))

    def on_remove(self, session: str) -> None:
        entry = self._entries.pop(session, None)
        if entry is not None:
            self._bytes -= entry[0]

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        chosen: list[str] = []
        if need <= 0:
            return chosen
        protected = shielded(protected, view, now)
        popped: list[tuple[float, int, str]] = []  # live entries taken off the heap
        freed = 0
        heap = self._heap
        while heap and freed < need:
            item = heapq.heappop(heap)
            _, stamp, session = item
            entry = self._entries.get(session)
            if entry is None or entry[2] != stamp:
                continue  # stale
            meta = view.get(session)
            if meta is not None and _next_of(meta) != entry[1]:
                # A hint arrived after the last notification: re-rank with it and go on.
                self._set(session, entry[0], _next_of(meta), compact=False)
                continue
            popped.append(item)
            if session in protected:
                continue
            chosen.append(session)
            freed += entry[0]
        for item in popped:  # choosing does not remove: the cache calls on_remove
            heapq.heappush(heap, item)
        return chosen if freed >= need else None

    def __len__(self) -> int:
        return len(self._entries)

    def resident_bytes(self) -> int:
        return self._bytes

    def _set(self, session: str, nbytes: int, next_access: float, *, compact: bool = True) -> None:
        stamp = next(self._stamps)
        self._entries[session] = (nbytes, next_access, stamp)
        heapq.heappush(self._heap, (-next_access, stamp, session))
        if compact and len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [(-nxt, st, s) for s, (_, nxt, st) in self._entries.items()]
            heapq.heapify(self._heap)


def _next_of(meta: KVMeta) -> float:
    return _NEVER if meta.next_access is None else meta.next_access
