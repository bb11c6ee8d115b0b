"""Conversations that leave while forks still list their turns: retirement markers.

A fork lists its parent's segments, stored under the parent's key. When the parent leaves
the index (dropped, or its last copy evicted), the segments its forks still list stay
stored under its key, for them only; the parent is *retired*. In every persistent tier
that holds such a segment, a retirement marker (:func:`~tieredkv.payload.plan_retirement`)
is committed first, so a restart does not bring the parent back: recovery reads the marker
and keeps the segments only as the forks' (:mod:`tieredkv._cache.recovery`). The marker is
written before anything of the parent is deleted and before a retired segment is copied
into a persistent tier that lacks it, and deleted after the last retired segment left that
tier: at every instant, a persistent tier holding a retired segment holds its marker.

Until its forks are gone, a retired key cannot be used again (its segments' keys are
still taken): :meth:`~tieredkv.TieredKVCache.append` says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

from ..backends.base import SegmentKey
from ..errors import InvalidArgumentError, TierIOError
from ..payload import RETIRED_SEQ, plan_retirement
from .state import Core, Retired, Seg, Session, claim, unclaim

__all__ = ["check_not_retired", "copying", "deleted", "marked", "relisted", "retire"]


def check_not_retired(core: Core, key: str, seq: int = 0) -> None:
    """Refuse to store turn ``seq`` of a conversation under a retired key whose forks still
    list a segment under that turn's key (any turn of a new conversation: ``seq`` 0). A
    history that left this replica (refused, lost, or dropped) may have been loaded again
    shorter than what its forks list: its next turn's key is still theirs."""
    r = core.retired.get(key)
    if r is None or (seq and all(seg.key != (key, seq) for seg in r.segs)):
        return
    if not seq:
        raise InvalidArgumentError(
            f"conversation {key!r} left while forks still list its history, which stays "
            f"stored under its key for them; store the new conversation under another key "
            f"(or drop those forks first)"
        )
    raise InvalidArgumentError(
        f"turn {seq} of conversation {key!r} is taken: a history of it that left this "
        f"replica while forks still list its history stays stored under its key for them; "
        f"drop those forks first (or store the conversation under another key)"
    )


def check_no_stale(core: Core, key: str) -> None:
    """Refuse to store a turn under ``key`` while a persistent tier holds a file of ``key``
    that could not be deleted (an orphan, tried again just before): a retirement marker of
    an earlier conversation of that name (a restart would take this conversation for that
    retired one and serve none of its turns), or a turn of an earlier history of it (a
    restart would serve it joined to this conversation's turns, or instead of them).

    :raises TierIOError: such a file remains (nothing is stored; try again later)
    """
    for t, (owner, seq) in core.orphans:
        tier = core.tiers[t]
        if owner != key or not tier.persistent or core.io[t].shared is not None:
            continue
        what = (
            "the retirement marker of an earlier conversation of that name"
            if seq == RETIRED_SEQ
            else f"an older copy of its turn {seq}"
        )
        raise TierIOError(
            tier.name,
            f"store a turn of {key[:80]!r}",
            f"{what} could not be deleted",
            hint="try again once the tier's deletes succeed (or use another key)",
        )


async def retire(core: Core, s: Session) -> None:
    """``s`` (locked) is about to leave the index: if other conversations list some of its
    own segments, commit its retirement marker in every persistent tier holding one of
    them, and record it as retired. Nothing of ``s`` is deleted yet.

    :raises TierIOError: a marker could not be written (the markers written are deleted
        again; ``s`` is as it was)
    """
    kept = [seg for seg in s.own() if seg.users - {s}]
    if not kept:
        return
    # already recorded as retired here (its history left this replica's index while forks
    # here list some of it, see shared_forest): that record, with its markers, stays the
    # one; what it lacks is added to it
    old = core.retired.get(s.key)
    r = old if old is not None else Retired([])
    segs = [*r.segs, *(seg for seg in kept if seg not in r.segs)]
    persistent = [t for t, tier in enumerate(core.tiers) if tier.persistent]
    claimed: dict[int, list[Seg]] = {}
    written: list[int] = []
    core.retiring[s.key] = r  # (a fork's copy meanwhile takes its markers for present)
    try:
        # a fork's copy of a kept segment into a persistent tier may be under way (it
        # checked for a marker before this retirement): wait for it, and start no other
        # until the marker is there and the retirement recorded (later copies then write
        # the marker first, see copying)
        for t in persistent:
            claimed[t] = await claim(kept, t)
        tiers = sorted({t for seg in kept for t in seg.tiers if t in persistent})
        try:
            for t in tiers:
                # (a marker of it being written or deleted: by this record, or by one
                # recorded meanwhile, when a fork's load here found its segments unlisted)
                while (busy := _busy(t, r, _other(core, s.key, r))) is not None:
                    await busy.wait()
                cur = _other(core, s.key, r)
                if t not in r.markers and (cur is None or t not in cur.markers):
                    await _mark(core, s.key, r, t)
                    written.append(t)
            cur = _other(core, s.key, r)
            if cur is not None:  # (all of it listed below)
                await _unmarking(cur)
        except BaseException:
            cur = _other(core, s.key, r)
            for t in written:
                if cur is not None and _needed(cur, t):
                    # a copy of a segment recorded meanwhile took it for present
                    r.markers.discard(t)
                    cur.markers.add(t)
                else:
                    await _delete_marker(core, s.key, r, t)
            raise
        r.segs = segs
        if cur is not None:  # one record, listing the markers of both
            r.segs.extend(seg for seg in cur.segs if seg not in r.segs)
            r.markers |= cur.markers
        core.retired[s.key] = r
    finally:
        if core.retiring.get(s.key) is r:
            del core.retiring[s.key]
        for t, segs_t in claimed.items():
            unclaim(segs_t, t)


