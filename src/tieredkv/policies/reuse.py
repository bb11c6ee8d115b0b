"""Weighted reuse distances, online, with a Fenwick tree over access positions."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from operator import itemgetter

__all__ = ["ReuseTracker"]


class ReuseTracker:
    """Measures, per access, the bytes of the distinct other sessions accessed since the
    same session's previous access (the *weighted reuse distance*).

    Every access takes the next position; a Fenwick tree holds each session's size at its
    latest position only (the previous one is cleared), so the distance of an access is
    the sum over the positions after the session's previous one: O(log P). The same sum
    from a session's latest position is its *elapsed* distance, the part of its next reuse
    distance already behind it.

    State is bounded: :meth:`sweep` forgets the sessions whose elapsed distance passed a
    horizon (their bytes stay in the tree until the next compaction, so the distances of
    younger sessions stay exact), and when positions run out the tree is rebuilt over the
    sessions still tracked, in the same order.
    """

    __slots__ = ("_min_span", "_next", "_order", "_pos", "_size", "_span", "_total", "_tree")

    def __init__(self, min_positions: int = 1 << 16) -> None:
        self._min_span = max(16, min_positions)
        self._span = self._min_span
        self._tree = [0] * (self._span + 1)  # 1-based
        self._pos: dict[str, int] = {}
        self._size: dict[str, int] = {}
        # Sessions eligible for sweeping, oldest access first (retired ones are left out).
        self._order: OrderedDict[str, None] = OrderedDict()
        self._next = 1
        self._total = 0

    def access(self, session: str, nbytes: int) -> int | None:
        """Record an access; returns its weighted reuse distance, ``None`` on a first access."""
        if self._next > self._span:
            self._compact()
        tree = self._tree
        span = self._span
        prev = self._pos.get(session)
        distance: int | None = None
        if prev is not None:
            distance = self._total - self._prefix(prev)
            old = self._size[session]
            i = prev
            while i <= span:
                tree[i] -= old
                i += i & -i
            self._total -= old
        pos = self._next
        self._next = pos + 1
        i = pos
        while i <= span:
            tree[i] += nbytes
            i += i & -i
        self._total += nbytes
        self._pos[session] = pos
        self._size[session] = nbytes
        self._order[session] = None
        self._order.move_to_end(session)
        return distance

    def elapsed(self, session: str) -> int | None:
        """Distinct bytes of other sessions accessed since ``session``'s latest access."""
        pos = self._pos.get(session)
        return None if pos is None else self._total - self._prefix(pos)

    def __contains__(self, session: object) -> bool:
        return session in self._pos

    def __len__(self) -> int:
        return len(self._pos)

    def sweep(
        self, horizon: float, keep: Container[str], max_tracked: int, limit: int = 2
    ) -> list[str]:
        """Release up to ``limit`` of the oldest sessions whose elapsed distance reached
        ``horizon`` (or all beyond ``max_tracked``), oldest first, and return them.

        Released sessions in ``keep`` are *retired*: still measured, no longer swept (their
        KV is resident and must keep a position). The others are forgotten.
        """
        released: list[str] = []
        while self._order and len(released) < limit:
            session = next(iter(self._order))
            if len(self._pos) <= max_tracked:
                elapsed = self._total - self._prefix(self._pos[session])
                if elapsed < horizon:
                    break
            del self._order[session]
            if session not in keep:
                del self._pos[session]  # its bytes stay in the tree until compaction
                del self._size[session]
            released.append(session)
        return released

    def forget(self, session: str) -> None:
        """Stop tracking ``session`` (a no-op if it is not tracked)."""
        if self._pos.pop(session, None) is not None:
            del self._size[session]
            self._order.pop(session, None)

    def _prefix(self, i: int) -> int:
        tree = self._tree
        total = 0
        while i:
            total += tree[i]
            i &= i - 1
        return total

    def _compact(self) -> None:
        live = sorted(self._pos.items(), key=itemgetter(1))
        span = self._min_span
        while span < 4 * len(live):
            span *= 2
        tree = [0] * (span + 1)
        total = 0
        for new, (session, _) in enumerate(live, 1):
            size = self._size[session]
            tree[new] = size
            self._pos[session] = new
            total += size
        for i in range(1, span + 1):  # linear-time Fenwick build
            j = i + (i & -i)
            if j <= span:
                tree[j] += tree[i]
        self._tree = tree
        self._span = span
        self._next = len(live) + 1
        self._total = total
