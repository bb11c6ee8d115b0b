"""Where a session's KV lives: reserving room, promoting, demoting, evicting, forgetting.

Every function here runs inside :func:`~tieredkv._cache.atomic.settle` (no caller's
cancellation reaches it) with the session's lock held, and keeps the invariants listed in
:mod:`tieredkv._cache.state` whatever fails:

* a copy becomes part of the index (a segment's ``tiers``) only once every byte of it is
  committed in the tier; a copy is taken out of the index before (not after) its space is
  reused; a segment other conversations share leaves a tier only when none of them needs
  it there;
* what a failed step wrote is deleted again; a deletion that fails leaves its key in
  :attr:`Core.orphans`, retried before the key is used again and at close, so a failed
  cleanup never poisons later operations (of this session or any other);
* an I/O error while moving a victim to make room leaves the victim where it was and
  reaches the caller (whose operation then did nothing).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio

from ..backends.base import SegmentKey
from ..errors import (
    CapacityError,
    CorruptSegmentError,
    HistoryConflictError,
    LeaseHeldError,
    StaleWriterError,
    TierIOError,
)
from ..meta import Demoted, Dropped, Evicted, Promoted
from .atomic import settle
from .forest import copying, deleted, retire
from .refusals import record_refusal
from .state import Core, Seg, Session, begin_fill, claim, end_fill, unclaim

__all__ = [
    "copy_into_room",
    "copy_segments",
    "delete_or_orphan",
    "demote",
    "drop",
    "drop_damaged",
    "end_filling",
    "evict_copy",
    "finish_promotion",
    "forget_copy",
    "is_shared",
    "promote",
    "purge_orphans",
    "remove_all",
    "remove_copy",
    "reserve",
    "reserve_all",
    "start_promotion",
    "take_out",
    "unlist",
]

_log = logging.getLogger("tieredkv.cache")


# -- deleting ---------------------------------------------------------------------------
async def delete_or_orphan(core: Core, t: int, key: SegmentKey) -> bool:
    """Delete ``key`` from tier ``t``; on an I/O error record it as an orphan. ``True`` if gone."""
    try:
        await core.tiers[t].delete(key)
    except TierIOError:
        core.stats.errors += 1
        if (t, key) not in core.orphans:
            core.orphans.add((t, key))
            core.stats.orphans += 1
        _log.warning(
            "tier %r: could not delete segment %d of %.80r; will retry",
            core.tiers[t].name,
            key[1],
            key[0],
        )
        return False
    if (t, key) in core.orphans:
        core.orphans.discard((t, key))
        core.stats.orphans -= 1
    return True


async def purge_orphans(core: Core, session: str | None = None) -> None:
    """Retry deleting the orphans (of ``session``, or all of them)."""
    for t, key in sorted(core.orphans):
        if session is None or key[0] == session:
            await delete_or_orphan(core, t, key)


async def remove_copy(core: Core, s: Session, t: int) -> bool:
    """Take ``s``'s segments in tier ``t`` out of the index and delete them, highest first
    (a dropped conversation's lowest first).

    Highest first, so a crash part-way leaves a prefix (which recovery can use) of a
    conversation that stays; a dropped one's first segment goes first, so a crash part-way
    through a drop leaves no history to serve (recovery reports the rest as a truncation
    to 0 turns and deletes it), never a shorter one. A segment
    another conversation still needs in ``t`` (one it shares with ``s``: see
    :meth:`~tieredkv._cache.state.Seg.needed`) stays, and so does, in a tier shared between
    replicas, one that another conversation's committed history there lists
    (:meth:`~tieredkv._cache.state.Seg.listed_there`). A segment that cannot be deleted
    becomes an orphan. Never raises for I/O: ``False`` if some segment became an orphan.
    """
    clean = True
    gone = []
    copies = core.mode == "inclusive"
    shared = core.io[t].shared is not None
    sharers = {u for seg in s.segs for u in seg.users if u is not s and u.complete(t)}
    for seg in list(s.segs) if s.dropped else list(reversed(s.segs)):
        if (
            t in seg.tiers
            and not seg.needed(t, s, copies)
            and not (shared and seg.listed_there(t, s))
        ):
            gone.append(seg)
            clean = await take_out(core, seg, t) and clean
    if core.retired:
        await deleted(core, gone, t)
    if s.dropped or not s.complete(t):  # (else its sharers keep all of it there)
        core.residency.removed(s.key, t)
    alone: set[Session] = set()  # sharers now the only one needing a segment kept in t
    for seg in s.segs:
        if t in seg.tiers:
            needing = seg.needing(t, s, copies)
            if len(needing) == 1:
                alone.add(needing[0])
    for u in sharers:  # a copy in t that only shared segments made complete, now gone
        if not u.dropped and not u.complete(t):  # (one dropped meanwhile is not published)
            core.residency.removed(u.key, t)
            core.publish(u)
        elif u in alone and not u.dropped and u.primary is not None:
            core.admit(u, t)  # moving it out of t now frees the segments it alone needs
    return clean


async def take_out(core: Core, seg: Seg, t: int) -> bool:
    """Take ``seg`` out of tier ``t``'s part of the index, then delete it there (an orphan
    if that fails: ``False``)."""
    seg.tiers.discard(t)
    # claimed while its delete is under way: a conversation sharing it that copies it back
    # into t waits for the delete, instead of finding the key still held
    claimed = await claim([seg], t)
    try:
        return await delete_or_orphan(core, t, seg.key)
    finally:
        unclaim(claimed, t)


async def remove_all(core: Core, s: Session) -> None:
    """Delete every copy of ``s`` (a drop); failures become orphans. A shared tier's copy
    goes for every replica if this one is the conversation's writer (else it stays theirs)."""
    for t, io in enumerate(core.io):
        if io.shared is not None:
            try:
                await io.shared.discard(s.key)
            except TierIOError:
                core.stats.errors += 1
                _log.warning("tier %r: could not discard %.80r for every replica", io.name, s.key)
        await remove_copy(core, s, t)


