"""Sharing conversations across replicas through a shared tier (see
:class:`~tieredkv.backends.shared.SharedTier`, e.g. Redis).

Several caches configured with the same shared tier see each other's conversations; each
conversation is a replicated log there, extended by one writer at a time. Before it serves
a conversation, a replica asks the shared tier for its committed history
(:func:`discover`) and serves only a history it can prove current:

* its own copy, when the shared tier's history is the version this replica last committed
  or read and its copy holds all of it (plus, if this replica is still the writer, its own
  turns not committed yet);
* otherwise the shared tier's history, which replaces this replica's copies (another
  replica appended, or took the conversation over before this replica's turns were
  committed: those turns are refused, see :mod:`tieredkv._cache.refusals`);
* nothing, when the shared tier lost the history this replica knew (a server restarted
  without persistence, ``maxmemory`` evicted the manifest) or holds a damaged one: this
  replica's copies are dropped and the load is a counted miss (``stats().unproven``);
* while the shared tier cannot be reached: its own copy if it is the conversation's writer
  and its lease has not run out by its own clock (no other replica can have committed
  since; :meth:`~tieredkv.backends.shared.SharedTier.may_serve_local`), else a counted
  miss; its copies stay (the error is transient).

A load takes the conversation over (``take``); an append first checks that this replica
still is its writer (:func:`check_writer`), so a replica that another has taken the
conversation from, or that never read its current history, gets
:class:`~tieredkv.errors.StaleWriterError` or :class:`~tieredkv.errors.HistoryConflictError`
and stores nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator

from ..backends.shared import SharedState, SharedTier, plain_header
from ..errors import SchemaMismatchError, SessionNotFoundError, TierIOError
from ..payload import SegmentHeader, header_schema
from .atomic import settle
from .forest import marked, relisted
from .placement import remove_copy, take_out
from .refusals import record_refusal, report
from .shared_forest import keep_for_forks, list_shared
from .state import Core, Session

__all__ = ["check_writer", "discover", "examine", "locked_stored", "shared_tiers"]

_log = logging.getLogger("tieredkv.cache")


def shared_tiers(core: Core) -> list[tuple[int, SharedTier]]:
    """The shared tiers, with their levels."""
    return [(t, io.shared) for t, io in enumerate(core.io) if io.shared is not None]


@contextlib.asynccontextmanager
async def locked_stored(core: Core, key: str, *, load: bool) -> AsyncIterator[Session]:
    """``async with``: the stored session ``key``, its lock held. With a shared tier, what
    it holds of ``key`` is taken in first (:func:`discover`); a ``load`` takes the
    conversation over, and counts a history that cannot be proven current as a miss.

    :raises SessionNotFoundError: if it is stored nowhere (or cannot be proven current)
    :raises TurnRefusedError: turns of this conversation were refused (reported once)
    """
    if core.sharing:
        why = await examine(core, key, take=load)
        if why is not None:
            if load:
                core.stats.misses += 1
                core.stats.unproven += 1
            raise SessionNotFoundError(key, why)
    s = core.sessions.get(key)
    if s is None:  # one being created: wait for its first append
        raise SessionNotFoundError(key)
    async with core.hold(s):
        if s.primary is None:
            raise SessionNotFoundError(key)
        yield s


async def check_writer(core: Core, session: str, *, commits: int | None = None) -> None:
    """Make sure this replica may append to ``session`` in every shared tier (called with
    the session's lock held).

    ``commits``: the level of a shared tier that the append writes its segment into
    itself, and nowhere else: that tier's commit checks the writer (and renews its lease)
    in the same step as the write, so it is not asked separately (a round trip less).

    While a shared tier cannot be reached, a replica whose lease there is live appends on
    (its turns are committed once the tier is back).

    :raises TurnRefusedError: turns of this conversation were refused since the last call
        (its copies here are dropped first)
    :raises StaleWriterError: another replica took the conversation over
    :raises LeaseHeldError: another replica's lease on a conversation new to this one is live
    :raises HistoryConflictError: this replica has not read the conversation's current
        history (or the shared tier lost it)
    :raises TierIOError: a shared tier cannot be reached and this replica holds no live lease
    """
    s = core.sessions[session]
    if s.key in core.refused:
        _, cancel = await settle(functools.partial(_drop_refused, core, s))
        if cancel is not None:
            raise cancel
    for t, tier in shared_tiers(core):
        if t == commits:
            continue
        try:
            await tier.ensure_writer(session)
        except TierIOError:
            if not (s.primary is not None and tier.may_serve_local(session)):
                raise


async def discover(core: Core, key: str, *, take: bool) -> bool:
    """Bring the shared tiers' state of ``key`` into the index; with ``take``, this replica
    takes the conversation's writer lease (another replica's next commit is refused).

    :returns: whether what the index now holds of ``key`` may be served (``False``: its
        current history could not be proven; the caller counts a miss)
    :raises TurnRefusedError: turns of this conversation were refused (reported once)
    """
    return await examine(core, key, take=take) is None


async def examine(core: Core, key: str, *, take: bool) -> str | None:
    """:func:`discover`, returning why what the index holds of ``key`` may not be served
    (``None``: it may)."""
    why: str | None = None
    for t, tier in shared_tiers(core):
        while True:
            s = await core.session(key)
            try:
                async with core.hold(s):
                    if core.sessions.get(key) is not s:  # dropped while we waited: look
                        continue  # again (the shared tier may hold a newer history)
                    # a move like any other: cancellation waits for it, then is raised
                    found, cancel = await settle(functools.partial(_look, core, s, t, tier, take))
                    if cancel is not None:
                        raise cancel
                    why = why or found
                    break
            finally:
                core.discard_unused(s)  # nothing found: no empty entry stays behind
    return why


_LOST = {
    "lost": "the shared tier lost its history (a restart without persistence, or an eviction "
    "under maxmemory)",
    "damaged": "its copy in the shared tier is damaged (a checksum or MAC mismatch, or "
    "garbage in its manifest; see the log, or tieredkv fsck)",
}
"""Why a history whose shared copy is in each state is not served."""


async def _look(core: Core, s: Session, t: int, tier: SharedTier, take: bool) -> str | None:
    # no write into the shared tier under way, and none starting meanwhile (a commit
    # retried would read the copies this may remove, and write where it reads)
    async with core.hold_copies(s):
        return await _looked(core, s, t, tier, take)


async def _looked(core: Core, s: Session, t: int, tier: SharedTier, take: bool) -> str | None:
    await marked(core, s.key)  # (a marker an earlier load here could not write)
    if s.key in core.refused:
        await _drop_refused(core, s)
    try:
        state = await tier.refresh(s.key, take=take)
    except TierIOError as exc:
        if s.primary is not None and s.primary != t and tier.may_serve_local(s.key):
            return None  # this replica's lease is live: nobody else can have committed
        _log.warning("%.80r cannot be proven current: %s", s.key, exc)
        if not s.segs and not take:
            return None
        return (
            f"its current history cannot be proven (the shared tier {exc.tier!r} could not "
            f"{exc.action}: {exc.reason.rstrip('.')}, and this replica holds no live lease "
            f"on it)"
        )
    core.shared_answered()  # (commits waiting out its failure go now)
    why = await _adopt(core, s, t, tier, state, take)
    if s.key in core.refused:  # this replica's copies already agree with the shared tier
        _settle_refusal(core, s)
    return why


async def _adopt(
    core: Core, s: Session, t: int, tier: SharedTier, state: SharedState, take: bool
) -> str | None:
    """Make ``s`` agree with what shared tier ``t`` holds (``state``, just refreshed); why
    it may not be served (``None``: it may)."""
    if state.status in ("absent", "lost", "damaged"):
        if not s.segs:
            return None if state.status == "absent" else _LOST[state.status]
        if state.status == "absent" and not s.holds(t) and tier.token(s.key) is not None:
            return None  # a conversation this replica started: none of it is committed yet
        # the shared tier lost (or holds a damaged copy of) the history: this replica's
        # copy cannot be proven current
        _log.warning("the shared copy of %.80r is %s: not served", s.key, state.status)
        await _forget_all(core, s)
        return _LOST.get(state.status, "the shared tier does not hold its history")
    headers = list(state.headers)
    local = [seg.header for seg in s.segs]
    if headers and local and s.schema is not None:
        diff = s.schema.describe_difference(header_schema(headers[0]))
        if diff is not None:  # another model's KV under the same key: not ours
            raise SchemaMismatchError(s.key, diff)
    n = len(headers)
    pairs = zip(_plain(local), _plain(headers), strict=False)  # (up to the shorter one)
    same = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(local), n))
    # this replica's turns past what it shares with the committed history, never committed
    # here: if they are not the writer's to commit any more, they are refused
    own = [seq for seq in range(same, len(local)) if t not in s.segs[seq].tiers]
    if same == n:
        # this replica holds the committed history (and maybe its own turns after it)
        before = s.complete(t)
        # its own turns past the shared history that a fork's committed history there
        # lists: the store keeps them for the fork, and commits no other turn under their
        # keys (the turns a fork inherits are its parent's: a fork whose first own turn
        # is not committed yet has an empty history there, and they stay where they are)
        own_from = max(n, s.base)
        kept = [g for g in s.segs[own_from:] if t in g.tiers and g.listed_there(t, s)]
        for i, seg in enumerate(s.segs):  # tier t holds exactly the committed turns
            if i < n:
                seg.tiers.add(t)
            elif i >= own_from and t in seg.tiers and seg not in kept:
                await take_out(core, seg, t)  # (the tier forgets it too)
        if s.primary == t and not s.complete(t):
            # turns this replica committed there are gone from it (the server lost them,
            # and this tier, having since read another version, could not tell): serve
            # from a local tier that holds the whole history, the commit restarted from
            # there; with none, the history this replica acknowledged is lost (a miss)
            s.primary = next((u for u in range(len(core.tiers)) if s.complete(u)), None)
            if s.primary is None:
                _log.warning("the shared copy of %.80r lost turns committed here", s.key)
                await _forget_all(core, s)
                return _LOST["lost"]
        if len(local) > n and (tier.token(s.key) is None or kept):
            # its own later turns, but another replica is the writer now (or the turns
            # are its forks' only): refused
            if own:
                why = (
                    "its shared history was dropped while forks still list it"
                    if kept
                    else "another replica became its writer first"
                )
                record_refusal(core, s, t, why, own)
            await _forget_all(core, s, lost=False)
            return None
        if s.complete(t) and not before:
            now = core.clock()
            core.residency.admitted(core.meta(s, now), now, t)
        if len(local) > n:
            core.restart_copy(s)  # commit the rest (a takeover after a restart, say)
        return None
    # the shared history is newer (another replica appended) or another one: take it, and
    # let go of this replica's copies (its own uncommitted turns are refused)
    if own:
        record_refusal(core, s, t, "the conversation's shared history changed first", own)
    await _take(core, s, t, headers)
    return None


def _plain(headers: list[SegmentHeader]) -> list[SegmentHeader]:
    return [plain_header(h) for h in headers]


async def _take(core: Core, s: Session, t: int, headers: list[SegmentHeader]) -> None:
    """Replace ``s``'s copies by shared tier ``t``'s history ``headers``."""
    schema = header_schema(headers[0]) if headers else None
    good = next((i for i, h in enumerate(headers) if header_schema(h) != schema), len(headers))
    for u in range(len(core.tiers)):
        if u != t and s.holds(u):
            await remove_copy(core, s, u)
    # what forks here list of its own history stays theirs, its keys taken, unless the
    # shared history lists it again (then its record goes: list_shared, relisted)
    keep_for_forks(core, s)
    s.clear()
    good = list_shared(core, s, t, headers[:good])  # (a fork: its inherited segments too)
    # (its record, and a marker of it left here, which stands for nothing now, go)
    await relisted(core, s.key)
    if not good:
        s.primary = None
        if s.key in core.channel:
            core.publish(s)
    else:
        s.schema = schema
        s.primary = t
        now = core.clock()
        meta = core.meta(s, now, answer=headers[good - 1].answer_tokens)
        core.residency.admitted(meta, now, t)
    await marked(core, s.key)  # (what stays its forks' only, in SSD, say)


async def _forget_all(core: Core, s: Session, *, lost: bool = True) -> None:
    """Drop every copy of ``s`` on this replica (a shared tier's copy only from this
    replica's view): its history must be read again, or recomputed."""
    for u in range(len(core.tiers)):
        await remove_copy(core, s, u)
    keep_for_forks(core, s)  # (what forks here list stays theirs)
    s.clear()
    s.primary = None
    if lost:
        core.stats.lost += 1
        core.lost(s.key)
    if s.key in core.channel:
        core.publish(s)
    await marked(core, s.key)


async def _drop_refused(core: Core, s: Session) -> None:
    """Before ``s`` is used again: drop this replica's copies (they hold refused turns),
    and raise the refusal unless ``flush()`` reported it already."""
    if s.segs:
        await _forget_all(core, s, lost=False)
    _settle_refusal(core, s)


def _settle_refusal(core: Core, s: Session) -> None:
    """``s``'s copies agree with the shared tier again: forget its refusal, raising it
    unless it was reported already."""
    try:
        report(core, [s.key])
    finally:
        core.refused.pop(s.key, None)
