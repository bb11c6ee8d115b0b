"""Bidaw's previous-answer-based eviction: evict the lowest hit potential first."""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Sequence, Set

import numpy as np

from ..meta import KVMeta, MetadataView
from ._reuse import ReuseTracker
from .ghost import GhostCache

__all__ = ["DEFAULT_ANSWER_EDGES", "BidawEviction"]

_Entry = tuple[float, int, str, int]  # (lower bound of the score, position, session, stamp)
_WINDOW_BINS = 2  # a measured elapsed distance is trusted to +-2 bins of drift

DEFAULT_ANSWER_EDGES: tuple[int, ...] = (8, 16, 24, 32, 40, 48, 64, 80, 112, 160, 256)
"""Upper edges (exclusive, in tokens) of the previous-answer-length buckets; one more
bucket takes everything longer."""


class _Seen:
    """What the policy remembers about a session between its accesses."""

    __slots__ = ("bucket", "completing", "drift", "elapsed", "overdue", "pos", "stamp", "turns")

    def __init__(self, bucket: int, turns: int) -> None:
        self.bucket = bucket
        self.turns = turns
        self.completing = True
        self.overdue = False
        # While resident: the elapsed distance measured when the tracker's drift was
        # ``drift``, the access position then, and the stamp of its live heap entries.
        self.elapsed = 0
        self.drift = 0
        self.pos = 0
        self.stamp = -1