async def drop(
    core: Core,
    s: Session,
    stop: Callable[[Session], Awaitable[None]],
    unstop: Callable[[Session], None],
) -> None:
    """Forget ``s`` (locked): its background copy stopped (``stop``: cancelled there, the
    drop did nothing; ``unstop`` restarts it if the drop fails before its point of no
    return), then it leaves the index and the channel (the point of no return),
    then every copy is deleted, whatever cancels the caller (raised at the end). If forks
    still list some of its turns, its retirement marker is written first (an I/O error
    there: the drop did nothing, and raises it; once the marker is written, the drop
    completes whatever cancels the caller, so no marker ever stands for a live one)."""
    await stop(s)
    try:
        _, first = await settle(lambda: retire(core, s))
    except BaseException:  # the drop did nothing: the background copy goes on
        unstop(s)
        raise
    s.dropped = True
    core.refused.pop(s.key, None)  # (turns refused by a shared tier: gone with it)
    nbytes = s.nbytes()
    # until its copies are deleted, a new conversation under its key waits (Core.session)
    left = core.leaving[s.key] = anyio.Event()
    try:
        if core.sessions.get(s.key) is s:
            del core.sessions[s.key]
        core.residency.unpublished(s.key)
        core.stats.drops += 1
        _, cancel = await settle(lambda: remove_all(core, s))
        unlist(core, s)
        s.primary = None
    finally:
        del core.leaving[s.key]
        left.set()
    core.residency.announced(Dropped(session=s.key, time=core.clock(), nbytes=nbytes))
    pending = first if first is not None else cancel
    if pending is not None:
        core.completed_despite_cancel()
        raise pending


def unlist(core: Core, s: Session) -> None:
    """``s``'s history is gone (dropped or lost): it no longer lists its segments, and a
    conversation that now lists one of them alone is published with its new shared bytes."""
    sharers = {u for seg in s.segs if len(seg.users) == 2 for u in seg.users if u is not s}
    s.clear()
    for u in sharers:
        core.reshared(u)


