"""How :class:`~tieredkv.policies.BidawEviction` finds its lowest-scored residents fast.

Residents are grouped (by answer bucket and power-of-two size class) and kept in access
order within a group; a resident's elapsed reuse distance falls along that order, so a
group's lowest score is at its oldest or its newest member. An indexed heap holds those two
candidates per group, one slot each: a group that changed has its slots rescored and moved
in place (as notifications come, not when victims are chosen), and a few groups are
rescored per access, in turn, so that every group is rescored within two bins of traffic
(an elapsed distance moves by two bins at most). :meth:`ResidentRanking.choose` walks the
heap from its root without changing it, and a group past protected or already chosen
sessions, O((changed groups + victims) log n). Ties go to the oldest.

The heap holds no stale entries, so it never has to be compacted: a heap that dropped
outdated entries lazily had to be rebuilt every few hundred accesses, which put a
rebuild of every group's candidates (0.2-0.4 ms at 500 groups) on one in a hundred
decisions.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Set

__all__ = ["RESCORE_BINS", "ResidentRanking"]

_Candidate = tuple[float, int, int, str]  # (score, end, group, session); its slot: group, end

RESCORE_BINS = 2
"""Every group is rescored after this many distance bins of traffic."""


class ResidentRanking:
    """The residents of one policy, grouped and ranked by ``score`` (lowest first).

    :param score: a resident's current score (potential, or potential per byte)
    :param size_aware: group by power-of-two size class too (scores per byte compare
        sizes within a factor of two only)
    """

    __slots__ = (
        "_credit",
        "_cycle",
        "_dirty",
        "_heap",
        "_in_cycle",
        "_rescore_all",
        "_score",
        "_size_aware",
        "_where",
        "groups",
    )

    def __init__(self, score: Callable[[str], float], *, size_aware: bool) -> None:
        self._score = score
        self._size_aware = size_aware
        self.groups: dict[int, OrderedDict[str, None]] = {}
        """Group -> its residents, oldest access first."""
        self._dirty: set[int] = set()  # groups whose candidates are to be rescored
        self._heap: list[_Candidate] = []
        self._where: dict[int, int] = {}  # slot (group << 1 | end) -> its index in the heap
        self._rescore_all = True  # new tables, or no scores yet
        self._cycle: deque[int] = deque()  # groups in rescoring order
        self._in_cycle: set[int] = set()
        self._credit = 0.0  # groups due for rescoring

    def group_of(self, bucket: int, nbytes: int) -> int:
        """The group of a resident of answer bucket ``bucket`` and ``nbytes`` bytes."""
        # Size classes are powers of two: within a group sizes differ by 2x at most.
        return bucket << 7 | (nbytes.bit_length() if self._size_aware else 0)

    def place(self, session: str, group: int, bucket: int, nbytes: int) -> int:
        """Make ``session`` (now in ``group``, ``-1``: none) the newest of its group for
        ``bucket`` and ``nbytes``; returns that group."""
        if group >= 0:
            self.unplace(session, group)
        group = self.group_of(bucket, nbytes)
        order = self.groups.get(group)
        if order is None:
            order = self.groups[group] = OrderedDict()
            if group not in self._in_cycle:
                self._in_cycle.add(group)
                self._cycle.append(group)
        order[session] = None
        self.touch(group)
        return group

    def unplace(self, session: str, group: int) -> None:
        """``session`` leaves ``group``."""
        order = self.groups[group]
        del order[session]
        if not order:
            del self.groups[group]
        self.touch(group)

    def touch(self, group: int) -> None:
        """``group``'s scores changed: its candidates are stale."""
        self._dirty.add(group)

    def rescore_all(self) -> None:
        """Every score changed (new tables): rescore every group at the next flush."""
        self._rescore_all = True

    def rescore_some(self, nbytes: int, step: float) -> None:
        """Rescore groups in turn, as many as ``nbytes`` of traffic call for, every group
        once per ``step`` bytes."""
        groups = self.groups
        if not groups:
            return
        self._credit = min(self._credit + len(groups) * nbytes / step, len(groups))
        cycle = self._cycle
        while self._credit >= 1 and cycle:
            group = cycle.popleft()
            if group not in groups:
                self._in_cycle.discard(group)
                continue
            self._credit -= 1
            self.touch(group)
            cycle.append(group)

    def flush(self) -> None:
        """Bring the candidates heap up to date with the groups that changed."""
        groups, ends = self.groups, self._ends
        if self._rescore_all:
            self._rescore_all = False
            self._dirty.clear()
            heap = [c for group, members in groups.items() for c in ends(group, members)]
            heapq.heapify(heap)
            self._heap = heap
            self._where = {c[2] << 1 | c[1]: i for i, c in enumerate(heap)}
            return
        put, drop = self._put, self._drop
        for group in self._dirty:
            members = groups.get(group)
            fresh = ends(group, members) if members is not None else []
            for candidate in fresh:
                put(candidate)
            if len(fresh) < 2:  # (one member: no newest end; none: no oldest either)
                drop(group << 1 | 1)
                if not fresh:
                    drop(group << 1)
        self._dirty.clear()

    def _ends(self, group: int, members: OrderedDict[str, None]) -> list[_Candidate]:
        """``group``'s candidates, scored now: its oldest member, and its newest when that
        is another."""
        oldest = next(iter(members))
        candidates = [(self._score(oldest), 0, group, oldest)]
        newest = next(reversed(members))
        if newest != oldest:
            candidates.append((self._score(newest), 1, group, newest))
        return candidates

    def choose(
        self, need: int, protected: Set[str], sizes: Mapping[str, int]
    ) -> tuple[list[str], int]:
        """The lowest-scored residents outside ``protected`` until their ``sizes`` add up
        to ``need`` (or every resident is chosen): ``(chosen, bytes freed)``. The heap is
        left as it is (choosing does not remove anyone): it is walked from its root, a
        node's children joining the walk when the node is taken."""
        chosen: list[str] = []
        heap = self._heap
        n = len(heap)
        walk: list[tuple[_Candidate, int]] = [(heap[0], 0)] if heap else []
        deeper: list[_Candidate] = []  # this call's candidates behind taken/protected ones
        taken: set[str] = set()
        freed = 0
        while freed < need:
            if deeper and (not walk or deeper[0] < walk[0][0]):
                _, end, group, session = heapq.heappop(deeper)
            elif walk:
                (_, end, group, session), i = heapq.heappop(walk)
                child = 2 * i + 1
                if child < n:
                    heapq.heappush(walk, (heap[child], child))
                    if child + 1 < n:
                        heapq.heappush(walk, (heap[child + 1], child + 1))
            else:
                break
            if session in taken:
                continue  # reached from the group's other end too
            if session not in protected:
                chosen.append(session)
                taken.add(session)
                freed += sizes[session]
            following = self._behind(group, end, protected, taken)
            if following is not None:
                heapq.heappush(deeper, following)
        return chosen, freed

    def _behind(
        self, group: int, end: int, protected: Set[str], taken: set[str]
    ) -> _Candidate | None:
        """The first resident from ``end`` of ``group`` neither taken nor protected."""
        order = self.groups[group]
        for session in iter(order) if end == 0 else reversed(order):
            if session not in taken and session not in protected:
                return (self._score(session), end, group, session)
        return None

    # -- the indexed heap ----------------------------------------------------------------
    def _put(self, entry: _Candidate) -> None:
        """Set ``entry``'s slot to it, moving it up or down from where the slot was."""
        heap = self._heap
        i = self._where.get(entry[2] << 1 | entry[1])
        if i is None:
            heap.append(entry)
            self._up(len(heap) - 1, entry)
        else:
            self._move(i, entry)

    def _drop(self, slot: int) -> None:
        """Take ``slot``'s entry out of the heap, if it has one."""
        i = self._where.pop(slot, None)
        if i is None:
            return
        heap = self._heap
        last = heap.pop()
        if i < len(heap):  # the last entry fills the hole, moved up or down from it
            self._move(i, last)

    def _move(self, i: int, entry: _Candidate) -> None:
        """Put ``entry`` in place of the entry at index ``i``, moved up or down from there."""
        if entry < self._heap[i]:
            self._up(i, entry)
        else:
            self._down(i, entry)

    def _up(self, i: int, entry: _Candidate) -> None:
        """Put ``entry`` at index ``i`` or above, where it is no lower than its parent."""
        heap, seat = self._heap, self._seat
        while i:
            parent = (i - 1) >> 1
            above = heap[parent]
            if not entry < above:
                break
            seat(i, above)
            i = parent
        seat(i, entry)

    def _down(self, i: int, entry: _Candidate) -> None:
        """Put ``entry`` at index ``i`` or below, where it is no higher than its children."""
        heap, seat = self._heap, self._seat
        n = len(heap)
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            below = heap[child]
            if child + 1 < n and heap[child + 1] < below:
                child += 1
                below = heap[child]
            if not below < entry:
                break
            seat(i, below)
            i = child
        seat(i, entry)

    def _seat(self, i: int, entry: _Candidate) -> None:
        """Put ``entry`` at index ``i`` of the heap, and record where its slot is."""
        self._heap[i] = entry
        self._where[entry[2] << 1 | entry[1]] = i
