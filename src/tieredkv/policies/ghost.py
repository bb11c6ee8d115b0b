"""The ghost cache: Belady's policy replayed over recent accesses, in the background."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

__all__ = ["GhostCache"]

_NEVER = math.inf


class _Record:
    __slots__ = ("cum", "distance", "index", "nbytes", "next", "session")

    def __init__(self, session: str, nbytes: int, distance: int | None, index: int, cum: int):
        self.session = session
        self.nbytes = nbytes
        self.distance = distance
        self.index = index
        self.cum = cum  # bytes recorded before this one
        self.next = _NEVER  # index of the session's next access, once it happens


class GhostCache:
    """Measures the hit ratio Belady's policy achieves on accesses whose weighted reuse
    distance falls in each *promising* class (between 1x and ``1 + span`` times the
    capacity), so that Bidaw's hit potential can credit them.

    Belady needs the future; the past is a fine stand-in for it. Every access is
    :meth:`record`\\ ed into a bounded window and replayed once ``lookahead`` times the
    capacity of newer accesses (in bytes) stand behind it: by then its next use, if close
    enough to matter, is known. The replay keeps a ghost of the cache (session -> bytes, no
    data) at ``capacity`` bytes and evicts the entry whose next use is furthest (unknown =
    never), which gives each access a hit or a miss, credited to the class of its reuse
    distance. Counts decay by half every ``half_life`` replayed accesses, so the estimate
    follows the workload.

    Costs: a record is O(1) plus the replay of about one older access, O(log n) amortized;
    nothing runs in bursts. State is bounded: at most ``window`` records (older ones are
    replayed early if the lookahead does not fit), and a ghost holding at most
    ``capacity`` bytes.

    :param capacity: bytes of the cache being modelled; ``None`` until known (records wait,
        up to ``window`` of them)
    :param promising: number of promising classes
    :param span: promising classes cover reuse distances from 1x to ``1 + span`` times the
        capacity, in equal widths
    :param lookahead: how far ahead (in capacities of recorded bytes) the next use of an
        access is looked for
    :param window: records kept at most
    :param half_life: replayed accesses after which old counts weigh half
    """

    def __init__(
        self,
        capacity: int | None = None,
        *,
        promising: int = 7,
        span: float = 1.4,
        lookahead: float = 3.0,
        window: int = 1 << 16,
        half_life: int = 50_000,
    ) -> None:
        if promising < 1:
            raise ValueError(f"promising must be >= 1 class (got {promising})")
        if span <= 0 or lookahead <= 0:
            raise ValueError("span and lookahead must be positive multiples of the capacity")
        if window < 1 or half_life < 1:
            raise ValueError("window and half_life must be positive counts of accesses")
        self.promising = promising
        self.span = span
        self.lookahead = lookahead
        self.window = window
        self.half_life = half_life
        self._capacity: int | None = None
        self._records: deque[_Record] = deque()
        self._latest: dict[str, _Record] = {}  # session -> its newest record in the window
        self._index = 0
        self._cum = 0
        # The ghost: session -> (bytes, next use, stamp); max-heap on next use, lazy deletion.
        self._ghost: dict[str, tuple[int, float, int]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._stamps = itertools.count()
        self._bytes = 0
        # Per class (0 small, 1..promising, promising + 1 extreme): decayed hits and accesses.
        self._hits = [0.0] * (promising + 2)
        self._seen = [0.0] * (promising + 2)
        self._replayed = 0
        self._decay = 0.5 ** (1024 / half_life)
        if capacity is not None:
            self.capacity = capacity

    @property
    def capacity(self) -> int | None:
        """Bytes of the modelled cache."""
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        if value <= 0:
            raise ValueError(f"capacity must be a positive number of bytes (got {value})")
        self._capacity = value
        self._shrink()

    def record(self, session: str, nbytes: int, distance: int | None) -> None:
        """Add an access (its size and weighted reuse distance, ``None`` if first) and replay
        the records that have enough lookahead behind them."""
        rec = _Record(session, nbytes, distance, self._index, self._cum)
        self._index += 1
        self._cum += nbytes
        prev = self._latest.get(session)
        if prev is not None:
            prev.next = rec.index
        self._latest[session] = rec
        self._records.append(rec)
        capacity = self._capacity
        records = self._records
        if capacity is None:
            while len(records) > self.window:
                self._discard(records.popleft())
            return
        horizon = self._cum - self.lookahead * capacity
        while records and (records[0].cum <= horizon or len(records) > self.window):
            self._replay(records.popleft())

    def hit_ratio(self, cls: int) -> float:
        """Belady's hit ratio on accesses of promising class ``cls`` (0-based), smoothed
        toward a prior that falls from 1/2 to 0 across the classes."""
        prior = 0.5 * (1.0 - (cls + 0.5) / self.promising)
        return (self._hits[cls + 1] + prior) / (self._seen[cls + 1] + 1.0)

    def hit_ratios(self) -> list[float]:
        """:meth:`hit_ratio` of every promising class."""
        return [self.hit_ratio(i) for i in range(self.promising)]

    def class_stats(self) -> list[tuple[float, float]]:
        """Decayed (hits, accesses) per class: small, each promising class, extreme."""
        return list(zip(self._hits, self._seen, strict=True))

    def __len__(self) -> int:
        """Records waiting in the window."""
        return len(self._records)

    def resident_bytes(self) -> int:
        """Bytes held by the ghost (never above :attr:`capacity`)."""
        return self._bytes

    def resident_sessions(self) -> int:
        """Sessions held by the ghost."""
        return len(self._ghost)

    # -- internals ----------------------------------------------------------------------
    def _classify(self, distance: int, capacity: int) -> int:
        if distance < capacity:
            return 0
        cls = int((distance - capacity) * self.promising / (self.span * capacity))
        return 1 + cls if cls < self.promising else self.promising + 1

    def _discard(self, rec: _Record) -> None:
        if self._latest.get(rec.session) is rec:
            del self._latest[rec.session]

    def _replay(self, rec: _Record) -> None:
        capacity = self._capacity
        assert capacity is not None
        self._discard(rec)
        session = rec.session
        entry = self._ghost.get(session)
        if rec.distance is not None:
            cls = self._classify(rec.distance, capacity)
            self._seen[cls] += 1.0
            if entry is not None:
                self._hits[cls] += 1.0
        if entry is not None:
            self._bytes -= entry[0]
        if rec.nbytes <= capacity:
            stamp = next(self._stamps)
            self._ghost[session] = (rec.nbytes, rec.next, stamp)
            heapq.heappush(self._heap, (-rec.next, stamp, session))
            self._bytes += rec.nbytes
        elif entry is not None:
            del self._ghost[session]
        self._shrink()
        self._replayed += 1
        if self._replayed % 1024 == 0:
            self._hits = [h * self._decay for h in self._hits]
            self._seen = [s * self._decay for s in self._seen]

    def _shrink(self) -> None:
        capacity = self._capacity
        if capacity is None:
            return
        heap = self._heap
        ghost = self._ghost
        while self._bytes > capacity:
            _, stamp, session = heapq.heappop(heap)
            entry = ghost.get(session)
            if entry is None or entry[2] != stamp:
                continue  # stale
            del ghost[session]
            self._bytes -= entry[0]
        if len(heap) > 2 * len(ghost) + 64:
            self._heap = [(-nxt, st, s) for s, (_, nxt, st) in ghost.items()]
            heapq.heapify(self._heap)