async def marked(core: Core, owner: str) -> None:
    """Commit ``owner``'s retirement marker in every persistent tier of this replica's own
    that holds (or is being given) one of its retired segments and lacks it.

    :func:`retire` writes the markers of a conversation leaving the index itself; this is
    for a record made without them, when a history left the index because the shared
    tier holds another one or none (:func:`~tieredkv._cache.shared_forest.keep_for_forks`):
    without its marker, a restart would take the segments its forks keep for a live
    conversation, and serve it, or append to it, as the history this replica had
    reported lost.

    :raises TierIOError: a marker could not be written (tried again at the next load of
        ``owner`` here)
    """
    r = core.retired.get(owner)
    if r is None:
        return
    for t, tier in enumerate(core.tiers):
        if not tier.persistent or core.io[t].shared is not None:
            continue
        while (busy := _busy(t, r)) is not None:  # (a fork's copy writing it, say)
            await busy.wait()
        if core.retired.get(owner) is not r:  # (forgotten, or listed again, meanwhile)
            return
        if t not in r.markers and _needed(r, t):
            await _mark(core, owner, r, t)


def _other(core: Core, owner: str, r: Retired) -> Retired | None:
    """The record of ``owner`` now in the index, if it is not ``r`` (one recorded while
    ``r`` was being made: a fork's load here found ``owner``'s segments unlisted)."""
    cur = core.retired.get(owner)
    return cur if cur is not r else None


def _busy(t: int, *records: Retired | None) -> anyio.Event | None:
    """A write or delete under way of a marker in tier ``t`` by one of ``records``."""
    return next((e for r in records if r is not None and (e := r.busy.get(t))), None)


def _needed(r: Retired, t: int) -> bool:
    """Whether a segment of ``r`` is in tier ``t``, or being copied there."""
    return any(t in seg.tiers or t in seg.claims for seg in r.segs)


async def _unmarking(r: Retired) -> None:
    """Wait until no write or delete of ``r``'s markers is under way."""
    while r.busy:
        await next(iter(r.busy.values())).wait()


async def copying(core: Core, keys: list[SegmentKey], dst: int) -> None:
    """Before segments ``keys`` are copied into tier ``dst``: the retirement marker of each
    retired owner among them, where ``dst`` is persistent and lacks it.

    :raises TierIOError: a marker could not be written (nothing was copied)
    """
    if not core.retired or not core.tiers[dst].persistent:
        return
    wanted = set(keys)
    for owner in sorted({k[0] for k in keys if k[0] in core.retired}):
        # a delete of the marker there may be under way (it decided before this copy was
        # claimed): wait for it, then look again (the record may be gone with it, or the
        # owner's history listed again here: a live conversation has no marker)
        # (or, by a retirement of the owner under way here, which makes the record of
        # its own: its marker serves this copy too, see retire)
        while (r := _retiring(core, owner, wanted)) is not None and (
            busy := _busy(dst, r, _pending(core, owner, r))
        ) is not None:
            await busy.wait()
        if r is not None and dst not in r.markers and not _pending_marked(core, owner, r, dst):
            await _mark(core, owner, r, dst)


def _pending(core: Core, owner: str, r: Retired) -> Retired | None:
    """The record a retirement of ``owner`` under way is making, if it is not ``r``."""
    pending = core.retiring.get(owner)
    return pending if pending is not r else None


def _pending_marked(core: Core, owner: str, r: Retired, t: int) -> bool:
    """Whether a retirement of ``owner`` under way (:func:`_pending`) wrote its marker in
    tier ``t``."""
    pending = _pending(core, owner, r)
    return pending is not None and t in pending.markers


