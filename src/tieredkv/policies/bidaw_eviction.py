"""Bidaw's previous-answer-based eviction: evict the lowest hit potential first."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Sequence, Set

import numpy as np
import numpy.typing as npt

from ..meta import KVMeta, MetadataView
from .base import freed_bytes, shielded, stored_share
from .ghost import GhostCache
from .ranking import RESCORE_BINS, ResidentRanking
from .reuse import ReuseTracker

__all__ = ["DEFAULT_ANSWER_EDGES", "BidawEviction"]

DEFAULT_ANSWER_EDGES: tuple[int, ...] = (8, 16, 24, 32, 40, 48, 64, 80, 112, 160, 256)
"""Upper edges (exclusive, in tokens) of the previous-answer-length buckets; one more
bucket takes everything longer."""


class _Seen:
    """What the policy remembers about a session between its accesses."""

    __slots__ = ("bucket", "completing", "group", "overdue", "rank", "turns")

    def __init__(self, bucket: int, turns: int) -> None:
        self.bucket = bucket
        self.turns = turns
        self.completing = True
        self.overdue = False
        self.group = -1  # the group it is placed in while resident
        self.rank = bucket  # the key it is grouped by (its bucket, and any class of rank)


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
    then never rises again (once overdue, potential only falls). Residents are ranked by
    a :class:`~tieredkv.policies.ranking.ResidentRanking` (grouped by bucket and size
    class, a heap of each group's two ends, O((changed groups + victims) log n) per
    :meth:`victims` call); ties go to the oldest. Before any table exists (no capacity, no
    samples) the order is LRU. ``docs/explanation/bidaw-eviction.md`` has the
    measurements behind these choices.

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

    name = "bidaw-paper"

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
        if not _rises(edges):
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
        self._buckets = self._bucket_count(len(edges) + 1)
        self._capacity: int | None = None
        self._tracker = ReuseTracker()
        self._seen: dict[str, _Seen] = {}
        self._samples: deque[tuple[int, int]] = deque(maxlen=samples)  # (bucket, distance)
        self._returned = [0.0] * self._buckets
        self._departed = [0.0] * self._buckets
        self._resident: dict[str, int] = {}
        self._bytes = 0
        self._tables: list[list[float]] | None = None
        self._ranking = ResidentRanking(self._score, size_aware=size_aware)
        self._accesses = 0
        if capacity is not None:
            self._set_capacity(capacity)

    # -- notifications ------------------------------------------------------------------
    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        bucket = self._bucket(meta, now)
        weight = stored_share(meta)  # the bytes its access brings through the tier
        distance = self._tracker.access(session, weight)
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
        seen.rank = self._rank_key(seen, meta)
        size = self._resident.get(session)
        if size is not None:  # newest of its (possibly new) group
            self._place(session, seen, size)
        self.ghost.record(session, weight, distance)
        self._sweep()
        self._accesses += 1
        n = self._accesses
        # warm-up: first tables after 16 accesses, then at doubling counts up to the period
        if n % self.refresh_every == 0 or (16 <= n < self.refresh_every and n & (n - 1) == 0):
            self._refresh()
        self._rescore_some(weight)
        self._flush()

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        seen = self._seen.get(session)
        if seen is None:
            # Resident without an access we saw (a promotion, or a session forgotten long
            # ago): give it a position now, without a distance sample.
            self._tracker.access(session, meta.nbytes)
            seen = self._seen[session] = _Seen(self._bucket(meta, now), meta.turns)
            seen.rank = self._rank_key(seen, meta)
            seen.completing = False  # its next access (the load) is no reuse we measured
        old = self._resident.get(session)
        size = freed_bytes(meta)  # a shared range is freed with the last that lists it
        self._resident[session] = size
        self._bytes += size - (old or 0)
        if old is None or self._ranking.group_of(seen.rank, size) != seen.group:
            self._place(session, seen, size)
        elif old != size:  # same group, new size: its score changed
            self._ranking.touch(seen.group)
        self._flush()

    def on_remove(self, session: str) -> None:
        size = self._resident.pop(session, None)
        if size is None:
            return
        self._bytes -= size
        seen = self._seen[session]
        self._ranking.unplace(session, seen.group)
        seen.group = -1
        if seen.overdue:  # retired past the horizon: nothing left to learn from it
            del self._seen[session]
            self._tracker.forget(session)
        self._flush()

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
        self._flush()
        chosen, freed = self._ranking.choose(need, shielded(protected, view, now), self._resident)
        return chosen if freed >= need else None

    def potential(self, session: str) -> float | None:
        """The current hit potential of a resident session, or ``None`` if not resident."""
        if session not in self._resident:
            return None
        return self._potential(session, self._seen[session])

    def foresee(self, session: str) -> float | None:
        """The hit potential ``session`` would have if it were resident now (the same model
        as :meth:`potential`: its answer bucket's reuse distances, given the distance
        already elapsed since its latest access), for a session on a lower tier too:
        predictive prefetch brings up the sessions whose users are due back
        (:class:`~tieredkv.policies.base.Foresight`). ``None`` before the first tables, or
        for a session not tracked (never seen, or past the horizon and forgotten)."""
        seen = self._seen.get(session)
        if seen is None or self._tables is None or session not in self._tracker:
            return None
        return self._potential(session, seen)

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
    def _bucket_count(self, answer_buckets: int) -> int:
        """Buckets the distances are learned in, from the answer-length buckets."""
        return answer_buckets

    def _bucket(self, meta: KVMeta, now: float) -> int:
        """The bucket a session's next reuse is predicted from: its previous answer's."""
        return bisect.bisect_right(self.answer_edges, meta.prev_answer_tokens)

    def _rank_key(self, seen: _Seen, meta: KVMeta) -> int:
        """The key residents are grouped by (their scores must fall along access order
        within a group): the bucket."""
        return seen.bucket

    def _set_capacity(self, capacity: int) -> None:
        self._capacity = capacity
        self.ghost.capacity = capacity
        self._refresh()

    def _potential(self, session: str, seen: _Seen) -> float:
        tables = self._tables
        if seen.overdue or tables is None:
            return 0.0
        elapsed = self._tracker.elapsed(session)
        assert elapsed is not None
        assert self._capacity is not None
        table = tables[seen.bucket]
        k = elapsed * self.bins_per_capacity // self._capacity
        return table[k] if k < len(table) else 0.0

    def _score(self, session: str) -> float:
        score = self._potential(session, self._seen[session])
        return score / max(self._resident[session], 1) if self.size_aware else score

    def _rescore_some(self, nbytes: int) -> None:
        """Rescore groups in turn, as many as ``nbytes`` of traffic call for."""
        if self._capacity is None:
            return
        self._ranking.rescore_some(nbytes, self._capacity * RESCORE_BINS / self.bins_per_capacity)

    def _flush(self) -> None:
        """Bring the candidates up to date with the groups that changed."""
        if self._capacity is None:
            return  # no scores before the capacity is known (the first victims() call)
        self._ranking.flush()

    def _place(self, session: str, seen: _Seen, nbytes: int) -> None:
        seen.group = self._ranking.place(session, seen.group, seen.rank, nbytes)

    def _sweep(self) -> None:
        capacity = self._capacity
        horizon = float("inf") if capacity is None else self.horizon * capacity
        for session in self._tracker.sweep(horizon, self._resident, self.max_tracked):
            seen = self._seen[session]
            self._departed[seen.bucket] += 1.0
            if session in self._resident:
                seen.overdue = True
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
        smoothed = counts + self.prior_weight * self._prior(pairs, pooled)
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
        self._tabulated(tables, mass, never, tail)
        self._ranking.rescore_all()

    def _prior(
        self, samples: npt.NDArray[np.float64], pooled: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]:
        """The distribution a bucket's ``prior_weight`` pseudo-samples are drawn from, by
        distance bin: ``pooled`` (every bucket's samples together, one row for all) here; a
        subclass may give each bucket a row of its own (``(buckets, bins)``). ``samples``:
        the window's ``(bucket, distance)`` pairs."""
        return pooled

    def _tabulated(
        self, potential: npt.NDArray[np.float64], mass: npt.NDArray[np.float64],
        never: npt.NDArray[np.float64], tail: npt.NDArray[np.float64],
    ) -> None:  # fmt: skip
        """New tables are in, made from ``potential[b, k]`` (bucket ``b``'s potential at
        elapsed bin ``k``, before it is made unimodal); ``mass[b, j]``: the chance that
        bucket ``b``'s next reuse distance falls in bin ``j``; ``never[b]``: that it never
        comes; ``tail[b, k]``: that it comes in bin ``k`` or later, or never. A subclass
        may derive more from them."""


def _rises(edges: Sequence[float]) -> bool:
    """Whether ``edges`` increase strictly (bucket edges must)."""
    return not any(b <= a for a, b in itertools.pairwise(edges))


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
