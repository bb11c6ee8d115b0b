"""Weighted reuse distances, online, with a Fenwick tree over access positions."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Container

__all__ = ["ReuseTracker"]

# Old positions a rebuild moves over per access: it starts when three quarters of the
# positions are taken, and at 8 a step it is done before the last quarter is (it covers
# 7 more positions per access than the access takes), so no access waits for a whole one.
_STEPS = 8


def _zeros(n: int) -> array[int]:
    return array("q", bytes(8 * n))


class _Rebuild:
    """A new tree being filled, a few of the old positions per access, in their order."""

    __slots__ = ("at", "cursor", "next", "pos", "span", "total", "tree")

    def __init__(self, span: int) -> None:
        self.span = span
        self.tree = _zeros(span + 1)  # 1-based; see ReuseTracker._fill for its state
        self.at: list[str | None] = [None] * (span + 1)
        self.pos: dict[str, int] = {}  # the sessions moved over, at their new positions
        self.next = 1  # the next new position
        self.cursor = 1  # the next old position to move over
        self.total = 0


class ReuseTracker:
    """Measures, per access, the bytes of the distinct other sessions accessed since the
    same session's previous access (the *weighted reuse distance*).

    Every access takes the next position; a Fenwick tree holds each session's size at its
    latest position only (the previous one is cleared), so the distance of an access is
    the sum over the positions after the session's previous one: O(log P). The same sum
    from a session's latest position is its *elapsed* distance, the part of its next reuse
    distance already behind it.

    State is bounded: :meth:`sweep` forgets the sessions whose elapsed distance passed a
    horizon (their bytes stay in the tree until the next rebuild, so the distances of
    younger sessions stay exact). Before positions run out, a new tree is built over the
    sessions still tracked, in the same order, a few positions per access, while the old
    one keeps answering; it takes over once it holds them all. No single access pays for
    a whole rebuild (at 100k sessions one took 60-300 ms).
    """

    __slots__ = (
        "_at",
        "_min_span",
        "_next",
        "_order",
        "_pos",
        "_rebuild",
        "_size",
        "_span",
        "_total",
        "_tree",
    )

    def __init__(self, min_positions: int = 1 << 16) -> None:
        self._min_span = max(16, min_positions)
        self._span = self._min_span
        self._tree = _zeros(self._span + 1)  # 1-based
        # The session whose access took each position (still its latest while _pos says so).
        self._at: list[str | None] = [None] * (self._span + 1)
        self._pos: dict[str, int] = {}
        self._size: dict[str, int] = {}
        # Sessions eligible for sweeping, oldest access first (retired ones are left out).
        self._order: OrderedDict[str, None] = OrderedDict()
        self._next = 1
        self._total = 0
        self._rebuild: _Rebuild | None = None

    def access(self, session: str, nbytes: int) -> int | None:
        """Record an access; returns its weighted reuse distance, ``None`` on a first access."""
        rebuild = self._rebuild
        if rebuild is not None:
            self._fill(rebuild, _STEPS)
        elif 4 * self._next > 3 * self._span:
            self._start()
        if self._next > self._span:  # (a rebuild always ends before: a safety net)
            rebuild = self._rebuild or self._start()
            self._fill(rebuild, None)
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
            rebuild = self._rebuild
            if rebuild is not None:
                moved = rebuild.pos.pop(session, None)
                if moved is not None:  # the new tree holds it at its previous access
                    _take(rebuild, moved, old)
        pos = self._next
        self._next = pos + 1
        i = pos
        while i <= span:
            tree[i] += nbytes
            i += i & -i
        self._total += nbytes
        self._at[pos] = session
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
                self._drop(session)
            released.append(session)
        return released

    def forget(self, session: str) -> None:
        """Stop tracking ``session`` (a no-op if it is not tracked)."""
        if session in self._pos:
            self._drop(session)
            self._order.pop(session, None)

    def _drop(self, session: str) -> None:
        # its bytes stay in the trees until a rebuild leaves them out
        del self._pos[session]
        del self._size[session]
        if self._rebuild is not None:
            self._rebuild.pos.pop(session, None)

    def _prefix(self, i: int) -> int:
        tree = self._tree
        total = 0
        while i:
            total += tree[i]
            i &= i - 1
        return total

    def _start(self) -> _Rebuild:
        """Begin a new tree, sized for the sessions tracked and for the accesses made
        while it fills."""
        tracked = len(self._pos)
        during = -(-self._next // (_STEPS - 1))  # accesses until the fill catches up
        span = self._min_span
        while span < 4 * tracked or span < 2 * (tracked + during):
            span *= 2
        self._rebuild = _Rebuild(span)
        return self._rebuild

    def _fill(self, r: _Rebuild, steps: int | None) -> None:
        """Move the sessions at the next ``steps`` old positions (all, for ``None``) to the
        new tree, and let it take over once it holds every one.

        The new tree is built the linear way, a position at a time: a position takes its
        session's size, then adds its whole node into its parent. The nodes below ``next``
        are final, and each node above holds what its children below ``next`` gave it,
        which is the Fenwick tree of the sizes so far (see :func:`_take`).
        """
        end = self._next if steps is None else min(self._next, r.cursor + steps)
        at, pos_of, size_of = self._at, self._pos, self._size
        tree, span, at_new, moved = r.tree, r.span, r.at, r.pos
        n = r.next
        for p in range(r.cursor, end):
            session = at[p]
            if session is None or pos_of.get(session) != p:
                continue  # accessed again since, or forgotten
            size = size_of[session]
            tree[n] += size
            up = n + (n & -n)
            if up <= span:
                tree[up] += tree[n]
            moved[session] = n
            at_new[n] = session
            r.total += size
            n += 1
        r.next, r.cursor = n, end
        if end < self._next:
            return
        # take over: the nodes above the last position give their parents what they hold
        i = n - 1
        i += i & -i
        while 0 < i <= span and (up := i + (i & -i)) <= span:
            tree[up] += tree[i]
            i = up
        self._tree, self._at, self._pos = tree, at_new, moved
        self._span, self._next, self._total = span, n, r.total
        self._rebuild = None


def _take(r: _Rebuild, i: int, size: int) -> None:
    """Take ``size`` bytes away at new position ``i`` of a tree being filled: from each
    node holding them, up to the first one above the last position (the nodes above it get
    them from it when it is final)."""
    tree, span, last = r.tree, r.span, r.next - 1
    r.total -= size
    while i <= span:
        tree[i] -= size
        if i > last:
            break
        i += i & -i