async def forget_copy(core: Core, s: Session, t: int) -> bool:
    """Remove the copy in ``t``; re-elect the primary; return whether the session is lost
    (the caller publishes the outcome).

    :raises TierIOError: the session would be lost while forks list some of its turns,
        and its retirement marker could not be written (nothing changed)
    """
    if not any(s.complete(u) for u in range(len(core.tiers)) if u != t):
        await retire(core, s)
    await remove_copy(core, s, t)
    if s.primary == t:
        # not t again, though the turns its forks keep there may still make it complete:
        # it is retired if it had no other copy, so it is lost (as a restart finds it)
        others = (u for u in range(len(core.tiers)) if u != t and s.complete(u))
        s.primary = next(others, None)
    if s.primary is None and s.segs:
        s.dropped = True  # (its partial copies are of no use to anyone but its sharers)
        try:
            for u in range(len(core.tiers)):
                await remove_copy(core, s, u)
        finally:
            s.dropped = False
        unlist(core, s)
        core.stats.lost += 1
        core.lost(s.key)
    return s.primary is None


async def evict_copy(core: Core, s: Session, t: int) -> None:
    """Remove ``s``'s copy from tier ``t`` to make room (lost if it was the last one)."""
    nbytes = s.nbytes()
    lost = await forget_copy(core, s, t)
    core.stats.evictions += 1
    now = core.clock()
    event = Evicted(session=s.key, time=now, nbytes=nbytes, tier=core.tiers[t].name, lost=lost)
    core.residency.published(core.meta(s, now), event)


async def drop_damaged(core: Core, s: Session, t: int, where: str) -> None:
    """A segment of ``s`` in tier ``t`` failed verification: that copy is gone (another
    tier that holds the whole history serves it now)."""
    core.stats.corrupt += 1
    _log.warning("session %.80r: %s in tier %r is damaged", s.key, where, core.tiers[t].name)
    await forget_copy(core, s, t)
    core.publish(s)


async def forget_history(core: Core, s: Session) -> None:
    """Remove every copy of ``s`` from this replica's index (a load reported it missing:
    nothing of it may stay to be extended); what forks list of it stays theirs."""
    while s.primary is not None:
        await forget_copy(core, s, s.primary)


# -- copying a whole history into a tier ---------------------------------------------------
async def end_filling(core: Core, s: Session, t: int) -> None:
    """The copy of ``s``'s history into tier ``t`` that :func:`begin_fill` started is over
    (done or not). If it did not complete, the segments of the history that ``t`` kept
    only for it (shared ones that the conversations listing them left ``t`` meanwhile)
    leave ``t`` too: no segment stays at rest in a tier where no conversation listing it
    is complete. A tier shared between replicas is left as it is: what it holds is
    committed for every replica, and its writer's leases, not this replica's index,
    decide when it goes."""
    end_fill(s, t)
    if s.complete(t) or core.io[t].shared is not None:
        return
    gone = []
    for seg in list(reversed(s.segs)):
        if t in seg.tiers and not any(u.keeps(t, copies=True) for u in seg.users):
            gone.append(seg)
            await take_out(core, seg, t)
    if gone and core.retired:
        await deleted(core, gone, t)


@contextlib.asynccontextmanager
async def filling(core: Core, s: Session, t: int) -> AsyncIterator[list[SegmentKey]]:
    """``async with``: :func:`begin_fill` ... :func:`end_filling`."""
    keys = await begin_fill(s, t)
    try:
        yield keys
    finally:
        await end_filling(core, s, t)