def _retiring(core: Core, owner: str, keys: set[SegmentKey]) -> Retired | None:
    """``owner``'s retirement record, if it lists some of ``keys`` (a copy of them needs
    its marker)."""
    r = core.retired.get(owner)
    return r if r is not None and any(seg.key in keys for seg in r.segs) else None


async def deleted(core: Core, segs: list[Seg], t: int) -> None:
    """``segs`` just left tier ``t``: a retired owner none of whose segments ``t`` holds
    any more, and none of whose segments is being copied into ``t`` (or deleted from it:
    that delete comes here next), loses its marker there; one whose segments no tier holds
    is forgotten.

    A marker kept because a copy was under way stays after the copy failed, spare until
    the next segment of its owner leaves a tier (or a restart); it never stands for a live
    conversation (see :func:`relisted`).
    """
    for owner in sorted({seg.key[0] for seg in segs if seg.key[0] in core.retired}):
        r = core.retired.get(owner)
        if r is not None:  # (not forgotten while an earlier owner's marker was deleted)
            await _drop_spare(core, owner, r)


async def relisted(core: Core, owner: str) -> None:
    """``owner``'s history was just listed here again (taken in from a shared tier): what
    it lists is no longer retired, so a marker of it that stands for no retired segment
    any more (a write of one under way: once written) is deleted now. Left there, it would
    stand for the live conversation, and a restart would take it for retired and serve
    none of its turns."""
    r = core.retired.get(owner)
    if r is None:
        return
    await _unmarking(r)  # (a marker a fork's copy is writing, or one being deleted)
    await _drop_spare(core, owner, r)


async def _drop_spare(core: Core, owner: str, r: Retired) -> None:
    """Delete ``owner``'s spare markers (:func:`_spare`); forget its record ``r`` once no
    tier holds any of its segments and it has no marker left."""
    for u in sorted(r.markers):  # any tier: a marker a failed copy left elsewhere too
        if _spare(core, owner, r, u):
            async with _marking(r, u):
                await _delete_marker(core, owner, r, u)
    gone = not any(seg.tiers for seg in r.segs) and not r.markers and not r.busy
    if gone and core.retired.get(owner) is r:  # (not one recorded meanwhile)
        del core.retired[owner]


def _spare(core: Core, owner: str, r: Retired, t: int) -> bool:
    """Whether ``owner``'s marker in tier ``t`` stands for nothing: no segment of it is
    there, being copied there or being deleted from there (nor failed to be: an orphan),
    and no write or delete of the marker is under way."""
    stale = any(u == t and k[0] == owner and k[1] != RETIRED_SEQ for u, k in core.orphans)
    return t in r.markers and t not in r.busy and not stale and not _needed(r, t)


@contextlib.asynccontextmanager
async def _marking(r: Retired, t: int) -> AsyncIterator[None]:
    """``async with``: ``r``'s marker in tier ``t`` is being written or deleted (a copy of
    its segments into ``t`` waits, see :func:`copying`)."""
    done = r.busy[t] = anyio.Event()
    try:
        yield
    finally:
        del r.busy[t]
        done.set()


async def _mark(core: Core, owner: str, r: Retired, t: int) -> None:
    """Write ``owner``'s marker in tier ``t`` for its record ``r`` (a copy of its segments
    into ``t`` waits meanwhile)."""
    async with _marking(r, t):
        await _write_marker(core, owner, t)
        r.markers.add(t)


async def _write_marker(core: Core, owner: str, t: int) -> None:
    from .placement import delete_or_orphan, reserve  # (placement calls this module)

    key: SegmentKey = (owner, RETIRED_SEQ)
    plan = plan_retirement(owner)
    tier = core.tiers[t]
    if (t, key) in core.orphans and not await delete_or_orphan(core, t, key):
        raise TierIOError(tier.name, "write a retirement marker", "a stale one remains")
    try:
        if not await reserve(core, t, key, plan.length, {owner}):
            raise TierIOError(tier.name, "write a retirement marker", "the tier is full")
        await core.io[t].write_new(key, plan, core.staging)
    finally:
        tier.release(key)


async def _delete_marker(core: Core, owner: str, r: Retired, t: int) -> None:
    """Delete ``owner``'s marker in tier ``t``. It is no longer listed even if the delete
    fails: it is then an orphan, deleted again before its key is used and at close, so a
    listed marker would stand for nothing, and a copy of the owner's segments into ``t``
    meanwhile would take it for present and write none (:func:`copying` writes one: the
    orphan is deleted first)."""
    from .placement import delete_or_orphan

    r.markers.discard(t)
    await delete_or_orphan(core, t, (owner, RETIRED_SEQ))
