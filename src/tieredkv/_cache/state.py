"""Session state, its locking, the counters, and publishing to the metadata channel.

The cache's index is one :class:`Session` per conversation: its segments (in order), which
of them each tier holds (each :class:`Seg`'s ``tiers``), and which tier serves loads
(``primary``). Invariants,
checked by ``tests/invariants.py`` after every fault campaign:

* ``primary`` is ``None`` exactly when no tier holds every segment; otherwise it names
  such a tier (a *complete* copy);
* a segment's ``tiers`` are exactly the tiers it is committed in (each tier's own index
  agrees), except keys being moved under a session's lock; a segment is stored once per
  tier however many conversations list it (a fork lists its parent's segments), and
  leaves a tier only when no other conversation that lists it needs it there;
* the channel's :class:`~tieredkv.meta.KVMeta` for the session says the same (``tier``,
  ``copies``, bytes, tokens, turns), and tier ``t``'s eviction policy tracks the session
  when it holds a copy there;
* a segment a tier holds that no session lists is an *orphan*: a cleanup that failed. It
  is recorded in :attr:`Core.orphans` and deleted again before anything else uses its key.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import AbstractAsyncContextManager
from typing import Literal

import anyio
import msgspec

from ..backends.base import SegmentKey, TierStats
from ..errors import ClosedError, InvalidArgumentError, InvalidTypeError
from ..meta import Event, Forgotten, KVMeta, MetadataChannel, Transfer, advance_meta
from ..payload import Schema, SegmentHeader
from ..policies.base import Eviction
from ..policies.lru import LRU
from ..policies.registry import make_eviction
from ..residency import Residency
from .gather import Staging
from .lost import LostRecords
from .outputs import OutputPool
from .pins import PinBounds, kept_within
from .tierio import Copy, TierIO

__all__ = [
    "CacheStats",
    "Core",
    "Refusal",
    "Retired",
    "Seg",
    "Session",
    "begin_fill",
    "check_key",
    "claim",
    "end_fill",
    "policies_per_tier",
    "unclaim",
]


class CacheStats(msgspec.Struct, kw_only=True):
    """Counters of a :class:`~tieredkv.TieredKVCache` since it was opened.

    :param hits: loads served from the performance tier (tier 0)
    :param misses: loads of a stored session served from a lower tier (promoted or not),
        plus loads that found the history damaged or could not prove it current
    :param appends: segments stored
    :param loads: successful loads
    :param prefetches: prefetch calls that moved data up
    :param predicted: of those, predictive prefetches
        (:meth:`~tieredkv.TieredKVCache.prefetch_predicted`)
    :param promotions: sessions moved up to tier 0
    :param demotions: sessions moved down a tier (or whose lower copy became primary)
    :param evictions: copies removed from a tier to make room
    :param lost: sessions whose last copy was evicted (their KV must be recomputed)
    :param lost_records_forgotten: records of lost conversations let go past
        ``max_lost_records`` (the channel's ``tier`` ``None`` entry, and the unreported
        loss): an append without ``expected_tokens`` to one of them starts it afresh
    :param drops: sessions dropped by the application
    :param corrupt: segments that failed verification (never served)
    :param write_through: segments copied down in the background (inclusive mode)
    :param errors: I/O errors reported while moving data (the data stayed where it was)
    :param cancelled: operations cancelled by their caller, wherever the cancellation
        landed (in a move, or while the operation waited for a conversation's lock or a
        shared tier): each rolled back, or, a prefetch whose promotion had begun,
        completed (counted too). An append into a shared tier or a drop that had passed
        its point of no return completes and raises the cancellation after it: not
        counted
    :param orphans: segments whose cleanup failed, awaiting deletion
    :param truncated: sessions whose history an open brought back shorter than the tiers
        had stored it (a damaged turn, or one after a gap), or not at all, summed over
        this cache's opens (a counter: it never goes down); the last open's are named by
        :meth:`~tieredkv.TieredKVCache.truncated`
    :param written_down: conversations that only volatile tiers held which a close wrote
        down to a persistent tier (see ``close_timeout``), summed over this cache's closes
    :param unsaved: conversations that only volatile tiers held which a close could not
        write down (no free room, an I/O error, or the close timeout): lost with it;
        summed over this cache's closes
    :param refused: turns this cache had acknowledged that a shared tier refused (another
        replica took the conversation over first); reported by
        :class:`~tieredkv.errors.TurnRefusedError`
    :param unproven: loads not served because the conversation's current history could not
        be proven (its shared tier unreachable, or its copy there lost); each is a miss
    :param outputs_reused: tensors :meth:`~tieredkv.TieredKVCache.load` returned in memory an
        earlier, dropped output left (already faulted in)
    :param output_idle_bytes: memory of dropped outputs kept for later loads now (at most
        ``output_reuse_bytes``)
    :param outputs_collapsed: huge pages (2 MiB each on x86-64) that dropped outputs' idle
        memory was collapsed into, in the background (``output_huge_pages``)
    :param output_collapse_failures: collapses of idle memory the kernel refused for the
        time being (no free huge page; the memory stays on 4 KiB pages, nothing else
        changes)
    :param tiers: each tier's own counters, including bytes read and written
    """

    hits: int = 0
    misses: int = 0
    appends: int = 0
    loads: int = 0
    prefetches: int = 0
    predicted: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    lost: int = 0
    lost_records_forgotten: int = 0
    drops: int = 0
    corrupt: int = 0
    write_through: int = 0
    errors: int = 0
    cancelled: int = 0
    orphans: int = 0
    truncated: int = 0
    written_down: int = 0
    unsaved: int = 0
    refused: int = 0
    unproven: int = 0
    outputs_reused: int = 0
    output_idle_bytes: int = 0
    outputs_collapsed: int = 0
    output_collapse_failures: int = 0
    tiers: tuple[TierStats, ...] = ()

    @property
    def hit_ratio(self) -> float:
        """hits / (hits + misses), or 0.0 before any load."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class Seg:
    """One committed segment (its header, as written): stored once per tier under
    :attr:`key`, listed by every conversation whose history includes it (:attr:`users`:
    the one that appended it, and its forks)."""

    __slots__ = ("claims", "header", "key", "length", "tiers", "users")

    def __init__(self, header: SegmentHeader) -> None:
        self.header = header
        self.length = header.length
        self.key: SegmentKey = (header.session, header.seq)
        self.tiers: set[int] = set()
        """The tiers that hold it committed."""
        self.users: set[Session] = set()
        """The conversations in the index that list it."""
        self.claims: dict[int, anyio.Event] = {}
        """Tiers a copy of it is being made into (set when done): see :func:`claim`."""

    def shared(self) -> bool:
        """Whether more than one conversation lists it."""
        return len(self.users) > 1

    def needed(self, t: int, but: Session, copies: bool) -> bool:
        """Whether a conversation other than ``but`` serves from tier ``t``, is copying
        its history there, or (``copies``: inclusive mode, where lower tiers keep copies on
        purpose) keeps a complete copy there: then this segment's copy in ``t`` stays."""
        return any(u is not but and u.keeps(t, copies) for u in self.users)

    def needing(self, t: int, but: Session, copies: bool) -> list[Session]:
        """The conversations other than ``but`` for which :meth:`needed` holds."""
        return [u for u in self.users if u is not but and u.keeps(t, copies)]

    def listed_there(self, t: int, but: Session) -> bool:
        """Whether, in tier ``t`` shared between replicas where this segment is committed,
        the committed history of a conversation here other than ``but`` lists it: its
        owner's, or a fork's whose first own turn (committed there) references it. The
        store keeps it for them, whatever ``but`` does: it stays in ``t``'s part of the
        index (taking it out would have this replica copy it into ``t`` again, as its
        owner's turn, for the fork). A fork whose first own turn is being copied into
        ``t`` counts: its commit references the segment."""
        return any(
            u is not but
            and not u.dropped
            and (u.key == self.key[0] or u.references(self, t, copying=True))
            for u in self.users
        )