class BidawEviction:
    """Predict each conversation's next reuse from the model's previous answer length, and
    evict the conversation least likely to be a host-memory hit.

    **What it learns.** The *weighted reuse distance* of an access is the total size of the
    distinct other sessions accessed since the same session's previous access (a Fenwick
    tree over access positions measures it exactly, O(log n)). Users read longer answers
    longer, so the distance grows with the previous answer length: the policy keeps a
    sliding window of the last ``samples`` distances, each labelled with the answer-length
    bucket (``answer_edges``) of the session's previous access, and, per bucket, decayed
    counts of sessions that came back versus sessions that did not come back within
    ``horizon`` capacities (departed users).

    A distance sample is taken at an access whose previous access *completed a turn*
    (``meta.turns`` grew there): in the live cache a turn is a load and then an append, and
    only the append-to-next-load gap is a user's think time, not the load-to-append gap.

    **What it predicts.** Let C be the host capacity (``capacity``, else
    ``view.tiers[0].capacity``, else the resident bytes at the first :meth:`victims` call).
    Distances are binned in ``C / bins_per_capacity`` steps up to ``horizon * C``. For a
    resident session whose answer bucket has distance distribution ``p`` and whose
    *elapsed* distance (distinct bytes accessed since its latest access) is ``e``, the
    remaining distance ``R = D - e`` given ``D >= e`` falls in

    - the *small* range ``R < C``: a hit (weight 1),
    - *promising* class i of ``promising`` equal classes covering ``C <= R < (1 + span) C``:
      a hit with the probability that Belady's policy hits at that distance, measured by the
      :class:`~tieredkv.policies.ghost.GhostCache` (weight ``hit(i)``),
    - the *extreme* range, or never (departed): a miss (weight 0).

    The **hit potential** is ``p_small + sum_i p_promising(i) * hit(i)`` over that
    conditional distribution. At ``e = 0`` it is exactly the paper's formula. As ``e``
    grows, a user who is *due* gains potential (the rest of the wait is short), and a user
    who is long *overdue* loses it: the distribution runs out and the departed mass takes
    over, until at ``horizon * C`` the potential is 0. Sparse buckets borrow from the
    pooled distribution of all buckets (``prior_weight`` pseudo-samples).

    **How it chooses.** The victim is the resident with the lowest potential *per byte*
    (``size_aware``, the default: hits count per access, and a long conversation holds
    twenty times the memory of a short one), or with the lowest potential
    (``size_aware=False``, the paper's order). Potentials depend only on (bucket, elapsed
    bin), so they are tabulated per bucket every ``refresh_every`` accesses (and, while
    the first period fills, after 16, 32, 64, ... accesses, so a young cache learns early);
    each table is
    lowered to the largest function below it that rises to the peak of its first mode and
    then never rises again (once overdue, potential only falls). Ties go to the oldest
    access (:meth:`rank` gives the order), and the choice is exact: the same as sorting
    every resident by its current score. Scores move with every access of any session, so
    each resident's heap entry is keyed by a *lower bound* of its score, valid while the
    tracker's drift (a bound on how far any elapsed distance can have moved) stays within
    two bins of the entry's measurement: over that range of bins the least potential is at
    one end, the tables being unimodal. Expired entries are measured again as accesses
    come (a few per access), a table refresh rekeys from the stored measurements, and
    :meth:`victims` pops bounds and measures those candidates until the least measured one
    is below every bound left. Before any table exists (no capacity, no samples) the order
    is LRU. ``docs/explanation/bidaw-eviction.md`` has the measurements behind these
    choices.

    State is bounded: sessions whose elapsed distance passes the horizon are forgotten
    (resident ones are flagged overdue, potential 0), at most ``max_tracked`` are tracked,
    the sample window is fixed-size, and the ghost cache has its own bound.

    :param capacity: host-tier bytes (C); ``None`` reads it from the view
    :param answer_edges: upper edges of the answer-length buckets, in tokens, increasing
    :param promising: number of promising distance classes
    :param span: promising classes cover ``C`` to ``(1 + span) C``
    :param bins_per_capacity: distance bins per C
    :param horizon: distances beyond ``horizon * C`` count as never coming back
    :param samples: distance samples kept (all buckets together)
    :param prior_weight: pseudo-samples of the pooled distribution added to each bucket
    :param refresh_every: accesses between two refreshes of the potential tables
    :param max_tracked: sessions tracked at most (beyond, the oldest are forgotten)
    :param size_aware: rank by potential per byte (``False``: by potential, as the paper)
    :param ghost: the ghost cache; by default one matching ``promising`` and ``span``
    """

    name = "bidaw"

    def __init__(
        self,
        capacity: int | None = None,
        *,
        answer_edges: Sequence[int] = DEFAULT_ANSWER_EDGES,
        promising: int = 7,
        span: float = 1.4,
        bins_per_capacity: int = 16,
        horizon: float = 4.0,
        samples: int = 2048,
        prior_weight: float = 32.0,
        refresh_every: int = 1024,
        max_tracked: int = 1_000_000,
        size_aware: bool = True,
        ghost: GhostCache | None = None,
    ) -> None:
        edges = tuple(answer_edges)
        if any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"answer_edges must increase strictly (got {edges})")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be a positive number of bytes (got {capacity})")
        if horizon <= 1 + span:
            raise ValueError(f"horizon ({horizon}) must exceed 1 + span ({1 + span})")
        if promising < 1 or bins_per_capacity < 1 or samples < 1:
            raise ValueError("promising, bins_per_capacity and samples must be >= 1")
        if refresh_every < 1 or max_tracked < 1 or prior_weight < 0:
            raise ValueError("refresh_every and max_tracked must be >= 1, prior_weight >= 0")
        self.answer_edges = edges
        self.promising = promising
        self.span = span
        self.bins_per_capacity = bins_per_capacity
        self.horizon = horizon
        self.prior_weight = prior_weight
        self.refresh_every = refresh_every
        self.max_tracked = max_tracked
        self.size_aware = size_aware
        self.samples = samples
        self.ghost = ghost if ghost is not None else GhostCache(promising=promising, span=span)
        self._buckets = len(edges) + 1
        self._capacity: int | None = None
        self._tracker = ReuseTracker()
        self._seen: dict[str, _Seen] = {}
        self._samples: deque[tuple[int, int]] = deque(maxlen=samples)  # (bucket, distance)
        self._returned = [0.0] * self._buckets
        self._departed = [0.0] * self._buckets
        self._resident: dict[str, int] = {}
        self._bytes = 0
        self._tables: list[list[float]] | None = None
        # Every resident has one live entry in ``_heap`` keyed by a lower bound of its score
        # that holds while the tracker's drift stays within ``_window`` of its measurement
        # (``_expiry`` says when it stops holding: it is then measured again). Entries whose
        # stamp is no longer the session's are stale and skipped.
        self._heap: list[_Entry] = []
        self._expiry: list[tuple[int, int, str]] = []  # (drift limit, stamp, session)
        self._stamps = itertools.count()
        self._window: int | None = None  # bytes of drift an entry holds for, once C is known
        self._compactions = 0
        self._accesses = 0
        if capacity is not None:
            self._set_capacity(capacity)

    # -- notifications ------------------------------------------------------------------
    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        bucket = bisect.bisect_right(self.answer_edges, meta.prev_answer_tokens)
        distance = self._tracker.access(session, meta.nbytes)
        seen = self._seen.get(session)
        if seen is None:
            seen = self._seen[session] = _Seen(bucket, meta.turns)
        else:
            # Distances past the horizon were already counted as departures.
            if (
                distance is not None
                and seen.completing
                and not seen.overdue
                and (self._capacity is None or distance < self.horizon * self._capacity)
            ):
                self._samples.append((seen.bucket, distance))
                self._returned[seen.bucket] += 1.0
            seen.completing = meta.turns > seen.turns
            seen.turns = meta.turns
            seen.overdue = False
            seen.bucket = bucket
        self._after_tracker_access()
        size = self._resident.get(session)
        if size is not None:  # its elapsed distance is 0 again, maybe in a new bucket
            self._rescore(session, seen, size)
        self.ghost.record(session, meta.nbytes, distance)
        self._sweep()
        self._accesses += 1
        n = self._accesses
        # warm-up: first tables after 16 accesses, then at doubling counts up to the period
        if n % self.refresh_every == 0 or (16 <= n < self.refresh_every and n & (n - 1) == 0):
            self._refresh()
        self._expire()

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        seen = self._seen.get(session)
        if seen is None:
            # Resident without an access we saw (a promotion, or a session forgotten long
            # ago): give it a position now, without a distance sample.
            self._tracker.access(session, meta.nbytes)
            bucket = bisect.bisect_right(self.answer_edges, meta.prev_answer_tokens)
            seen = self._seen[session] = _Seen(bucket, meta.turns)
            seen.completing = False  # its next access (the load) is no reuse we measured
            self._after_tracker_access()
        old = self._resident.get(session)
        self._resident[session] = meta.nbytes
        self._bytes += meta.nbytes - (old or 0)
        if old != meta.nbytes:  # new, or resized: its score changed
            self._rescore(session, seen, meta.nbytes)

    def on_remove(self, session: str) -> None:
        size = self._resident.pop(session, None)
        if size is None:
            return
        self._bytes -= size
        seen = self._seen[session]
        seen.stamp = -1  # its heap entries are stale now
        if seen.overdue:  # retired past the horizon: nothing left to learn from it
            del self._seen[session]
            self._tracker.forget(session)

    # -- decisions ----------------------------------------------------------------------
    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        chosen: list[str] = []
        if need <= 0:
            return chosen
        if self._capacity is None:
            tiers = view.tiers
            self._set_capacity(tiers[0].capacity if tiers else max(self._bytes, 1))
        self._expire()
        heap = self._heap
        seen_of = self._seen
        resident = self._resident
        # Entries are lower bounds: a candidate whose exact key is below the heap's least
        # bound is the least of all. Measured entries wait in ``exact``.
        exact: list[tuple[float, int, str]] = []  # (score, position, session)
        skipped: list[_Entry] = []  # protected entries popped: they go back afterwards
        measured: list[tuple[str, _Seen]] = []  # re-measured: their new entries go in after
        freed = 0
        while freed < need:
            while heap:
                bound, pos, session, stamp = heap[0]
                seen = seen_of.get(session)
                if seen is None or seen.stamp != stamp:
                    heapq.heappop(heap)  # stale
                    continue
                if exact and (exact[0][0], exact[0][1]) < (bound, pos):
                    break
                entry = heapq.heappop(heap)
                if session in protected:
                    skipped.append(entry)
                    continue
                score = self._measure(session, seen, resident[session])
                measured.append((session, seen))
                heapq.heappush(exact, (score, pos, session))
            if not exact:
                break
            _, _, session = heapq.heappop(exact)
            chosen.append(session)
            freed += resident[session]
        for entry in skipped:
            heapq.heappush(heap, entry)
        for session, seen in measured:
            self._push(session, seen, resident[session])
        return chosen if freed >= need else None

    def potential(self, session: str) -> float | None:
        """The current hit potential of a resident session, or ``None`` if not resident."""
        if session not in self._resident:
            return None
        return self._potential(session, self._seen[session])

    def rank(self, session: str) -> tuple[float, int] | None:
        """The eviction order of a resident session, ``None`` if not resident: its score
        (hit potential per byte, or the potential with ``size_aware=False``) and its latest
        access position. :meth:`victims` takes unprotected residents in increasing rank."""
        if session not in self._resident:
            return None
        position = self._tracker.position(session)
        assert position is not None
        return self._score(session), position

    def __len__(self) -> int:
        return len(self._resident)

    def resident_bytes(self) -> int:
        return self._bytes

    # -- introspection ------------------------------------------------------------------
    @property
    def capacity(self) -> int | None:
        """The host capacity C in bytes, once known."""
        return self._capacity

    def bucket_of(self, answer_tokens: int) -> int:
        """The answer-length bucket of an answer of ``answer_tokens`` tokens."""
        return bisect.bisect_right(self.answer_edges, answer_tokens)

    def table(self, bucket: int) -> list[float] | None:
        """Hit potential by elapsed-distance bin (``C / bins_per_capacity`` wide) for one
        bucket, as last refreshed; ``None`` before the first refresh."""
        return None if self._tables is None else list(self._tables[bucket])

    def observed(self, bucket: int) -> list[int]:
        """Reuse distances (bytes) in the sample window observed after answers of ``bucket``,
        oldest first."""
        return [d for b, d in self._samples if b == bucket]

    def tracked(self) -> int:
        """Sessions whose access history is tracked (resident or within the horizon)."""
        return len(self._tracker)

    def refresh(self) -> None:
        """Rebuild the potential tables now (it also happens every ``refresh_every``
        accesses)."""
        self._refresh()

    # -- internals ----------------------------------------------------------------------
    def _set_capacity(self, capacity: int) -> None:
        self._capacity = capacity
        self._window = max(capacity * _WINDOW_BINS // self.bins_per_capacity, 1)
        self.ghost.capacity = capacity
        self._refresh()
        self._remeasure()  # entries made without a window had no expiry

    def _potential(self, session: str, seen: _Seen) -> float:
        elapsed = self._tracker.elapsed(session)
        assert elapsed is not None
        return self._potential_at(seen, elapsed)

    def _potential_at(self, seen: _Seen, elapsed: int) -> float:
        tables = self._tables
        if seen.overdue or tables is None:
            return 0.0
        assert self._capacity is not None
        table = tables[seen.bucket]
        k = elapsed * self.bins_per_capacity // self._capacity
        return table[k] if k < len(table) else 0.0

    def _score(self, session: str) -> float:
        score = self._potential(session, self._seen[session])
        return score / max(self._resident[session], 1) if self.size_aware else score

    def _measure(self, session: str, seen: _Seen, size: int) -> float:
        """Measure ``session``'s elapsed distance now (a new stamp: its entries go stale)
        and return its exact score; :meth:`_push` then files the new entry."""
        tracker = self._tracker
        elapsed = tracker.elapsed(session)
        position = tracker.position(session)
        assert elapsed is not None
        assert position is not None
        seen.elapsed = elapsed
        seen.drift = tracker.drift
        seen.pos = position
        seen.stamp = next(self._stamps)
        potential = self._potential_at(seen, elapsed)
        return potential / max(size, 1) if self.size_aware else potential

    def _push(self, session: str, seen: _Seen, size: int) -> None:
        heapq.heappush(self._heap, (self._bound(seen, size), seen.pos, session, seen.stamp))
        if self._window is not None and not seen.overdue:
            heapq.heappush(self._expiry, (seen.drift + self._window, seen.stamp, session))

    def _rescore(self, session: str, seen: _Seen, size: int) -> None:
        self._measure(session, seen, size)
        self._push(session, seen, size)

    def _bound(self, seen: _Seen, size: int) -> float:
        """A lower bound of the score while the elapsed distance stays within the window
        around its measurement: the tables are unimodal, so over a range of bins the least
        potential is at one end."""
        tables = self._tables
        if seen.overdue or tables is None:
            return 0.0
        capacity = self._capacity
        window = self._window
        assert capacity is not None
        assert window is not None
        nb = self.bins_per_capacity
        table = tables[seen.bucket]
        low = max(seen.elapsed - window, 0) * nb // capacity
        high = (seen.elapsed + window) * nb // capacity
        bound = min(
            table[low] if low < len(table) else 0.0, table[high] if high < len(table) else 0.0
        )
        return bound / max(size, 1) if self.size_aware else bound

    def _expire(self) -> None:
        """Measure again the residents whose window the drift has left."""
        expiry = self._expiry
        drift = self._tracker.drift
        seen_of = self._seen
        while expiry and expiry[0][0] < drift:
            _, stamp, session = heapq.heappop(expiry)
            seen = seen_of.get(session)
            if seen is not None and seen.stamp == stamp:
                self._rescore(session, seen, self._resident[session])
        limit = 2 * len(self._resident) + 64
        if len(self._heap) > limit:
            self._rekey()
        if len(expiry) > limit and self._window is not None:
            window = self._window
            self._expiry = [
                (seen.drift + window, seen.stamp, session)
                for session in self._resident
                if not (seen := seen_of[session]).overdue
            ]
            heapq.heapify(self._expiry)

    def _rekey(self) -> None:
        """Rebuild the heap from the latest measurements (new tables, or stale entries)."""
        seen_of = self._seen
        self._heap = [
            (self._bound(seen, size), seen.pos, session, seen.stamp)
            for session, size in self._resident.items()
            for seen in (seen_of[session],)
        ]
        heapq.heapify(self._heap)

    def _remeasure(self) -> None:
        """Measure every resident again (positions renumbered, or the window changed)."""
        self._heap = []
        self._expiry = []
        for session, size in self._resident.items():
            self._rescore(session, self._seen[session], size)

    def _after_tracker_access(self) -> None:
        if self._tracker.compactions != self._compactions:
            self._compactions = self._tracker.compactions
            self._remeasure()

    def _sweep(self) -> None:
        capacity = self._capacity
        horizon = float("inf") if capacity is None else self.horizon * capacity
        for session in self._tracker.sweep(horizon, self._resident, self.max_tracked):
            seen = self._seen[session]
            self._departed[seen.bucket] += 1.0
            if session in self._resident:
                seen.overdue = True
                self._rescore(session, seen, self._resident[session])
            else:
                del self._seen[session]

    def _refresh(self) -> None:
        capacity = self._capacity
        if capacity is None:
            return
        nb = self.bins_per_capacity
        k_max = int(self.horizon * nb)
        if not self._samples:
            return
        pairs = np.array(self._samples, dtype=np.float64)
        bins = np.minimum(pairs[:, 1] * nb // capacity, k_max - 1).astype(np.int64)
        cells = pairs[:, 0].astype(np.int64) * k_max + bins
        counts = np.bincount(cells, minlength=self._buckets * k_max).reshape(self._buckets, k_max)
        total = counts.sum()
        pooled = counts.sum(axis=0) / total
        smoothed = counts + self.prior_weight * pooled
        returned = np.asarray(self._returned)
        departed = np.asarray(self._departed)
        # Forget old returns and departures at the pace the sample window turns over.
        decay = 0.5 ** (self.refresh_every / self.samples)
        self._returned = [x * decay for x in self._returned]
        self._departed = [x * decay for x in self._departed]
        prior_ret = (returned.sum() + 1.0) / (returned.sum() + departed.sum() + 1.0)
        p_return = (returned + self.prior_weight * prior_ret) / (
            returned + departed + self.prior_weight
        )
        mass = smoothed / smoothed.sum(axis=1, keepdims=True) * p_return[:, None]
        never = 1.0 - p_return
        # Value of a remaining distance of r bins: 1 below C, Belady's hit ratio in the
        # promising classes, 0 beyond.
        value = np.zeros(k_max)
        value[:nb] = 1.0
        hits = self.ghost.hit_ratios()
        promising_end = min(k_max, round((1 + self.span) * nb))
        for r in range(nb, promising_end):
            cls = min(self.promising - 1, int((r - nb) * self.promising / (self.span * nb)))
            value[r] = hits[cls]
        # worth[k, j] = value of a total distance in bin j after e in bin k (j >= k)
        idx = np.arange(k_max)
        shift = idx[None, :] - idx[:, None]
        worth = np.where(shift >= 0, value[np.clip(shift, 0, k_max - 1)], 0.0)
        numerator = mass @ worth.T  # (buckets, k)
        tail = np.cumsum(mass[:, ::-1], axis=1)[:, ::-1] + never[:, None]
        tables = numerator / np.maximum(tail, 1e-12)
        self._tables = [_unimodal(row) for row in tables.tolist()]
        self._rekey()


def _unimodal(row: list[float]) -> list[float]:
    """The largest function below ``row`` that rises to the peak of its *first* mode and
    never rises again: once a user is past due, potential may only fall (a later rise comes
    from other buckets' tails borrowed through the prior, or from noise)."""
    peak = 0
    for k, value in enumerate(row):
        if value > row[peak]:
            peak = k
        elif value < 0.5 * row[peak] and row[peak] - value > 0.05:
            break  # the first mode has ended (a fall of half its height, not noise)
    out = list(row)
    for k in range(peak - 1, -1, -1):
        out[k] = min(out[k], out[k + 1])
    for k in range(peak + 1, len(out)):
        out[k] = min(out[k], out[k - 1])
    return out
