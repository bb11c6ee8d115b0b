"""Measuring instruments for ``bench_retention.py --bound``: eviction by hit density in
time, one knowing the synthetic workload's generator, one a trace's statistics, one
learning the gaps online.

Each ranks a resident conversation by its best *hit density*: over every horizon ``h`` it
could still be kept, the chance that its next turn comes within ``h`` over the seconds it
is expected to hold its bytes meanwhile (``E[min(R, h)]``, ``R`` the time left until its
next turn, never for a user who has left), divided by its bytes; the lowest goes first
(hit density after LHD: Beckmann, Chen and Cidon, NSDI '18).

- :class:`KnownDistribution` knows the generator of
  :class:`~tieredkv.sim.synthetic.SyntheticWorkload`: the gap before a turn is 0.3 s per
  token of the previous answer plus a lognormal typing delay, and a user's number of turns
  is lognormal. It sees what any online policy sees (the previous answer's length, the
  turns so far, the time since the latest access), never a future turn's time: what an
  online policy could reach on that workload with the exact model.
- :class:`TraceStatistics` knows a replayed trace's statistics, taken over the whole
  trace in hindsight: the chance that a conversation with ``k`` turns so far has another,
  and the distribution of the gap between two turns (smoothed in log scale). It sees what
  any online policy sees (the turns so far, the time since the latest access), never a
  conversation's own future: on a trace like Mooncake's, whose answer lengths carry no
  signal, what an online ranking could reach with the best estimate of those statistics.
- :class:`LearnedDensity` learns, online, the distribution of the gap in seconds per
  previous-answer-length bucket (Bidaw's buckets; tool-call turns apart) and the share of
  users who leave (no turn within ``depart`` seconds), and ranks by the same rule. A turn
  whose caller hinted when the next one comes is ranked by the hint (its next access is
  known: one hit for the seconds until then), weighed against the learned density by the
  share of hints kept so far.

They are instruments, not library policies: a decision scores every resident (O(residents)
with numpy), which the library's policies may not afford (``bench_policies.py``).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Set

import numpy as np
import numpy.typing as npt

from tieredkv.meta import KVMeta, MetadataView
from tieredkv.policies._hit_density import HORIZONS, best_density, beyond, smoothed_survival
from tieredkv.policies.adaptive_bidaw import DEFAULT_QUERY_EDGES
from tieredkv.policies.base import shielded
from tieredkv.policies.bidaw_eviction import DEFAULT_ANSWER_EDGES
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.trace import Turns

__all__ = ["KnownDistribution", "LearnedDensity", "TraceQueryStatistics", "TraceStatistics"]

Floats = npt.NDArray[np.float64]


class _Ranked:
    """Resident bookkeeping and victim choice by a per-resident score (lowest first)."""

    name = "density"

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}
        self._bytes = 0

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        self._bytes += meta.nbytes - self._sizes.get(session, 0)
        self._sizes[session] = meta.nbytes

    def on_remove(self, session: str) -> None:
        size = self._sizes.pop(session, None)
        if size is not None:
            self._bytes -= size

    def __len__(self) -> int:
        return len(self._sizes)

    def resident_bytes(self) -> int:
        return self._bytes

    def scores(self, sessions: list[str], now: float) -> Floats:
        """Hits per second per byte of keeping each of ``sessions``."""
        raise NotImplementedError

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        if need <= 0:
            return []
        shield = shielded(protected, view, now)
        candidates = [s for s in self._sizes if s not in shield]
        if not candidates:
            return None
        chosen: list[str] = []
        freed = 0
        for i in np.argsort(self.scores(candidates, now), kind="stable").tolist():
            if freed >= need:
                break
            chosen.append(candidates[i])
            freed += self._sizes[candidates[i]]
        return chosen if freed >= need else None


def _lognormal_survival(x: Floats, median: float, sigma: float) -> Floats:
    out = np.ones_like(x)
    pos = x > 0
    z = (np.log(x[pos]) - math.log(median)) / (sigma * math.sqrt(2.0))
    out[pos] = 0.5 * np.vectorize(math.erfc)(z)
    return out


class KnownDistribution(_Ranked):
    """Hit density under the exact model of ``workload`` (see the module docstring)."""

    name = "known-distribution"

    def __init__(self, workload: SyntheticWorkload) -> None:
        super().__init__()
        w = self._w = workload
        # the typing delay's survival, tabulated on a log grid
        self._log_x = np.log(np.geomspace(1e-3, 1e5, 8192))
        self._s_x = _lognormal_survival(np.exp(self._log_x), w.type_median, w.type_sigma)
        # turns per user: clip(rint(lognormal), 1, turns_max): P(N >= k + 1 | N >= k)
        top = w.turns_max
        n = np.arange(top + 2, dtype=np.float64)
        cdf = 1 - _lognormal_survival(n + 0.5, w.turns_median, w.turns_sigma)
        at_least = np.ones(top + 2)  # P(N >= k)
        at_least[2:] = 1 - cdf[1:-1]
        at_least[top + 1] = 0.0
        before = np.maximum(at_least[:-1], 1e-300)
        self._more = np.where(at_least[:-1] > 0, at_least[1:] / before, 0.0)
        self._seen: dict[str, tuple[float, float, int]] = {}  # last access, reading s, turns

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        self._seen[session] = (
            meta.last_access,
            self._w.read_seconds_per_token * meta.prev_answer_tokens,
            meta.turns,
        )
        if session in self._sizes:
            self.on_admit(session, meta, now)

    def on_remove(self, session: str) -> None:
        super().on_remove(session)
        self._seen.pop(session, None)

    def _survival(self, x: Floats) -> Floats:
        out = np.ones_like(x)
        pos = x > 0
        out[pos] = np.interp(np.log(x[pos]), self._log_x, self._s_x, left=1.0, right=0.0)
        return out

    def scores(self, sessions: list[str], now: float) -> Floats:
        seen = [self._seen[s] for s in sessions]
        typing = now - np.array([r[0] for r in seen]) - np.array([r[1] for r in seen])
        turns = np.minimum(np.array([r[2] for r in seen]), len(self._more) - 1)
        q = self._more[turns]
        s_now = self._survival(typing)
        s_ahead = self._survival(typing[:, None] + HORIZONS[None, 1:])
        sizes = np.array([self._sizes[s] for s in sessions], dtype=np.float64)
        scores: Floats = best_density(q, s_now, s_ahead) / sizes
        return scores


class TraceStatistics(_Ranked):
    """Hit density under the statistics of a whole trace (see the module docstring).

    :param turns: the trace that is replayed
    """

    name = "trace-statistics"

    def __init__(self, turns: Turns) -> None:
        super().__init__()
        order = np.lexsort((turns.time, turns.user))
        user, time = turns.user[order], turns.time[order]
        same = user[1:] == user[:-1]
        self._survival = smoothed_survival((time[1:] - time[:-1])[same])
        """The survival of the gap between two turns, fitted once."""
        # conversations by their number of turns: P(a turn k + 1 | k turns), index k
        lengths = np.bincount(np.unique(turns.user, return_counts=True)[1])
        at_least = np.cumsum(lengths[::-1])[::-1].astype(np.float64)  # with >= k turns
        more = np.zeros(len(at_least) + 1)
        more[: len(at_least) - 1] = at_least[1:] / np.maximum(at_least[:-1], 1.0)
        self.more: Floats = more
        """Per turns so far ``k``, the share of conversations with ``k`` turns that have
        another (0 past the longest)."""
        self._seen: dict[str, tuple[float, int]] = {}  # latest access, turns so far

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        self._seen[session] = (now, meta.turns)
        if session in self._sizes:
            self.on_admit(session, meta, now)

    def on_remove(self, session: str) -> None:
        super().on_remove(session)
        self._seen.pop(session, None)

    def scores(self, sessions: list[str], now: float) -> Floats:
        seen = [self._seen.get(s, (now, 1)) for s in sessions]
        elapsed = now - np.array([r[0] for r in seen])
        s_now = self._survival(elapsed)
        s_ahead = self._survival(elapsed[:, None] + HORIZONS[None, 1:])
        sizes = np.array([self._sizes[s] for s in sessions], dtype=np.float64)
        more = self._chance(sessions, [r[1] for r in seen])
        scores: Floats = best_density(more, s_now, s_ahead) / sizes
        return scores

    def _chance(self, sessions: list[str], turns: list[int]) -> Floats:
        """Per session, the chance of another turn, with ``turns`` turns so far."""
        chance: Floats = self.more[np.minimum(np.array(turns), len(self.more) - 1)]
        return chance


QUERY_EDGES = (0, *DEFAULT_QUERY_EDGES)
"""The buckets of a turn's query tokens (new in its input) for :class:`TraceQueryStatistics`:
the default ``AdaptiveBidaw.query_edges``' classes (under 250, 250-999, 1,000-3,999, 4,000
or more)."""


class TraceQueryStatistics(TraceStatistics):
    """:class:`TraceStatistics` that also knows each turn's query length, the tokens new in
    its input (known when the turn is served; the library's metadata does not carry it):
    the chance of another turn is the whole trace's share, in hindsight, of turns with the
    same turns so far and query bucket (:data:`QUERY_EDGES`) that are followed by another.

    :param turns: the trace that is replayed (its sessions are named ``u<user>``)
    """

    name = "trace-query-statistics"

    def __init__(self, turns: Turns) -> None:
        super().__init__(turns)
        users = turns.user.tolist()
        rounds = turns.round_index.tolist()
        queries = turns.query.tolist()
        last = {user: i for i, user in enumerate(users)}
        width = len(self.more)
        seen = np.zeros((width, len(QUERY_EDGES)))
        followed = np.zeros((width, len(QUERY_EDGES)))
        self._bucket: dict[tuple[str, int], int] = {}
        """Per (session, turns so far), the query bucket of its latest turn."""
        for i, (user, k, query) in enumerate(zip(users, rounds, queries, strict=True)):
            b = bisect.bisect_right(QUERY_EDGES, int(query)) - 1
            self._bucket[(f"u{user}", int(k) + 1)] = b
            row = min(int(k) + 1, width - 1)
            seen[row, b] += 1
            followed[row, b] += last[user] != i
        # (a group with no turn: the turns-so-far share alone)
        self.more_by_query: Floats = np.where(
            seen > 0, followed / np.maximum(seen, 1.0), self.more[:, None]
        )
        """Per turns so far and query bucket, the share followed by another turn."""

    def _chance(self, sessions: list[str], turns: list[int]) -> Floats:
        rows = np.minimum(np.array(turns), len(self.more) - 1)
        buckets = [self._bucket.get((s, k), 0) for s, k in zip(sessions, turns, strict=True)]
        chance: Floats = self.more_by_query[rows, buckets]
        return chance


class LearnedDensity(_Ranked):
    """Hit density under gap distributions learned online (see the module docstring).

    :param depart: seconds without a turn after which a user counts as gone
    :param samples: gap samples kept (all buckets together)
    :param prior: pseudo-samples of the pooled distribution added to each bucket
    :param refresh: accesses between two rebuilds of the tables
    :param hints: rank a hinted turn by its hint (weighed by the share of hints kept)
    """

    name = "learned-density"

    def __init__(
        self,
        *,
        depart: float = 1800.0,
        samples: int = 4096,
        prior: float = 32.0,
        refresh: int = 1024,
        hints: bool = True,
    ) -> None:
        super().__init__()
        self._edges = DEFAULT_ANSWER_EDGES
        self._answers = len(self._edges) + 1
        buckets = 2 * self._answers  # tool-call turns apart
        self._depart = depart
        self._samples: deque[tuple[int, float]] = deque(maxlen=samples)
        self._prior = prior
        self._refresh_every = refresh
        self._hints = hints
        self._returned = np.zeros(buckets)
        self._departed = np.zeros(buckets)
        # session -> (last access, bucket, turns, its access completed a turn)
        self._seen: dict[str, tuple[float, int, int, bool]] = {}
        self._waiting: OrderedDict[str, None] = OrderedDict()  # oldest access first
        self._due: dict[str, tuple[float, float]] = {}  # hinted time, slack
        self._kept = self._told = 0.0
        self._accesses = 0
        self._elapsed_grid: Floats = np.r_[0.0, np.geomspace(0.25, 2 * depart, 96)]
        self._tables: Floats | None = None  # [bucket, elapsed grid point]

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        due = self._due.pop(session, None)
        if due is not None:
            self._kept += abs(now - due[0]) <= due[1]
            self._told += 1.0
        if meta.next_turn is not None:
            slack = max(5.0, 0.25 * max(0.0, meta.next_turn - now))
            self._due[session] = (meta.next_turn, slack)
        answer = bisect.bisect_right(self._edges, meta.prev_answer_tokens)
        bucket = answer + self._answers if meta.tool_call else answer
        old = self._seen.get(session)
        if old is not None and old[3] and meta.turns > old[2] and now - old[0] < self._depart:
            self._samples.append((old[1], now - old[0]))
            self._returned[old[1]] += 1.0
        completed = old is None or meta.turns > old[2]
        self._seen[session] = (now, bucket, meta.turns, completed)
        self._waiting[session] = None
        self._waiting.move_to_end(session)
        while self._waiting:
            oldest = next(iter(self._waiting))
            last, b, _, _ = self._seen[oldest]
            if now - last < self._depart:
                break
            del self._waiting[oldest]
            self._departed[b] += 1.0
            self._due.pop(oldest, None)
            if oldest not in self._sizes:
                del self._seen[oldest]
        if session in self._sizes:
            self.on_admit(session, meta, now)
        self._accesses += 1
        n = self._accesses
        if n % self._refresh_every == 0 or (64 <= n < self._refresh_every and n & (n - 1) == 0):
            self._refresh()

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        if session not in self._seen:
            answer = bisect.bisect_right(self._edges, meta.prev_answer_tokens)
            self._seen[session] = (now, answer, meta.turns, False)
        super().on_admit(session, meta, now)

    def on_remove(self, session: str) -> None:
        super().on_remove(session)
        if session not in self._waiting:
            self._seen.pop(session, None)

    def _refresh(self) -> None:
        if not self._samples:
            return
        pairs = np.array(self._samples, dtype=np.float64)
        labels = pairs[:, 0].astype(np.int64)
        gaps = pairs[:, 1]
        pooled = np.sort(gaps)
        grid = self._elapsed_grid
        ahead = grid[:, None] + HORIZONS[None, 1:]

        returned, departed = self._returned, self._departed
        p_prior = (returned.sum() + 1.0) / (returned.sum() + departed.sum() + 1.0)
        rows = []
        for b in range(len(returned)):
            mine = np.sort(gaps[labels == b])
            total = len(mine) + self._prior

            def s(x: Floats, mine: Floats = mine, total: float = total) -> Floats:
                mixed: Floats = (
                    beyond(mine, x) + self._prior * beyond(pooled, x) / len(pooled)
                ) / total
                return mixed

            q = (returned[b] + self._prior * p_prior) / (returned[b] + departed[b] + self._prior)
            rows.append(best_density(np.full(len(grid), q), s(grid), s(ahead)))
        self._tables = np.array(rows)
        decay = 0.5 ** (self._refresh_every / (self._samples.maxlen or 1))
        self._returned *= decay
        self._departed *= decay

    def hint_trust(self) -> float:
        """The share of hinted turns that came on time, with four pseudo-hints kept."""
        return (self._kept + 4.0) / (self._told + 4.0)

    def scores(self, sessions: list[str], now: float) -> Floats:
        seen = [self._seen[s] for s in sessions]
        last = np.array([r[0] for r in seen])
        sizes = np.array([self._sizes[s] for s in sessions], dtype=np.float64)
        tables = self._tables
        if tables is None:  # nothing learned yet: least recently used first
            lru: Floats = last - now
            return lru
        grid = self._elapsed_grid
        at = np.clip(np.searchsorted(grid, now - last, side="right") - 1, 0, len(grid) - 1)
        density: Floats = tables[np.array([r[1] for r in seen]), at]
        if self._hints and self._due:
            trust = self.hint_trust()
            for i, session in enumerate(sessions):
                due = self._due.get(session)
                if due is not None and due[0] + due[1] >= now:  # one hit in the time left
                    hinted = 1.0 / max(due[0] - now, 0.25)
                    density[i] = trust * hinted + (1 - trust) * density[i]
        scores: Floats = density / sizes
        return scores