@contextlib.asynccontextmanager
async def _quiet(s: Session) -> AsyncIterator[None]:
    """:attr:`Core.hold_copies` of a cache without background copies."""
    await s.wait_quiet()
    yield


class Session:
    """A conversation in the index. Mutated only with :attr:`lock` held (see :meth:`Core.hold`).

    Its history is :attr:`segs`, in order: the first :attr:`base` are inherited from the
    conversation it was forked from (segments stored under their owners' keys, shared),
    the rest its own turns. :attr:`takes` is how many tokens of each segment are part of
    the history (all of them, but for a fork point inside a stored turn).
    """

    __slots__ = (
        "base",
        "deferred",
        "dropped",
        "filling",
        "inflight",
        "key",
        "lock",
        "outdated",
        "parent",
        "primary",
        "quiet",
        "schema",
        "segs",
        "stopping",
        "takes",
    )

    def __init__(self, key: str, ntiers: int) -> None:
        self.key = key
        self.schema: Schema | None = None
        self.segs: list[Seg] = []
        self.takes: list[int] = []
        self.base = 0
        self.parent: tuple[str, int] | None = None
        """``(parent, tokens)`` for a fork: the conversation and token count it forked at."""
        self.primary: int | None = None
        self.lock = anyio.Lock()
        self.inflight = 0  # background copies under way (write-through)
        self.quiet: anyio.Event | None = None  # set when inflight drops to 0
        self.stopping = False  # a drop is waiting: background copies stop early
        self.deferred: int | None = None
        """While an operation reconciles this conversation with a shared tier (not
        ``None``), background copies start none: a start asked meanwhile is made when it
        ends (1: into the shared tiers, 2: into the local tier below too; 0: none asked)."""
        self.dropped = False
        self.filling: dict[int, list[Seg]] = {}
        """Tiers a copy of the whole history is being made into, with the segments this
        conversation claimed there (see :func:`begin_fill`)."""
        self.outdated: set[int] = set()
        """Tiers whose copy of the history the turn being appended leaves behind (a copy
        above the tier the turn goes to): this conversation keeps nothing there now."""

    def __hash__(self) -> int:
        return id(self)

    async def wait_quiet(self) -> None:
        """Wait until no background copy of this session is under way (no lock needed)."""
        while self.inflight and self.quiet is not None:
            await self.quiet.wait()

    def keeps(self, t: int, copies: bool) -> bool:
        """Whether this conversation keeps its segments' copies in tier ``t``: it serves
        from ``t``, is copying its history there, or (``copies``) holds a complete copy
        that the turn it is appending does not leave behind."""
        return not self.dropped and (
            self.primary == t
            or t in self.filling
            or (copies and t not in self.outdated and self.complete(t))
        )

    def nbytes(self) -> int:
        """Bytes of the history's segments (one copy; a shared one counted whole)."""
        return sum(seg.length for seg in self.segs)

    def shared_bytes(self) -> int:
        """Bytes of the history's segments that another conversation also lists."""
        return sum(seg.length for seg in self.segs if seg.shared())

    def tier_shared(self, ntiers: int, copies: bool) -> tuple[int, ...]:
        """Per tier: bytes of the history's segments whose copy there another conversation
        still needs (:meth:`Seg.needed`): what moving this one out of the tier leaves."""
        shared = [seg for seg in self.segs if seg.shared()]
        return tuple(
            sum(seg.length for seg in shared if seg.needed(t, self, copies)) for t in range(ntiers)
        )

    def share_bytes(self) -> int:
        """The history's share of the bytes stored: each segment's bytes divided among the
        conversations listing it."""
        return sum(seg.length // max(len(seg.users), 1) for seg in self.segs)

    def tokens(self) -> int:
        return sum(self.takes)

    def holds(self, t: int) -> list[Seg]:
        """The history's segments tier ``t`` holds."""
        return [seg for seg in self.segs if t in seg.tiers]

    def missing(self, t: int) -> list[Seg]:
        """The history's segments tier ``t`` lacks."""
        return [seg for seg in self.segs if t not in seg.tiers]

    def complete(self, t: int) -> bool:
        return bool(self.segs) and all(t in seg.tiers for seg in self.segs)

    def own(self) -> list[Seg]:
        """The segments this conversation appended (not inherited)."""
        return self.segs[self.base :]

    def first_own(self) -> Seg | None:
        """Its first own segment (after those it inherits), if it has one."""
        return self.segs[self.base] if self.base < len(self.segs) else None

    def references(self, seg: Seg, t: int, *, copying: bool = False) -> bool:
        """Whether its history committed in shared tier ``t`` references ``seg``, a segment
        it inherits: its first own segment is committed there (with ``copying``, or being
        copied there: that commit references it)."""
        first = self.first_own()
        return (
            first is not None
            and (t in first.tiers or (copying and t in first.claims))
            and seg in self.segs[: self.base]
        )

    def segment_keys(self) -> list[SegmentKey]:
        return [seg.key for seg in self.segs]

    def seg(self, key: SegmentKey) -> Seg:
        return next(seg for seg in self.segs if seg.key == key)

    def add(self, seg: Seg, take: int | None = None) -> None:
        """List ``seg`` at the end of the history (``take`` of its tokens: all by default)."""
        self.segs.append(seg)
        self.takes.append(seg.header.tokens if take is None else take)
        seg.users.add(self)

    def clear(self) -> list[Seg]:
        """Unlist every segment (the history is gone: dropped or lost); those no other
        conversation lists any more."""
        freed = [seg for seg in self.segs if seg.users == {self}]
        for seg in self.segs:
            seg.users.discard(self)
        self.segs = []
        self.takes = []
        self.base = 0
        self.parent = None
        return freed


class Retired:
    """A conversation that left while others list some of its segments (see
    :mod:`tieredkv._cache.forest`): those segments, and the persistent tiers holding its
    retirement marker."""

    __slots__ = ("busy", "markers", "segs")

    def __init__(self, segs: list[Seg]) -> None:
        self.segs = segs
        self.markers: set[int] = set()
        self.busy: dict[int, anyio.Event] = {}
        """Tiers where its marker is being written or deleted (set when done)."""


async def claim(segs: list[Seg], t: int) -> list[Seg]:
    """Wait until no copy of any of ``segs`` into tier ``t`` is under way, then claim those
    ``t`` lacks (no other copy of them into ``t`` starts until :func:`unclaim`): two
    conversations that share a segment never copy it into one tier at once. A caller holds
    no claim while it waits, so waits cannot form a cycle."""
    while True:
        busy = next((seg.claims[t] for seg in segs if t in seg.claims), None)
        if busy is None:
            break
        await busy.wait()
    todo = [seg for seg in segs if t not in seg.tiers]
    for seg in todo:
        seg.claims[t] = anyio.Event()
    return todo


def unclaim(segs: list[Seg], t: int) -> None:
    """Give up the claims :func:`claim` took."""
    for seg in segs:
        event = seg.claims.pop(t, None)
        if event is not None:
            event.set()


async def begin_fill(s: Session, t: int) -> list[SegmentKey]:
    """``s`` (locked) starts copying its history into tier ``t``: the keys of the segments
    ``t`` lacks, claimed; until :func:`end_fill`, the segments it shares that ``t`` holds
    stay there (another conversation leaving ``t`` does not take them along)."""
    todo = await claim(s.segs, t)
    s.filling[t] = todo
    return [seg.key for seg in todo]


def end_fill(s: Session, t: int) -> None:
    """The copy :func:`begin_fill` started is over (done or not)."""
    unclaim(s.filling.pop(t, []), t)


class Refusal:
    """Turns of a session that a shared tier refused (see :mod:`tieredkv._cache.refusals`)."""

    __slots__ = ("reason", "reported", "seq", "tier", "turns")

    def __init__(self, tier: str, turns: list[int], reason: str, seq: int) -> None:
        self.tier = tier
        self.turns = turns
        self.reason = reason
        self.reported = False
        self.seq = seq
        """:attr:`Core.refusals` when turns were last added to it."""


class Core:
    """What every part of the cache shares: tiers, policies, channel, index and counters."""

    def __init__(
        self,
        io: Sequence[TierIO],
        copies: Sequence[Sequence[Copy]],
        policies: Sequence[Eviction],
        channel: MetadataChannel,
        mode: str,
        clock: Callable[[], float],
        output_reuse_bytes: int = 0,
        *,
        output_huge_pages: bool = False,
        staging_huge_pages: bool = False,
        pins: PinBounds,
        max_lost_records: int | None = None,
    ) -> None:
        self.io = list(io)
        """Each tier's I/O, bound once (:mod:`tieredkv._cache.tierio`)."""
        self.copies = [list(row) for row in copies]
        """``copies[src][dst]``: how segments are copied from tier ``src`` to ``dst``."""
        self.tiers = [tio.tier for tio in self.io]
        self.sharing = any(tio.shared is not None for tio in self.io)
        """Whether a tier is shared with other replicas."""
        self.policies = list(policies)
        self.channel = channel
        self.lost_records = LostRecords(
            channel, max_lost_records, self._forget_loss, lambda key: key in self.sessions
        )
        """Publishes into the channel, keeping at most ``max_lost_records`` records of lost
        conversations (:mod:`tieredkv._cache.lost`)."""
        self.residency = Residency(
            self.lost_records, policies, emit=channel.emit, remove=self.lost_records.remove
        )
        """Every change of where a session lives goes through it (:mod:`tieredkv.residency`)."""
        self.mode = mode
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.busy: Counter[str] = Counter()
        self._unbusied: anyio.Event | None = None
        """Set when a conversation stops being busy (see :meth:`wait_unbusy`)."""
        self.waiting_for_room: Counter[str] = Counter()
        """Conversations held by an operation waiting for a busy victim to be idle."""
        self.stats = CacheStats()
        self.protected: Callable[[], AbstractSet[str]] = frozenset
        self.orphans: set[tuple[int, SegmentKey]] = set()
        self.retired: dict[str, Retired] = {}
        """Conversations that left while forks still list some of their segments."""
        self.retiring: dict[str, Retired] = {}
        """Per conversation being retired (:func:`~tieredkv._cache.forest.retire` under
        way), the record it is making: the markers it writes count for a fork's copy of
        the conversation's other segments meanwhile."""
        self.leaving: dict[str, anyio.Event] = {}
        """Keys of dropped conversations whose copies are still being deleted: a new
        conversation under one waits (:meth:`session`), so that its segments never meet
        the old ones' under the same keys."""
        self.refused: dict[str, Refusal] = {}
        """Per session, turns a shared tier refused, until the session is next used."""
        self.unreported: dict[str, int] = {}
        """Conversations whose history this replica lost (its last copy evicted or found
        damaged, or lost by a shared tier) that no call has told the caller of since, each
        with the loss's number (:meth:`lost`): the next append raises
        :class:`~tieredkv.errors.HistoryLostError` once rather than start a history that
        its caller takes for the old one extended."""
        self._losses = 0
        self.refusals = 0
        """Refusals recorded so far (each time a session's refused turns grew)."""
        self.restart_copy: Callable[[Session], None] = lambda s: None
        """Restart ``s``'s background copies: into the tiers below its primary, and into a
        shared tier above it that lacks turns of it (set by the write-through)."""
        self.shared_answered: Callable[[], None] = lambda: None
        """A shared tier just answered a look-up: the commits that waited out its failure
        may go now (set by the write-through)."""
        self.hold_copies: Callable[[Session], AbstractAsyncContextManager[None]] = _quiet
        """``async with core.hold_copies(s)``: ``s`` (locked) with no background copy
        under way, and none starting until the block ends (set by the write-through)."""
        self.staging = Staging(huge_pages=staging_huge_pages)
        self.outputs = OutputPool(output_reuse_bytes, huge_pages=output_huge_pages)
        self.pins = pins
        """The bounds on pinned bytes (:mod:`tieredkv._cache.pins`)."""
        self.operations = 0
        """Public operations under way (a close waits for them: :meth:`operation`)."""
        self._no_operations: anyio.Event | None = None
        self._under_way: set[_Operation] = set()
        """The operations under way (:meth:`cancel_operations` cancels them)."""
        self.closing = False
        """Set when a close begins (what loops over conversations stops there)."""

    async def session(self, key: str) -> Session:
        """The session indexed under ``key``, or a new one (once the copies of one dropped
        under that key are deleted: its segments' keys are the new one's too)."""
        while (s := self.sessions.get(key)) is None:
            left = self.leaving.get(key)
            if left is None:
                break
            await left.wait()
        if s is None:
            s = self.sessions[key] = Session(key, len(self.tiers))
        return s

    def lost(self, key: str) -> None:
        """``key``'s history is lost on this replica: its next append is told so
        (:attr:`unreported`)."""
        self._losses += 1
        self.unreported[key] = self._losses

    def _forget_loss(self, key: str) -> None:
        """``key``'s record of a loss went past ``max_lost_records``: so does its unreported
        loss."""
        self.unreported.pop(key, None)
        self.stats.lost_records_forgotten += 1
        self.residency.announced(Forgotten(session=key, time=self.clock(), nbytes=0))

    def told(self, key: str, since: int | None = None) -> None:
        """A call told the caller of ``key``'s state: forget its loss, unless (``since``:
        what :attr:`unreported` held when the call began) a loss came after the call
        began (a history the call served, lost since: still untold)."""
        if since is None or self.unreported.get(key) == since:
            self.unreported.pop(key, None)

    def discard_unused(self, s: Session) -> None:
        """Drop ``s`` from the index if it holds nothing, is unknown to the channel and
        nobody holds or waits for its lock (what a failed or cancelled first append, or a
        discovery that found nothing, leaves behind)."""
        unused = not s.segs and s.key not in self.channel and not s.lock.locked()
        if unused and self.sessions.get(s.key) is s:
            del self.sessions[s.key]

    def discard_lost(self, s: Session) -> None:
        """Drop ``s`` from the index once its history is lost (or was never stored) and
        nothing uses it: no lock held or waited for, no background copy, no fill. What
        callers are told of the loss stays: the channel's record (``tier`` None) and
        :attr:`unreported`; a later call on its key makes a new entry, as for a key never
        seen. An index entry held 1.5 KB of the 1.9 KB that a lost conversation kept
        (``benchmarks/_lost_records.py``)."""
        if (
            s.segs
            or s.primary is not None
            or s.lock.locked()
            or s.lock.statistics().tasks_waiting
            or s.inflight
            or s.filling
            or s.deferred is not None
            or s.key in self.busy
            or self.sessions.get(s.key) is not s
        ):
            return
        meta = self.channel.get(s.key)
        if meta is None or meta.tier is None:
            del self.sessions[s.key]

    @contextlib.contextmanager
    def operation(self) -> Iterator[None]:
        """``with``: a public operation is under way (:meth:`wait_operations`). A
        cancellation that leaves it is counted in ``stats.cancelled``, wherever it landed
        (in a move that rolled back, or while the operation waited for a lock, say), unless
        the operation completed anyway (:meth:`completed_despite_cancel`)."""
        self.operations += 1
        outer = _operation.get()
        op = _Operation()
        _operation.set(op)
        self._under_way.add(op)
        try:
            with op.scope:  # (cancelled by a close that stopped waiting for it)
                yield
        except anyio.get_cancelled_exc_class():
            if not op.completed:
                self.stats.cancelled += 1
            raise
        finally:
            _operation.set(outer)
            self._under_way.discard(op)
            self.operations -= 1
            if not self.operations and self._no_operations is not None:
                self._no_operations.set()
                self._no_operations = None
        if op.scope.cancelled_caught:  # the close cancelled it: never a silent return
            raise ClosedError(
                "TieredKVCache",
                during=(
                    "the close's close_timeout passed first; the call had gone past its "
                    "point of no return and completed (what it stored or deleted stays so)"
                    if op.completed
                    else "the close's close_timeout passed first and it cancelled the call, "
                    "which was undone as a cancelled call is (nothing it did is kept)"
                ),
            )

    def cancel_operations(self) -> int:
        """Cancel every operation under way (a close out of time: each is undone, or
        completes past its point of no return, then raises
        :class:`~tieredkv.errors.ClosedError`); how many."""
        for op in self._under_way:
            op.scope.cancel()
        return len(self._under_way)

    def operation_completed(self) -> bool:
        """Whether the operation under way said it completed despite a cancellation."""
        op = _operation.get()
        return op is not None and op.completed

    def completed_despite_cancel(self) -> None:
        """The operation under way went past its point of no return and completed; the
        cancellation raised after it is not counted (nothing was cancelled)."""
        op = _operation.get()
        if op is not None:
            op.completed = True

    async def wait_operations(self) -> None:
        """Wait until no public operation is under way."""
        while self.operations:
            if self._no_operations is None:
                self._no_operations = anyio.Event()
            await self._no_operations.wait()

    def hold(self, s: Session) -> Held:
        """``async with``: hold ``s``'s lock and mark it busy (never chosen as a victim)."""
        return Held(self, s)

    def unbusy(self, key: str) -> None:
        self.busy[key] -= 1
        if self.busy[key] <= 0:
            del self.busy[key]
            if self._unbusied is not None:
                self._unbusied.set()
                self._unbusied = None

    async def wait_unbusy(self) -> None:
        """Wait until some conversation stops being busy (it may be a victim again)."""
        if self._unbusied is None:
            self._unbusied = anyio.Event()
        await self._unbusied.wait()

    def set_transfer(self, s: Session, transfer: Transfer | None) -> None:
        meta = self.channel.get(s.key)
        if meta is not None:
            self.residency.published(msgspec.structs.replace(meta, in_flight=transfer))

    def transfer(
        self, kind: Literal["promote", "demote", "write-through"], s: Session, src: int, dst: int
    ) -> Transfer:
        return Transfer(
            kind=kind,
            src=self.tiers[src].name,
            dst=self.tiers[dst].name,
            nbytes=s.nbytes(),
            started=self.clock(),
        )

    def meta(
        self,
        s: Session,
        now: float,
        *,
        access: bool = False,
        answer: int | None = None,
        restart: bool = False,
    ) -> KVMeta:
        """``s``'s metadata (placement from the index) as it stands now, not published. A
        pinned conversation that grew past a bound on pinned bytes has lost its pin in it
        (:func:`~tieredkv._cache.pins.kept_within`)."""
        old = self.channel.get(s.key)
        copies = tuple(
            self.tiers[t].name
            for t in sorted(range(len(self.tiers)), key=lambda t: t != s.primary)
            if s.complete(t)
        )
        meta = advance_meta(
            old,
            session=s.key,
            tier=None if s.primary is None else self.tiers[s.primary].name,
            copies=copies,
            nbytes=s.nbytes(),
            tokens=s.tokens(),
            turns=len(s.segs),
            now=now,
            access=access,
            answer=answer,
            turn_tokens=s.takes[-1] if answer is not None and s.takes else None,
            codec=s.schema.codec if s.schema is not None else "kv",
            restart=restart,
            parent=None if s.parent is None else s.parent[0],
            parent_tokens=0 if s.parent is None else s.parent[1],
            shared_bytes=s.shared_bytes(),
            tier_shared=s.tier_shared(len(self.tiers), self.mode == "inclusive"),
            share_bytes=s.share_bytes(),
        )
        if old is not None and meta.nbytes > old.nbytes and meta.pinned(now):
            meta = kept_within(self.pins, self.sessions, self.channel, meta, now)
        return meta

    def gained(self, s: Session, segs: list[Seg], t: int) -> None:
        """``segs`` of ``s`` were just committed in tier ``t``: another conversation listing
        them that is now complete there (a fork's parent whose whole history the fork
        brought along) is resident there too, for that tier's policy and the channel."""
        others = {u for seg in segs for u in seg.users if u is not s}
        now = self.clock()
        for u in others:
            if u.primary is not None and not u.dropped and u.complete(t):
                self.residency.admitted(self.meta(u, now), now, t)

    def reshared(self, s: Session) -> None:
        """``s`` shares more or fewer bytes with other conversations than before (a fork
        of it came or went): publish it, and tell the policies of the tiers it is
        resident in what evicting it frees now."""
        if self.sessions.get(s.key) is not s or s.primary is None or s.dropped:
            return
        now = self.clock()
        meta = self.residency.published(self.meta(s, now))
        for t in range(len(self.tiers)):
            if s.complete(t):
                self.residency.admitted(meta, now, t)

    def joined(self, s: Session, t: int) -> None:
        """``s`` became resident in tier ``t``: a conversation that alone needed a segment
        ``s`` lists there no longer frees it by leaving: tell ``t``'s policy."""
        copies = self.mode == "inclusive"
        alone: set[Session] = set()
        for seg in s.segs:
            if len(seg.users) > 1:
                needing = seg.needing(t, s, copies)
                if len(needing) == 1:
                    alone.add(needing[0])
        now = self.clock()
        for u in alone:
            if u.primary is not None and u.complete(t):
                self.residency.admitted(self.meta(u, now), now, t)

    def publish(self, s: Session) -> KVMeta:
        """Publish ``s``'s metadata now (its placement changed, not its residency)."""
        return self.residency.published(self.meta(s, self.clock()))

    def admit(self, s: Session, t: int, event: Event | None = None) -> KVMeta:
        """``s``'s whole history became resident in tier ``t`` (without an access)."""
        now = self.clock()
        return self.residency.admitted(self.meta(s, now), now, t, event)


class _Operation:
    """A public operation under way (:meth:`Core.operation`): whether it completed though
    a cancellation arrived (then that cancellation is not counted), and the scope a close
    cancels it with."""

    __slots__ = ("completed", "scope")

    def __init__(self) -> None:
        self.completed = False
        self.scope = anyio.CancelScope()


_operation: contextvars.ContextVar[_Operation | None] = contextvars.ContextVar(
    "tieredkv_operation", default=None
)


class Held:
    """The context manager :meth:`Core.hold` returns."""

    __slots__ = ("_core", "_s")

    def __init__(self, core: Core, s: Session) -> None:
        self._core = core
        self._s = s

    async def __aenter__(self) -> None:
        await self._s.lock.acquire()
        self._core.busy[self._s.key] += 1

    async def __aexit__(self, *exc_info: object) -> None:
        # no await here: leaving can never be interrupted half-way
        self._core.unbusy(self._s.key)
        self._s.lock.release()
        self._core.discard_lost(self._s)


def check_key(session: object) -> None:
    """Refuse what cannot be a session key, saying what to use instead."""
    if not isinstance(session, str):
        raise InvalidTypeError(f"session keys are str, not {type(session).__name__}")
    if not session:
        raise InvalidArgumentError("session key is empty; use any non-empty text")
    try:
        session.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"session key is not valid Unicode text ({exc.reason} at {exc.start}); "
            f"remove lone surrogates"
        ) from None


def policies_per_tier(
    eviction: Eviction | str | Sequence[Eviction | str] | None, ntiers: int
) -> list[Eviction]:
    """One eviction policy per tier, from what the caller gave."""
    if isinstance(eviction, Sequence) and not isinstance(eviction, str):
        policies = [make_eviction(p) if isinstance(p, str) else p for p in eviction]
        if len(policies) != ntiers:
            raise InvalidArgumentError(
                f"got {len(policies)} eviction policies for {ntiers} tiers; pass one "
                f"policy (for tier 0) or one per tier"
            )
    else:
        if isinstance(eviction, str):
            top = make_eviction(eviction)
        else:  # not `eviction or LRU()`: an empty policy may be falsy (it has __len__)
            top = eviction if eviction is not None else LRU()
        policies = [top] + [LRU() for _ in range(ntiers - 1)]
    for policy in policies:
        if not isinstance(policy, Eviction):
            raise InvalidTypeError(f"{policy!r} does not implement the Eviction protocol")
    if len({id(p) for p in policies}) != len(policies):
        raise InvalidArgumentError("each tier needs its own eviction policy instance")
    return policies
