"""How :class:`~tieredkv.policies.BidawEviction` finds its lowest-scored residents fast.

Residents are grouped (by answer bucket and power-of-two size class) and kept in access
order within a group; a resident's elapsed reuse distance falls along that order, so a
group's lowest score is at its oldest or its newest member. A heap holds those two
candidates per group; it is patched (as notifications come, not when victims are chosen)
for the groups that changed, and a few groups are rescored per access, in turn, so that
every group is rescored within two bins of traffic (an elapsed distance moves by two bins
at most). :meth:`ResidentRanking.choose` pops it, walking a group past protected or
already chosen sessions, O((changed groups + victims) log n). Ties go to the oldest.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Set

__all__ = ["RESCORE_BINS", "ResidentRanking"]

_Candidate = tuple[float, int, int, str, int]  # (score, end, group, session, group version)

RESCORE_BINS = 2
"""Every group is rescored after this many distance bins of traffic."""


class ResidentRanking:
    """The residents of one policy, grouped and ranked by ``score`` (lowest first).

    :param score: a resident's current score (potential, or potential per byte)
    :param size_aware: group by power-of-two size class too (scores per byte compare
        sizes within a factor of two only)
    """

    __slots__ = (
        "_candidates",
        "_credit",
        "_cycle",
        "_dirty",
        "_in_cycle",
        "_rescore_all",
        "_score",
        "_size_aware",
        "_versions",
        "groups",
    )

    def __init__(self, score: Callable[[str], float], *, size_aware: bool) -> None:
        self._score = score
        self._size_aware = size_aware
        self.groups: dict[int, OrderedDict[str, None]] = {}
        """Group -> its residents, oldest access first."""
        self._versions: dict[int, int] = {}  # group -> version, bumped on every change
        self._dirty: set[int] = set()
        self._candidates: list[_Candidate] = []
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
        self._versions[group] = self._versions.get(group, 0) + 1
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
        versions = self._versions
        if self._rescore_all:
            self._candidates = []
            self._dirty = set(self.groups)
            self._rescore_all = False
        elif len(self._candidates) > 2 * len(self.groups) + 32:  # few stale to pop
            live = [c for c in self._candidates if versions.get(c[2]) == c[4]]
            heapq.heapify(live)
            self._candidates = live
        heap = self._candidates
        score = self._score
        for group in self._dirty:
            order = self.groups.get(group)
            if order is None:
                continue
            version = versions[group]
            oldest = next(iter(order))
            heapq.heappush(heap, (score(oldest), 0, group, oldest, version))
            newest = next(reversed(order))
            if newest != oldest:
                heapq.heappush(heap, (score(newest), 1, group, newest, version))
        self._dirty.clear()

    def choose(
        self, need: int, protected: Set[str], sizes: Mapping[str, int]
    ) -> tuple[list[str], int]:
        """The lowest-scored residents outside ``protected`` until their ``sizes`` add up
        to ``need`` (or every resident is chosen): ``(chosen, bytes freed)``. The heap is
        left as it was (choosing does not remove anyone)."""
        chosen: list[str] = []
        heap = self._candidates
        versions = self._versions
        kept: list[_Candidate] = []  # live candidates popped: they go back afterwards
        deeper: list[_Candidate] = []  # this call's candidates behind taken/protected ones
        taken: set[str] = set()
        freed = 0
        while freed < need:
            if deeper and (not heap or deeper[0] < heap[0]):
                _, end, group, session, _ = heapq.heappop(deeper)
            elif heap:
                entry = heapq.heappop(heap)
                _, end, group, session, version = entry
                if versions.get(group) != version:
                    continue  # the group changed since: a fresh entry is in the heap
                kept.append(entry)
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
        for entry in kept:
            heapq.heappush(heap, entry)
        return chosen, freed

    def _behind(
        self, group: int, end: int, protected: Set[str], taken: set[str]
    ) -> _Candidate | None:
        """The first resident from ``end`` of ``group`` neither taken nor protected."""
        order = self.groups[group]
        for session in iter(order) if end == 0 else reversed(order):
            if session not in taken and session not in protected:
                return (self._score(session), end, group, session, self._versions[group])
        return None