# -- making room --------------------------------------------------------------------------
async def reserve(
    core: Core, t: int, key: SegmentKey, length: int, protect: set[str], *, lossless: bool = False
) -> bool:
    """Reserve ``length`` bytes in tier ``t``, evicting unprotected sessions as needed.

    With ``lossless``, only victims that keep a copy somewhere are moved (a background
    copy must never cost another session its only copy). When enough bytes are free but
    split into gaps, a :class:`~tieredkv.backends.base.DefragmentingTier` first moves idle
    sessions' segments aside, so that no session is evicted for want of one gap.

    :returns: ``False`` if room cannot be made (no victim left)
    :raises TierIOError: if moving a victim failed (it stays where it was), or an orphan
        under ``key`` cannot be deleted
    """
    tier = core.tiers[t]
    if length > tier.capacity:
        return False
    if (t, key) in core.orphans and not await delete_or_orphan(core, t, key):
        raise TierIOError(tier.name, f"delete the stale segment {key[1]}", "still failing")
    skip = set(protect)
    busy = core.busy
    defragment = core.io[t].defragment
    while not tier.reserve(key, length):
        short = length - (tier.capacity - tier.used)
        if (
            short <= 0
            and defragment is not None
            and defragment(length, _movable(core)) is not None
            and tier.reserve(key, length)
        ):
            break
        victims = core.policies[t].victims(
            max(short, 1), core.clock(), core.channel, skip | busy.keys() | core.protected()
        )
        if not victims:
            return False
        for victim in victims:
            skip.add(victim)
            try:
                await _move_victim(core, victim, t, lossless)
            except TierIOError as exc:
                core.stats.errors += 1  # the victim stays where it was
                if not is_shared(core, exc.tier):
                    raise
                # the shared tier is away: that victim stays, room is made from others
                # (one conversation's trouble never fails another's operation)
    return True


def _movable(core: Core) -> Callable[[SegmentKey], bool]:
    """Which committed segments defragmenting may move: those no operation may be reading
    from its slot. A busy conversation (an operation holds it) may read every segment its
    history lists, under whatever key each is stored (a fork's parent's turns too, the
    parent idle or retired)."""
    busy = core.busy
    listed = {
        seg.key for key in busy if (s := core.sessions.get(key)) is not None for seg in s.segs
    }
    return lambda k: k[0] not in busy and k not in listed


async def _move_victim(core: Core, victim: str, t: int, lossless: bool) -> None:
    vs = core.sessions.get(victim)
    if vs is None or not vs.holds(t):
        core.residency.removed(victim, t)  # stale entry
        return
    last = vs.primary == t and t + 1 >= len(core.tiers)
    if victim in core.busy or (lossless and last and core.io[t].shared is None):
        return  # (a shared tier's copy stays for the other replicas: this one only forgets it)
    meta = core.channel.get(victim)
    if meta is not None and meta.pinned(core.clock()):
        return  # pinned since the policy chose it (victims move one by one, with awaits)
    try:
        vs.lock.acquire_nowait()
    except anyio.WouldBlock:
        return
    core.busy[victim] += 1
    try:
        if vs.primary == t and t + 1 < len(core.tiers):
            await demote(core, vs, t, may_lose=not lossless)
        else:  # last tier, or a (possibly partial) lower copy
            await evict_copy(core, vs, t)
    except CorruptSegmentError:
        pass  # the victim turned out damaged; it is gone, and so is its space
    except CapacityError:
        pass  # lossless, and the victim has nowhere to go: it stays
    except (StaleWriterError, LeaseHeldError, HistoryConflictError) as exc:
        # another replica is the victim's writer now: its turns not committed there are
        # refused, and this copy of it is not current; let it go
        record_refusal(core, vs, _level(core, exc.tier), str(exc))
        await evict_copy(core, vs, t)
    finally:
        core.unbusy(victim)
        vs.lock.release()
        core.discard_lost(vs)


def is_shared(core: Core, name: str) -> bool:
    """Whether the tier named ``name`` is one of the cache's shared tiers."""
    return any(io.name == name and io.shared is not None for io in core.io)


def _level(core: Core, name: str) -> int:
    return next(t for t, tier in enumerate(core.tiers) if tier.name == name)


