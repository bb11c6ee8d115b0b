"""Bidaw's eviction, beyond the paper: the next access predicted from the caller's hint,
the previous answer's length and whether the answer was a tool call."""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence, Set

import numpy as np
import numpy.typing as npt

from ..meta import KVMeta, MetadataView
from ._hit_density import HORIZONS, best_density, beyond, smoothed_survival
from .base import shielded, stored_share
from .bidaw_eviction import DEFAULT_ANSWER_EDGES, BidawEviction, _rises, _Seen, _unimodal
from .ghost import GhostCache
from .ranking import RESCORE_BINS, ResidentRanking

__all__ = [
    "DEFAULT_HINT_EDGES",
    "DEFAULT_QUERY_EDGES",
    "DEFAULT_TURN_EDGES",
    "SMOOTH_FROM",
    "AdaptiveBidaw",
]

DEFAULT_HINT_EDGES: tuple[float, ...] = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Upper edges (exclusive, seconds) of the classes of hinted gaps; one more class takes
every longer hint."""

DEFAULT_TURN_EDGES: tuple[int, ...] = (1, 3)
"""Upper edges (inclusive, turns stored) of the classes of a person's conversation by its
turns so far: 1, 2-3, and one more class for longer ones."""

DEFAULT_QUERY_EDGES: tuple[int, ...] = (250, 1000, 4000)
"""Upper edges (exclusive, tokens) of the classes of a person's latest turn by its new
input (``meta.turn_tokens - meta.prev_answer_tokens``): under 250, 250-999, 1,000-3,999
and 4,000 or more."""

_POTENTIAL, _DENSITY, _AUTO = "potential", "density", "auto"
_RANKINGS = (_AUTO, _POTENTIAL, _DENSITY)
_PRIORITY_SPAN = 4  # priorities are clamped to [-4, 4]: a factor of 16 either way
_LEARNED, _RECENCY = "learned", "recency"
_MAX_BACKOFF = 16  # a losing trial doubles the wait for the next, up to 16 duel_retry
_DELAY_POINTS = 400  # points of the delay grid on either side of 0
SMOOTH_FROM = 1024
"""Gaps of persons' turns the window holds before their delays are smoothed: with fewer,
the smoothed table measured 0.5-2.4 points below the empirical one on the forest
simulator's shared prompt (200 users, seeds 0-2), and with this gate within 0.4 either
way (``docs/explanation/bidaw-eviction.md``, "A smoothed delay distribution")."""
_TRUST_PRIOR = 4.0  # pseudo-hints kept on time: a caller's hints are trusted until shown wrong
# Deadlines moved from the previous heap per hint: set aside when it holds twice the hints
# outstanding, it is empty before the new heap holds 1.5 times them.
_DRAIN_STEPS = 4


class AdaptiveBidaw(BidawEviction):
    """Evict the conversation least likely to be a hit, predicting its next access from
    what the cache learns online of *each kind* of turn.

    The paper's policy (:class:`~tieredkv.policies.BidawEviction`, ``"bidaw-paper"``)
    learns the distribution of the weighted reuse distance per previous-answer-length
    bucket: a person reads a long answer longer. That signal is void when an agent makes
    the call: after a tool call the conversation is back when the tool returns, seconds or
    minutes later whatever the answer's length, and a human's short answer and an agent's
    tool call of the same length land in one bucket whose distribution is neither. This
    policy learns over finer buckets:

    - a turn that ended in a tool call (``meta.tool_call``) is learned apart from one that
      did not, per answer-length bucket (the tool-call buckets simply find no signal in
      the length, and the elapsed time separates a quick tool from a slow one: once a
      quick tool would be back, the conversation's density falls);
    - a turn whose caller hinted when the next one comes (``meta.next_turn``) is learned by
      the class of the hinted gap (``hint_edges``, seconds, doubling): the cache does not
      take a hint at its word, it learns what the gap *is* after a hint of that size.
      Correct hints give each class a tight distribution (close to Belady's foresight);
      wrong hints give every class the same broad one, and the policy ranks as if there
      were no hint (the answer length of a hinted turn is not used: a caller that
      hints runs tools, where it carries no signal);
    - a caller's ``meta.priority`` scales the score by ``2 ** priority`` (clamped to
      [-4, 4]): advice, weighed against the prediction.

    A hint given between accesses (:meth:`on_hint`) moves the session to the bucket of the
    new hint.

    **How it ranks.** Two rankings are learned side by side. The *hit potential*
    (``ranking="potential"``) is the paper policy's hit potential per byte, learned from
    reuse distances in bytes of traffic; for a tool-call or hinted turn, times ``C`` over
    its expected occupancy (``E[min(R, C)]``, the remaining distance ``R`` in bins from the
    same distribution). The *hit density in time* (``ranking="density"``, below) learns
    the gaps in seconds. By default (``ranking="auto"``) they duel: the tier evicts by one
    (:attr:`order`, the potential first) and a shadow cache of the same capacity (session
    sizes, no data) evicts by the other, over the same accesses. At every returning
    access, the shadow's hit counts +1 and the tier's -1 in a lead decayed with a half-life
    of ``rival_half_life`` returning accesses (every return after a completed turn that
    either ranking still tracks; and bounded below by ``-rival_margin``);
    when it reaches ``rival_margin`` the two swap (the shadow then evicts by the ranking
    the tier left). Neither ranking wins everywhere: the density in time where a user's
    gap is long against the traffic (people reading, slow tools), the potential where
    most conversations never come back and nothing is gone for long enough in seconds to
    count as gone (the Mooncake trace's head).

    **Hit density in time** (``ranking="density"``). It learns per bucket the gap in
    *seconds* from an access that completed a turn to the session's next access (the last
    ``samples`` gaps, all buckets together, sparse buckets drawing on the pooled ones with
    ``prior_weight`` pseudo-samples), and the share of sessions that come back at all (a
    session without an access for ``depart`` seconds counts as gone; decayed at the pace of
    the sample window). A person's gap (a turn of an answer bucket) is learned as reading
    time plus a delay: :attr:`read_rate` seconds per token of the previous answer (the
    least-squares slope of the answer buckets' gaps over their answers' lengths) and one
    distribution of the delay past it, pooled over the answer buckets, with a chance of
    coming back per class of turns so far and of the latest turn's new input
    (``turn_edges``, ``query_edges``: :meth:`reader_class`; residents are grouped by it
    too); each session is then placed on it by its own reading time, not by its
    bucket's spread of gaps. A resident is ranked by its
    best *hit density*: over every horizon it could still be kept (0.25 s to 2 h), the
    chance that its next turn comes within it, given the seconds already elapsed since its
    latest access, over the seconds it is expected to hold its bytes meanwhile (after LHD:
    Beckmann, Chen and Cidon, NSDI '18), per byte of what removing it frees
    (``size_aware``); the lowest goes first. The density depends only on (bucket, elapsed
    seconds), for a person on the delay elapsed past the reading time, so it is tabulated
    at every refresh (on 97 elapsed times up to ``2 * depart``, a person's on 799 delays
    from ``-2 * depart`` to ``2 * depart``; made unimodal), and residents are ranked with
    the paper policy's grouped :class:`~tieredkv.policies.ranking.ResidentRanking`: within
    a bucket the oldest access has the longest elapsed time, so a bucket's lowest score is
    at one of its ends (for persons up to the spread of reading times within the bucket,
    as it is up to the spread of sizes within a size class). Time comes only from the
    calls' ``now``. Before the first gap is learned, the order is the paper's. The reuse
    distances, departures and hit potential are still learned: they are what
    :meth:`foresee` (predictive prefetch) reads.

    **Prefetch on a hint.** Predictive prefetch
    (:meth:`tieredkv.TieredKVCache.prefetch_predicted`) asks :meth:`foresee_at` how likely
    each session on a lower tier is to be a hit if brought up now. A session whose caller
    said when its next turn comes, and which is due within ``hint_lead`` seconds (or late
    by less than the slack it is judged with), gets the chance that a hint is kept: the
    share of hinted turns that came back on time (within ``hint_slack`` seconds or a
    quarter of the hinted gap of the hinted time), learned online, with a prior of
    trust (four pseudo-hints kept). So a correctly hinting caller's conversation comes up
    from SSD or Redis just before its turn, first among the candidates; a caller whose
    hints are wrong soon gets nothing from them. Other sessions get the learned potential
    (:meth:`foresee`). Pins are honoured as by every policy (never a victim while pinned).
    Where no turn ends in a tool call and no caller hints, the buckets are the paper's and,
    with ``ranking="potential"`` (or ``"auto"`` while the potential keeps the tier), so
    are the decisions.

    **A duel with LRU.** Where nothing the policy conditions on predicts the gap, a learned
    order can lose to recency. The policy keeps a shadow LRU cache of the same capacity
    (session -> bytes, no data) and counts, at every returning access, its own hits and the
    shadow's. Every ``duel_block`` returning accesses it compares the two: if recency hit
    more (by ``duel_margin`` of the block) two blocks in a row, it evicts in LRU order;
    from there it tries its learned order again after ``duel_retry`` blocks, for one block,
    and keeps it unless recency wins that block; each lost trial doubles the wait before
    the next one (up to 16 times ``duel_retry``), a won one resets it. :attr:`mode` says
    which order is in use; the duel of the two rankings pauses while it is LRU's.

    :param hint_edges: upper edges of the hinted-gap classes, seconds, increasing
    :param turn_edges: with ``ranking="density"`` or ``"auto"``: upper edges (inclusive)
        of the classes of turns so far (``meta.turns``) by which a person's chance of
        coming back is learned (a conversation that has come back is likelier to come
        back again: on the Mooncake conversation trace 25% of first turns have a next
        one, 50% of third ones); ``()`` pools every turn
    :param query_edges: with ``ranking="density"`` or ``"auto"``: upper edges
        (exclusive, tokens) of the classes of the latest turn's new input
        (``meta.turn_tokens - meta.prev_answer_tokens``), which split each class of turns
        so far (on the Mooncake trace a later turn that adds under 500 tokens has a next
        one 57% of the time, one that adds 2,000 or more 13-21%); ``()`` pools every input
    :param samples: distance samples kept (all buckets together; more buckets than the
        paper's, so more samples by default)
    :param duel_block: returning accesses per comparison with the shadow LRU
    :param duel_margin: fraction of a block by which LRU must hit more to take over
    :param duel_retry: blocks in LRU order between two trials of the learned order
    :param hint_lead: seconds before a hinted turn from which prefetch prefers the session
    :param hint_slack: seconds by which a turn may miss its hinted time and still count as
        on time (or a quarter of the hinted gap, if more)
    :param depart: with ``ranking="density"`` or ``"auto"``, seconds without an access
        after which a session counts as gone (its user left); gaps are learned up to there
    :param ranking: ``"auto"`` (the two below, dueling), ``"potential"`` (hit potential
        in bytes of traffic) or ``"density"`` (hit density in seconds)
    :param rival_margin: with ``"auto"``, the decayed lead in hits at which the shadow's
        ranking takes the tier
    :param rival_half_life: with ``"auto"``, returning accesses over which the lead halves
    :param read_prior: an answer bucket's prior (its ``prior_weight`` pseudo-samples) is
        the answer buckets' reuse distances moved to its answer's length (a longer answer,
        a longer read: :meth:`_prior`), not their pooled distribution as is
    :param smooth_delays: with the density ranking, once the window holds
        :data:`SMOOTH_FROM` gaps of persons' turns, smooth the distribution of their delay
        past the reading time by a kernel in log scale before tabulating it
        (:func:`~tieredkv.policies._hit_density.smoothed_survival`; ``False``: the
        empirical distribution, as before 5 December 2026). See
        ``docs/explanation/bidaw-eviction.md``, "A smoothed delay distribution"

    The other parameters are :class:`~tieredkv.policies.BidawEviction`'s.
    """

    name = "bidaw"

    def __init__(
        self,
        capacity: int | None = None,
        *,
        answer_edges: Sequence[int] = DEFAULT_ANSWER_EDGES,
        hint_edges: Sequence[float] = DEFAULT_HINT_EDGES,
        turn_edges: Sequence[int] = DEFAULT_TURN_EDGES,
        query_edges: Sequence[int] = DEFAULT_QUERY_EDGES,
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
        duel_block: int = 1024,
        duel_margin: float = 0.02,
        duel_retry: int = 4,
        hint_lead: float = 30.0,
        hint_slack: float = 5.0,
        depart: float = 600.0,
        ranking: str = _AUTO,
        rival_margin: float = 16.0,
        rival_half_life: int = 512,
        read_prior: bool = True,
        smooth_delays: bool = True,
    ) -> None:
        if ranking not in _RANKINGS:
            raise ValueError(f"ranking must be one of {_RANKINGS} (got {ranking!r})")
        if not (0 < rival_margin < math.inf and rival_half_life >= 1):
            raise ValueError(
                f"rival_margin must be a finite number > 0 and rival_half_life >= 1 "
                f"(got {rival_margin}, {rival_half_life})"
            )
        self.ranking = ranking
        self.order = _DENSITY if ranking == _DENSITY else _POTENTIAL
        """The ranking in use: ``"potential"`` or ``"density"`` (with ``ranking="auto"``,
        whichever the duel of the two rankings last chose)."""
        self.rival_margin = float(rival_margin)
        self._rival_decay = 0.5 ** (1.0 / rival_half_life)
        self._lead = 0.0  # decayed hits of the rival ranking's shadow over the tier's own
        self.switches = 0
        """How many times the duel of the rankings changed :attr:`order`."""
        # the shadow of the ranking not in use (``ranking="auto"``): session -> bytes, and
        # session -> (bucket, rank key, group, latest access)
        self._rival = (
            ResidentRanking(self._rival_score, size_aware=size_aware) if ranking == _AUTO else None
        )
        self._rival_size: dict[str, int] = {}
        self._rival_seen: dict[str, tuple[int, int, int, float]] = {}
        self._rival_bytes = 0
        if not 0 < depart < math.inf:
            raise ValueError(f"depart must be a finite number of seconds > 0 (got {depart})")
        self.depart = float(depart)
        # gaps in seconds: (bucket, gap) samples, returns and departures per bucket
        # (bucket, previous answer's tokens, gap) samples, returns and departures per bucket
        self._gaps: deque[tuple[int, int, float]] = deque(maxlen=samples)
        self._clock: dict[str, float] = {}  # session -> its latest access (or admission)
        # session -> the answer tokens its reading time is learned from (answer buckets)
        self._answer: dict[str, int] = {}
        # sessions within ``depart`` of their latest access, oldest first: (bucket, turns,
        # that access completed a turn, its reader class)
        self._waiting: OrderedDict[str, tuple[int, int, bool, int]] = OrderedDict()
        self._grid: list[float] = [0.0, *np.geomspace(0.25, 2 * depart, 96).tolist()]
        # the answer buckets' table is by the delay elapsed past the reading time, which is
        # negative while the user is still reading (finer: every session is shifted by its
        # own reading time, so the table is read between the buckets' coarse steps)
        ahead = np.geomspace(0.05, 2 * depart, _DELAY_POINTS)
        self._delay_grid: list[float] = [*(-ahead[::-1][:-1]), 0.0, *ahead.tolist()]
        self.read_rate = 0.0
        """Seconds of reading per token of the previous answer, learned online (the slope
        of the gap over the answer's length, at least 0)."""
        self._density: list[list[float]] | None = None  # [bucket][elapsed grid point]
        self._reading = False  # the answer buckets' tables are on the delay grid
        if duel_block < 1 or duel_retry < 1 or not 0 <= duel_margin < 1:
            raise ValueError("duel_block and duel_retry must be >= 1, duel_margin in [0, 1)")
        if not (0 <= hint_lead < math.inf and 0 <= hint_slack < math.inf):
            raise ValueError(
                f"hint_lead and hint_slack must be finite seconds >= 0 "
                f"(got {hint_lead}, {hint_slack})"
            )
        self.hint_lead = float(hint_lead)
        self.hint_slack = float(hint_slack)
        self._now = -math.inf  # the latest time a notification brought
        self._due: dict[str, tuple[float, float]] = {}  # session -> (hinted time, slack)
        self._deadlines: list[tuple[float, str]] = []  # (hinted time + slack, session)
        # the previous heap of deadlines, its live ones moved over a few per hint
        self._draining: list[tuple[float, str]] = []
        self._kept = 0.0  # hinted turns back on time (decayed)
        self._told = 0.0  # hinted turns judged (decayed)
        self.duel_block = duel_block
        self.duel_margin = duel_margin
        self.duel_retry = duel_retry
        self.mode = _LEARNED
        """Which order evicts now: ``"learned"`` (hit potential) or ``"recency"`` (LRU)."""
        self._recency: OrderedDict[str, None] = OrderedDict()  # residents, LRU first
        self._shadow: OrderedDict[str, int] = OrderedDict()  # the shadow LRU: session -> bytes
        self._shadow_bytes = 0
        self._duel = [0, 0, 0]  # returning accesses, own hits, shadow hits (this block)
        self._blocks_in_recency = 0
        self._behind = False  # the learned order lost the latest block
        self._trial = False  # the latest block in the learned order was a trial
        self._retry = duel_retry  # blocks in LRU order before the next trial
        self._fresh: set[str] = set()  # admitted without an access since their latest one
        self._just_accessed: str | None = None
        turn_classes = tuple(int(t) for t in turn_edges)
        if not _rises(turn_classes) or (turn_classes and turn_classes[0] < 1):
            raise ValueError(
                f"turn_edges must be turn counts >= 1 that increase strictly (got {turn_classes})"
            )
        self.turn_edges = turn_classes
        self._turn_classes = len(turn_classes) + 1
        queries = tuple(int(q) for q in query_edges)
        if not _rises(queries) or (queries and queries[0] < 1):
            raise ValueError(
                f"query_edges must be token counts >= 1 that increase strictly (got {queries})"
            )
        self.query_edges = queries
        self._reader_classes = self._turn_classes * (len(queries) + 1)
        # a person's turns (the answer buckets) per reader class: came back, gone
        self._r_returned = [0.0] * self._reader_classes
        self._r_departed = [0.0] * self._reader_classes
        self._reader_rows: list[list[float]] = []  # [reader class][delay grid point]
        hints = tuple(float(h) for h in hint_edges)
        if not _rises(hints) or (hints and hints[0] <= 0):
            raise ValueError(f"hint_edges must be positive and increase strictly (got {hints})")
        self.hint_edges = hints
        self._answer_buckets = len(tuple(answer_edges)) + 1
        self.read_prior = read_prior
        self.smooth_delays = bool(smooth_delays)
        # per answer bucket: the previous answers' tokens seen there, summed, and how many
        self._answer_tokens = [0.0] * self._answer_buckets
        self._answer_seen = [0] * self._answer_buckets
        self._dense: list[list[float]] | None = None  # the tool and hint buckets' scores
        buckets = self._bucket_count(self._answer_buckets)
        self._t_returned = [0.0] * buckets
        self._t_departed = [0.0] * buckets
        super().__init__(
            capacity,
            answer_edges=answer_edges,
            promising=promising,
            span=span,
            bins_per_capacity=bins_per_capacity,
            horizon=horizon,
            samples=samples,
            prior_weight=prior_weight,
            refresh_every=refresh_every,
            max_tracked=max_tracked,
            size_aware=size_aware,
            ghost=ghost,
        )

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        self._tick(now)
        due = self._due.pop(session, None)
        if due is not None:
            self._judge(abs(now - due[0]) <= due[1])
        self._expect(session, meta)
        came_back = self._learn_gap(session, meta, now) if self.ranking != _POTENTIAL else False
        seen = self._seen.get(session)
        # a return after a completed turn: as the potential tracks it, or (forgotten by
        # the potential past its horizon in bytes of traffic) within ``depart`` seconds
        if (seen.completing if seen is not None else came_back) and self._capacity:
            # a hit: resident since before this access (a miss promoted just before its
            # access is notified, as the live cache does, is still a miss)
            own = session in self._resident and session not in self._fresh
            if seen is not None and not seen.overdue:
                self._score_duel(own, session in self._shadow)
            if self._rival is not None and self.mode == _LEARNED:
                self._score_rivals(own, session in self._rival_size)
        self._fresh.discard(session)
        self._just_accessed = session
        bucket = self._bucket(meta, now)
        if bucket < self._answer_buckets:
            self._answer_tokens[bucket] += meta.prev_answer_tokens
            self._answer_seen[bucket] += 1
        weight = stored_share(meta)
        self._shadow_access(session, weight)
        if session in self._recency:
            self._recency.move_to_end(session)
        super().on_access(session, meta, now)
        if self._rival is not None:
            self._rival_access(session, weight, now)

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        self._now = max(self._now, now)
        if session not in self._resident and session != self._just_accessed:
            self._fresh.add(session)  # came in without an access (a promotion)
        self._clock.setdefault(session, now)
        super().on_admit(session, meta, now)
        self._recency[session] = None
        self._recency.move_to_end(session)

    def on_remove(self, session: str) -> None:
        self._recency.pop(session, None)
        self._fresh.discard(session)
        if session not in self._waiting:
            self._clock.pop(session, None)
            self._answer.pop(session, None)
        super().on_remove(session)

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        """As the potential (or, while it learns, recency) ranks them; but a resident
        brought up ahead of a hinted turn now due, for that hint, is passed over while
        others free enough (:meth:`kept_for_hint`)."""
        self._now = max(self._now, now)
        kept = self.kept_for_hint(now)
        if kept:
            chosen = self._victims(need, now, view, protected | kept)
            if chosen is not None:
                return chosen
        return self._victims(need, now, view, protected)

    def kept_for_hint(self, now: float) -> frozenset[str]:
        """The residents a prefetch brought up (admitted without an access since their
        latest one) whose hinted turn is due at ``now`` and whose hint is worth more than
        their potential (:meth:`foresee_at` chose them for it). Without this, the next
        turn of another user would evict such a conversation again at once (its learned
        potential is low), before the turn it was brought up for."""
        if not self._fresh:
            return frozenset()
        trust = self.hint_trust()
        kept = set()
        for session in self._fresh:
            if self._hint_due(session, now) and trust > (super().foresee(session) or 0.0):
                kept.add(session)
        return frozenset(kept)

    def _victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str]
    ) -> list[str] | None:
        if self.mode == _LEARNED or need <= 0:
            return super().victims(need, now, view, protected)
        if self._capacity is None:
            tiers = view.tiers
            self._set_capacity(tiers[0].capacity if tiers else max(self._bytes, 1))
        protected = shielded(protected, view, now)
        chosen: list[str] = []
        freed = 0
        sizes = self._resident
        for session in self._recency:
            if freed >= need:
                break
            if session not in protected:
                chosen.append(session)
                freed += sizes[session]
        return chosen if freed >= need else None

    def on_hint(self, session: str, meta: KVMeta, now: float) -> None:
        """A caller's hint changed between accesses: re-bucket and re-rank the session."""
        self._tick(now)
        self._expect(session, meta)
        seen = self._seen.get(session)
        if seen is None:
            return  # never accessed: its first access will read the hint
        bucket = self._bucket(meta, now)
        rank = self._rank_key_of(bucket, meta)
        if bucket == seen.bucket and rank == seen.rank:
            return
        waiting = self._waiting.get(session)
        if waiting is not None:
            self._waiting[session] = (bucket, *waiting[1:])
        seen.bucket = bucket
        seen.rank = rank
        size = self._resident.get(session)
        if size is not None:
            self._place(session, seen, size)
            self._flush()
        rival = self._rival
        entry = self._rival_seen.get(session)
        if rival is not None and entry is not None:
            size = self._rival_size[session]
            group = rival.place(session, entry[2], rank, size)
            self._rival_seen[session] = (bucket, rank, group, entry[3])
            rival.flush()

    def foresee(self, session: str) -> float | None:
        """:meth:`foresee_at` at the latest time the policy was told of."""
        return self.foresee_at(session, self._now)

    def foresee_at(self, session: str, now: float) -> float | None:
        """The chance that ``session``'s next access is a hit if its KV were in this tier at
        ``now``: for a session whose hinted turn is due (within ``hint_lead`` seconds, or
        late by less than its slack), the learned chance that a hint is kept (or the
        potential, if higher); for any other, the learned potential
        (:meth:`~tieredkv.policies.BidawEviction.foresee`)."""
        base = super().foresee(session)
        if not self._hint_due(session, now):
            return base
        return max(base or 0.0, self.hint_trust())

    def _hint_due(self, session: str, now: float) -> bool:
        """Whether ``session``'s hinted turn is due at ``now``: within :attr:`hint_lead`
        seconds, or late by less than its slack."""
        due = self._due.get(session)
        return due is not None and due[0] - self.hint_lead <= now <= due[0] + due[1]

    def hint_trust(self) -> float:
        """The share of hinted turns that came back on time, learned online (decayed at
        the pace of the sample window), with a prior of four pseudo-hints kept."""
        return (self._kept + _TRUST_PRIOR) / (self._told + _TRUST_PRIOR)

    def shadow_sessions(self) -> list[str]:
        """The sessions the shadow LRU holds, least recently used first (each sized by its
        share of the stored bytes, :func:`~tieredkv.policies.base.stored_share`: a range
        shared by many conversations counts once in all, as in the tier)."""
        return list(self._shadow)

    def rival_sessions(self) -> list[str]:
        """With ``ranking="auto"``: the sessions the shadow of the ranking not in use
        holds (each sized by its share of the stored bytes), in no particular order."""
        return list(self._rival_size)

    def density(self, bucket: int) -> list[float] | None:
        """Hit density (hits per second of keeping a conversation, before its size) for one
        bucket at :meth:`density_grid`'s points, as last refreshed; ``None`` before the
        first gap in seconds is learned."""
        return None if self._density is None else list(self._density[bucket])

    def density_grid(self, bucket: int) -> list[float]:
        """The points ``bucket``'s density table is tabulated at: for an answer bucket
        (once a reading rate is fitted), the seconds elapsed past the session's reading
        time (:attr:`read_rate` times its previous answer's tokens; negative while its
        user still reads); for any other, the seconds elapsed since its latest access."""
        if bucket < self._answer_buckets and self._reading:
            return list(self._delay_grid)
        return list(self._grid)

    def observed_seconds(self, bucket: int) -> list[float]:
        """Gaps (seconds) in the sample window observed after turns of ``bucket``, oldest
        first."""
        return [g for b, _, g in self._gaps if b == bucket]

    def kind_of(self, bucket: int) -> str:
        """What a bucket holds: ``"answer"``, ``"tool"`` or ``"hint"``."""
        if bucket < self._answer_buckets:
            return "answer"
        return "tool" if bucket < 2 * self._answer_buckets else "hint"

    # -- hints kept or not ----------------------------------------------------------------
    def _expect(self, session: str, meta: KVMeta) -> None:
        """Remember when ``session``'s caller says its next turn comes (if it says)."""
        if meta.next_turn is None:
            self._due.pop(session, None)
            return
        slack = max(self.hint_slack, 0.25 * max(0.0, meta.next_turn - meta.last_access))
        due = self._due
        due[session] = (meta.next_turn, slack)
        deadlines = self._deadlines
        heapq.heappush(deadlines, (meta.next_turn + slack, session))
        draining = self._draining
        if draining:  # move a few live deadlines over, drop the superseded ones
            for _ in range(_DRAIN_STEPS):
                if not draining:
                    break
                until, other = draining.pop()  # (the last entry: the rest stays a heap)
                if self._current(until, other):
                    heapq.heappush(deadlines, (until, other))
        elif len(deadlines) > 2 * len(due) + 64:
            # superseded hints make up half the heap: a new one takes the hints from now
            # on, and the live deadlines of this one, a few per hint (at once, all of them
            # took 60-110 ms at 100k hints outstanding)
            self._draining, self._deadlines = deadlines, []

    def _judge(self, kept: bool) -> None:
        decay = 0.5 ** (1.0 / self.samples)
        self._kept = self._kept * decay + kept
        self._told = self._told * decay + 1.0

    def _tick(self, now: float) -> None:
        """Advance the time; a hinted turn whose slack has run out without it was not kept."""
        self._now = max(self._now, now)
        for deadlines in (self._deadlines, self._draining):
            while deadlines and deadlines[0][0] < now:
                until, session = heapq.heappop(deadlines)
                if self._current(until, session):
                    del self._due[session]
                    self._judge(False)

    def _current(self, until: float, session: str) -> bool:
        """Whether a deadline ``until`` of ``session`` in a heap is its outstanding hint's
        (not one a later hint superseded, nor one judged already)."""
        entry = self._due.get(session)
        return entry is not None and entry[0] + entry[1] == until

    # -- the duel with LRU ---------------------------------------------------------------
    def _shadow_access(self, session: str, nbytes: int) -> None:
        shadow = self._shadow
        self._shadow_bytes += nbytes - shadow.get(session, 0)
        shadow[session] = nbytes
        shadow.move_to_end(session)
        capacity = self._capacity
        if capacity is None:
            return
        while self._shadow_bytes > capacity and shadow:
            self._shadow_bytes -= shadow.popitem(last=False)[1]

    def _score_duel(self, own_hit: bool, shadow_hit: bool) -> None:
        duel = self._duel
        duel[0] += 1
        duel[1] += own_hit
        duel[2] += shadow_hit
        if duel[0] < self.duel_block:
            return
        accesses, own, lru = duel
        self._duel = [0, 0, 0]
        if self.mode == _LEARNED:
            behind = lru - own > self.duel_margin * accesses
            # two blocks in a row (one may be noise, or the tier still filling); a trial
            # block lost is enough, and the next trial waits twice as long
            if behind and (self._behind or self._trial):
                self.mode = _RECENCY
                self._blocks_in_recency = 0
                if self._trial:
                    self._retry = min(2 * self._retry, _MAX_BACKOFF * self.duel_retry)
            elif self._trial:
                self._retry = self.duel_retry
            self._trial = False
            self._behind = behind
            return
        self._blocks_in_recency += 1
        if self._blocks_in_recency >= self._retry:
            self.mode = _LEARNED  # a trial block: kept unless LRU wins it
            self._trial = True

    # -- the finer buckets --------------------------------------------------------------
    def _bucket_count(self, answer_buckets: int) -> int:
        return 2 * answer_buckets + len(self.hint_edges) + 1

    def _bucket(self, meta: KVMeta, now: float) -> int:
        if meta.next_turn is not None:
            gap = max(0.0, meta.next_turn - meta.last_access)
            return 2 * self._answer_buckets + bisect.bisect_right(self.hint_edges, gap)
        answer = bisect.bisect_right(self.answer_edges, meta.prev_answer_tokens)
        return answer + self._answer_buckets if meta.tool_call else answer

    def _rank_key(self, seen: _Seen, meta: KVMeta) -> int:
        return self._rank_key_of(seen.bucket, meta)

    def _rank_key_of(self, bucket: int, meta: KVMeta) -> int:
        """``bucket``, and above it a person's reader class (its chance of coming back,
        :meth:`reader_class`) and the caller's priority: residents are grouped by it."""
        priority = max(-_PRIORITY_SPAN, min(_PRIORITY_SPAN, meta.priority))
        reader = self.reader_class(meta) if bucket < self._answer_buckets else 0
        level = 0 if priority == 0 else priority + _PRIORITY_SPAN + 1
        return bucket + self._buckets * (reader + self._reader_classes * level)

    def turn_class(self, turns: int) -> int:
        """The class of a conversation with ``turns`` turns stored (:attr:`turn_edges`)."""
        return bisect.bisect_left(self.turn_edges, turns)

    def query_class(self, meta: KVMeta) -> int:
        """The class of the latest turn's new input, ``turn_tokens - prev_answer_tokens``
        (:attr:`query_edges`; an unknown one, 0 tokens, is in the first)."""
        return bisect.bisect_right(self.query_edges, meta.turn_tokens - meta.prev_answer_tokens)

    def reader_class(self, meta: KVMeta) -> int:
        """A person's class by its turns so far and its latest turn's new input: its
        chance of another turn is learned per class."""
        return self.turn_class(meta.turns) + self._turn_classes * self.query_class(meta)

    # -- gaps in seconds, hit density --------------------------------------------------
    def _learn_gap(self, session: str, meta: KVMeta, now: float) -> bool:
        """Take the gap (seconds) since ``session``'s previous access if that access
        completed a turn, and count the users gone ``depart`` seconds without a turn;
        whether this access is such a return."""
        bucket = self._bucket(meta, now)
        old = self._waiting.pop(session, None)
        if old is not None and old[2]:
            last = self._clock[session]
            self._gaps.append((old[0], self._answer[session], now - last))
            self._t_returned[old[0]] += 1.0
            if old[0] < self._answer_buckets:
                self._r_returned[old[3]] += 1.0
        completed = old is None or meta.turns > old[1]
        self._clock[session] = now
        self._answer[session] = meta.prev_answer_tokens if bucket < self._answer_buckets else 0
        waiting = self._waiting
        waiting[session] = (bucket, meta.turns, completed, self.reader_class(meta))
        clock, resident, horizon = self._clock, self._resident, now - self.depart
        while waiting:
            oldest = next(iter(waiting))
            if clock[oldest] > horizon:
                break
            gone = waiting.popitem(last=False)[1]
            self._t_departed[gone[0]] += 1.0
            if gone[0] < self._answer_buckets:
                self._r_departed[gone[3]] += 1.0
            if oldest not in resident:
                del clock[oldest]
                self._answer.pop(oldest, None)
        return old is not None and old[2]

    def typical_answer(self, bucket: int) -> float:
        """The previous answer's tokens typical of answer bucket ``bucket``: the mean of
        those seen there, else the middle of its edges (the last bucket: 1.5 times its
        lower edge)."""
        seen = self._answer_seen[bucket]
        if seen:
            return self._answer_tokens[bucket] / seen
        edges = (0, *self.answer_edges)
        if bucket + 1 < len(edges):
            return (edges[bucket] + edges[bucket + 1]) / 2
        return 1.5 * edges[-1]

    def _prior(
        self, samples: npt.NDArray[np.float64], pooled: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]:
        """With ``read_prior``, an answer bucket's pseudo-samples are the answer buckets'
        distances, each moved by the reading its answer calls for: a distance is fitted
        as ``read * answer + rest`` (least squares over the answer buckets' samples, each
        at its bucket's :meth:`typical_answer`; ``read`` at least 0), and bucket ``b``'s
        prior is the distribution of ``read * typical_answer(b) + rest`` over the samples
        (where the distances do not grow with the answer, ``read`` is 0 and every answer
        bucket's prior is the pooled distribution, as the paper's).
        A bucket with few samples of its own is then placed by its answer's length from
        the first samples of any bucket on (the paper's premise: a longer answer, a longer
        read before the next turn), where the pooled prior gives every bucket the same
        distribution; its own samples replace the prior as they come. The other buckets
        (tool calls, hints) keep the pooled prior."""
        readers = self._answer_buckets
        labels = samples[:, 0].astype(np.int64)
        read = labels < readers
        if not self.read_prior or read.sum() < 2:
            return pooled
        typical = np.array([self.typical_answer(b) for b in range(readers)])
        answers = typical[labels[read]]
        distances = samples[read, 1]
        rate = _rising_slope(answers, distances)
        if rate == 0.0:
            return pooled
        capacity = self._capacity
        assert capacity is not None
        nb = self.bins_per_capacity
        k_max = len(pooled)
        rest = distances - rate * answers
        prior = np.tile(pooled, (self._buckets, 1))
        for b in range(readers):
            moved = np.maximum(rest + rate * typical[b], 0.0)
            bins = np.minimum(moved * nb // capacity, k_max - 1).astype(np.int64)
            prior[b] = np.bincount(bins, minlength=k_max) / len(bins)
        return prior

    def _tabulated(
        self, potential: npt.NDArray[np.float64], mass: npt.NDArray[np.float64],
        never: npt.NDArray[np.float64], tail: npt.NDArray[np.float64],
    ) -> None:  # fmt: skip
        """With ``ranking="potential"``: the tool and hint buckets' ranking tables,
        potential times ``C`` over the expected occupancy. With ``"density"``: every
        bucket's hit density (hits per second of keeping a conversation) by the seconds
        elapsed since its latest access, from the gaps learned in seconds."""
        if self._rival is not None:
            self._rival.rescore_all()
        if self.ranking != _DENSITY:
            nb = self.bins_per_capacity
            k_max = mass.shape[1]
            idx = np.arange(k_max)
            shift = idx[None, :] - idx[:, None]  # [k, j]: bins left from elapsed k to return j
            held = np.where(shift >= 0, np.minimum(shift + 0.5, nb), 0.0)
            occupancy = (mass @ held.T + never[:, None] * nb) / np.maximum(tail, 1e-12)
            first = self._answer_buckets
            dense = potential[first:] * nb / np.maximum(occupancy[first:], 0.5)
            self._dense = [_unimodal(row) for row in dense.tolist()]
        if self.ranking == _POTENTIAL or not self._gaps:
            return
        pairs = np.array(self._gaps, dtype=np.float64)
        labels = pairs[:, 0].astype(np.int64)
        answers = pairs[:, 1]
        gaps = pairs[:, 2]
        pooled = np.sort(gaps)
        grid = np.asarray(self._grid)
        ahead = grid[:, None] + HORIZONS[None, 1:]
        returned = np.asarray(self._t_returned)
        departed = np.asarray(self._t_departed)
        decay = 0.5 ** (self.refresh_every / self.samples)
        self._t_returned = [x * decay for x in self._t_returned]
        self._t_departed = [x * decay for x in self._t_departed]
        r_back = np.asarray(self._r_returned)
        r_gone = np.asarray(self._r_departed)
        self._r_returned = [x * decay for x in self._r_returned]
        self._r_departed = [x * decay for x in self._r_departed]
        prior = self.prior_weight
        p_prior = (returned.sum() + 1.0) / (returned.sum() + departed.sum() + 1.0)
        readers = self._answer_buckets
        read = labels < readers
        reader: list[float] | None = None
        if read.sum() >= 2:
            # one chance of a next turn for every reader's answer length (the answer's
            # length does not tell whether a user comes back), learned per reader class
            # (:meth:`reader_class`: a conversation that has come back is likelier to come
            # back again, and one whose latest turn brought a long input less likely),
            # each drawing on the pooled chance with ``prior_weight`` pseudo-samples
            back, gone = returned[:readers].sum(), departed[:readers].sum()
            q_read = (back + prior * p_prior) / (back + gone + prior)
            q_class = (r_back + prior * q_read) / (r_back + r_gone + prior)
            tables = self._delays(answers[read], gaps[read], np.r_[q_read, q_class])
            reader = _unimodal(tables[0].tolist())
            self._reader_rows = [_unimodal(row.tolist()) for row in tables[1:]]
        pooled_now = beyond(pooled, grid) / len(pooled)
        pooled_ahead = beyond(pooled, ahead) / len(pooled)
        rows = []
        for b in range(len(returned)):
            if b < readers and reader is not None:
                # gap = reading time + a delay: one pooled delay distribution, each
                # session shifted by its own reading time when it is scored
                rows.append(reader)
                continue
            q = (returned[b] + prior * p_prior) / (returned[b] + departed[b] + prior)
            mine = np.sort(gaps[labels == b])
            total = len(mine) + prior
            s_now = beyond(mine, grid) + prior * pooled_now
            s_ahead = beyond(mine, ahead) + prior * pooled_ahead
            density = best_density(np.full(len(grid), q), s_now / total, s_ahead / total)
            rows.append(_unimodal(density.tolist()))
        self._density = rows
        self._reading = reader is not None

    def _delays(
        self,
        answers: npt.NDArray[np.float64],
        gaps: npt.NDArray[np.float64],
        chances: npt.NDArray[np.float64],
    ) -> npt.NDArray[np.float64]:
        """Fit ``gap = read_rate * answer + delay`` to the answer buckets' samples (least
        squares, the rate at least 0; it sets :attr:`read_rate`) and return, for each
        chance of a next turn in ``chances``, the hit density by the delay elapsed (on the
        delay grid): one row per chance. With :attr:`smooth_delays` and at least
        :data:`SMOOTH_FROM` samples, the delays' survival is smoothed in log scale
        (:func:`~tieredkv.policies._hit_density.smoothed_survival`)."""
        rate = _rising_slope(answers, gaps)
        self.read_rate = rate
        delays = np.sort(gaps - rate * answers)
        grid = np.asarray(self._delay_grid)
        ahead = grid[:, None] + HORIZONS[None, 1:]
        if self.smooth_delays and len(delays) >= SMOOTH_FROM:
            survival = smoothed_survival(delays)
            s_now, s_ahead = survival(grid), survival(ahead)
        else:
            s_now, s_ahead = beyond(delays, grid) / len(delays), beyond(delays, ahead) / len(delays)
        return np.stack([best_density(np.full(len(grid), q), s_now, s_ahead) for q in chances])

    def _score(self, session: str) -> float:
        seen = self._seen[session]
        return self._rated(
            self.order,
            session,
            seen,
            seen.bucket,
            seen.rank,
            self._clock.get(session, self._now),
            self._resident[session],
        )

    def _rated(
        self,
        order: str,
        session: str,
        seen: _Seen | None,
        bucket: int,
        rank: int,
        last: float,
        size: int,
    ) -> float:
        """A resident's score under ``order`` (lowest evicted first): ``seen`` is what the
        potential knows of it (``None``: forgotten, past the horizon), ``bucket`` and
        ``rank`` its bucket and rank key, ``last`` its latest access, ``size`` its
        bytes."""
        density = self._density
        dense = self._dense
        first = self._answer_buckets
        level, reader = divmod(rank // self._buckets, self._reader_classes)  # _rank_key_of's
        if order == _DENSITY and density is not None:
            waited = self._now - last  # for a person, past the reading time
            if bucket < first and self._reading:
                grid = self._delay_grid
                waited -= self.read_rate * self._answer.get(session, 0)
                row = self._reader_rows[reader]
            else:
                grid = self._grid
                row = density[bucket]
            k = bisect.bisect_right(grid, waited) - 1
            score = row[min(max(k, 0), len(grid) - 1)]
        elif seen is None or seen.overdue:
            score = 0.0
        elif dense is None or seen.bucket < first:
            score = self._potential(session, seen)
        else:
            elapsed = self._tracker.elapsed(session)
            assert elapsed is not None
            assert self._capacity is not None
            row = dense[seen.bucket - first]
            k = elapsed * self.bins_per_capacity // self._capacity
            score = row[k] if k < len(row) else 0.0
        if self.size_aware:
            score /= max(size, 1)
        if level == 0:
            return score
        return score * 2.0 ** (level - _PRIORITY_SPAN - 1)

    # -- the duel of the two rankings ----------------------------------------------------
    def _rival_score(self, session: str) -> float:
        bucket, rank, _, last = self._rival_seen[session]
        order = _POTENTIAL if self.order == _DENSITY else _DENSITY
        seen = self._seen.get(session)
        return self._rated(order, session, seen, bucket, rank, last, self._rival_size[session])

    def _rival_access(self, session: str, nbytes: int, now: float) -> None:
        """``session`` was accessed: the newest in the shadow of the other ranking, which
        then evicts, by that ranking, down to the capacity."""
        rival = self._rival
        assert rival is not None
        seen = self._seen[session]
        sizes = self._rival_size
        entry = self._rival_seen.get(session)
        self._rival_bytes += nbytes - sizes.get(session, 0)
        sizes[session] = nbytes
        group = rival.place(session, -1 if entry is None else entry[2], seen.rank, nbytes)
        self._rival_seen[session] = (seen.bucket, seen.rank, group, now)
        capacity = self._capacity
        if capacity is None:
            return
        rival.rescore_some(nbytes, capacity * RESCORE_BINS / self.bins_per_capacity)
        rival.flush()
        excess = self._rival_bytes - capacity
        if excess <= 0:
            return
        chosen, _ = rival.choose(excess, frozenset((session,)), sizes)
        for victim in chosen:
            self._rival_bytes -= sizes.pop(victim)
            rival.unplace(victim, self._rival_seen.pop(victim)[2])
        rival.flush()

    def _score_rivals(self, own: bool, rival: bool) -> None:
        """One returning access: a hit of the tier (its ranking) or of the other ranking's
        shadow. The rival's decayed lead past ``rival_margin`` swaps the two rankings."""
        lead = self._lead * self._rival_decay + (rival - own)
        margin = self.rival_margin
        if lead < margin:
            self._lead = max(lead, -margin)
            return
        self._lead = 0.0
        self.order = _POTENTIAL if self.order == _DENSITY else _DENSITY
        self.switches += 1
        self._ranking.rescore_all()
        assert self._rival is not None
        self._rival.rescore_all()


def _rising_slope(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> float:
    """The least-squares slope of ``y`` over ``x``, at least 0."""
    dx = x - x.mean()
    var = float(dx @ dx)
    return max(0.0, float(dx @ (y - y.mean())) / var) if var > 0 else 0.0