# -- moving down --------------------------------------------------------------------------
async def demote(core: Core, s: Session, t: int, *, may_lose: bool = True) -> None:
    """Move primary ``s`` (locked) out of tier ``t`` into the next tier.

    If the next tier cannot make room, the copy in ``t`` is evicted (and the session lost)
    when ``may_lose``, else :class:`CapacityError` is raised and nothing changes. On an I/O
    error the session stays in ``t`` and the error propagates.
    """
    total = s.nbytes()
    for u in range(t + 1, len(core.tiers)):
        if s.complete(u):  # inclusive: the lower copy takes over, no write needed
            s.primary = u
            await remove_copy(core, s, t)
            _after_demote(core, s, t, u, total)
            return
    u = t + 1
    if u >= len(core.tiers):
        if not may_lose:
            raise CapacityError("the session", total, 0)
        await evict_copy(core, s, t)
        return
    core.set_transfer(s, core.transfer("demote", s, t, u))
    try:
        async with filling(core, s, u) as missing:
            moved = await reserve_all(core, s, u, missing)
            if moved:
                await _copy_into(core, s, t, u, missing)
    finally:
        core.set_transfer(s, None)
    if moved:
        s.primary = u
        await remove_copy(core, s, t)
        _after_demote(core, s, t, u, total)
        return
    # the next tier cannot take it: the session is lost from this tier
    if not may_lose:
        dst = core.tiers[u]
        raise CapacityError("the session", total, dst.capacity - dst.used)
    await evict_copy(core, s, t)


def _after_demote(core: Core, s: Session, t: int, u: int, total: int) -> None:
    core.stats.demotions += 1
    now = core.clock()
    src, dst = core.tiers[t].name, core.tiers[u].name
    event = Demoted(session=s.key, time=now, nbytes=total, src=src, dst=dst)
    core.residency.admitted(core.meta(s, now), now, u, event)
    core.joined(s, u)


async def reserve_all(core: Core, s: Session, dst: int, keys: list[SegmentKey]) -> bool:
    """Reserve room for ``keys`` of ``s`` in ``dst``: all of them (``True``), or none."""
    lengths = {seg.key: seg.length for seg in s.segs}
    reserved: list[SegmentKey] = []
    try:
        for key in keys:
            if not await reserve(core, dst, key, lengths[key], {s.key}):
                break
            reserved.append(key)
        else:
            reserved = []
            return True
        return False
    finally:
        for key in reserved:
            core.tiers[dst].release(key)


async def copy_into_room(core: Core, s: Session, dst: int) -> bool:
    """Copy the segments of ``s`` (locked) that tier ``dst`` lacks into it, from its primary
    tier, into free room only: nothing is evicted. All or nothing; ``True`` if ``dst`` now
    holds all of ``s`` (its policy then tracks it), ``False`` if they do not fit.

    :raises TierIOError: writing failed (what was written is deleted again)
    """
    assert s.primary is not None
    tier = core.tiers[dst]
    lengths = {seg.key: seg.length for seg in s.segs}
    reserved: list[SegmentKey] = []
    async with filling(core, s, dst) as missing:
        try:
            for key in missing:
                if (dst, key) in core.orphans and not await delete_or_orphan(core, dst, key):
                    return False
                if not tier.reserve(key, lengths[key]):
                    return False
                reserved.append(key)
            reserved = []  # _copy_into fills or releases them
            core.set_transfer(s, core.transfer("demote", s, s.primary, dst))
            try:
                await _copy_into(core, s, s.primary, dst, missing)
            finally:
                core.set_transfer(s, None)
        finally:
            for key in reserved:
                tier.release(key)
    now = core.clock()
    core.residency.admitted(core.meta(s, now), now, dst)
    core.joined(s, dst)
    return True


async def _copy_into(core: Core, s: Session, src: int, dst: int, keys: list[SegmentKey]) -> None:
    """Copy ``keys`` of ``s`` from ``src`` into their reservations in ``dst``; mark them
    held there.

    All or nothing: on an error the reservations are released, what was written is deleted
    again, and the error propagates.
    """
    written: list[SegmentKey] = []
    try:
        await copy_segments(core, s, src, dst, keys, written)
        segs = [s.seg(key) for key in written]
        for seg in segs:
            seg.tiers.add(dst)
        written = []
        core.gained(s, segs, dst)
    finally:
        for key in keys:
            core.tiers[dst].release(key)  # (no-op for those committed)
        for key in written:
            await delete_or_orphan(core, dst, key)


async def copy_segments(
    core: Core, s: Session, src: int, dst: int, keys: list[SegmentKey], written: list[SegmentKey]
) -> None:
    """Copy committed segments ``keys`` of ``s`` into ``dst``'s reservations for them (and
    commit them there), appending each to ``written`` once committed, the way chosen for the
    pair when the cache was built (:func:`~tieredkv._cache.tierio.copier`).

    A segment found damaged in ``src`` costs ``s`` that copy (and raises).
    """
    await copying(core, keys, dst)
    try:
        await core.copies[src][dst](keys, written)
    except CorruptSegmentError as exc:
        await drop_damaged(core, s, src, exc.where)
        raise


# -- moving up ----------------------------------------------------------------------------
async def promote(core: Core, s: Session) -> bool:
    """Move ``s`` (locked) into tier 0 if it fits; ``True`` if it moved.

    The history is copied into fresh tier-0 slots, then becomes primary there in one step;
    only then (exclusive mode) is the lower copy deleted. If room cannot be made (even
    because of an I/O error elsewhere), loads are served from where it is.

    :raises CorruptSegmentError: the lower copy was damaged (and is gone)
    :raises TierIOError: reading the lower copy failed (it stays where it was)
    """
    assert s.primary is not None
    src = s.primary
    total = s.nbytes()
    if src == 0 or total > core.tiers[0].capacity:
        return False
    began = core.clock()
    missing = await start_promotion(core, s, src)
    if missing is None:
        return False  # room could not be made: serve from where it is
    try:
        try:
            await _copy_into(core, s, src, 0, missing)
        except TierIOError:
            core.stats.errors += 1
            raise
    finally:
        core.set_transfer(s, None)
        await end_filling(core, s, 0)
    await finish_promotion(core, s, src, began)
    return True


async def start_promotion(core: Core, s: Session, src: int) -> list[SegmentKey] | None:
    """Mark ``s`` as moving up from tier ``src`` and reserve tier-0 room for the segments
    it lacks there; their keys, or ``None`` (unmarked, nothing reserved) if room cannot be
    made, even because of an I/O error elsewhere. The caller fills the reservations, then
    clears the mark (``core.set_transfer(s, None)``; :func:`end_filling`) and calls
    :func:`finish_promotion`."""
    missing = await begin_fill(s, 0)
    core.set_transfer(s, core.transfer("promote", s, src, 0))
    try:
        if await reserve_all(core, s, 0, missing):
            return missing
    except TierIOError:
        core.stats.errors += 1
    except BaseException:
        core.set_transfer(s, None)
        await end_filling(core, s, 0)
        raise
    core.set_transfer(s, None)
    await end_filling(core, s, 0)
    return None


async def finish_promotion(core: Core, s: Session, src: int, began: float) -> None:
    """Tier 0 now holds all of ``s`` (read from tier ``src`` since ``began``): make it
    primary there, count it, tell the policy and the channel, and (exclusive mode) delete
    the copy it came from."""
    s.primary = 0
    core.stats.promotions += 1
    now = core.clock()
    event = Promoted(
        session=s.key,
        time=now,
        nbytes=s.nbytes(),
        src=core.tiers[src].name,
        dst=core.tiers[0].name,
        seconds=now - began,
    )
    core.residency.admitted(core.meta(s, now), now, 0, event)
    core.joined(s, 0)
    if core.mode == "exclusive":
        await remove_copy(core, s, src)
        core.publish(s)
