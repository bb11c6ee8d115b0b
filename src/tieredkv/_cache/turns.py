"""One turn's storage work: writing a new segment, and restoring a history into tensors.

Each runs inside :func:`~tieredkv._cache.atomic.settle` with the session's lock held. The
caller commits the result to the index (append) or the counters (load) only after it
returns, with nothing awaited in between: that is the operation's point of no return.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from .._checks import check_int
from ..backends.base import SegmentKey
from ..errors import (
    CapacityError,
    CommitDelayedError,
    CorruptSegmentError,
    HistoryLengthError,
    HistoryLostError,
    InvalidArgumentError,
    SchemaMismatchError,
    SessionNotFoundError,
)
from ..meta import KVMeta, Loaded, Stored
from ..payload import SegmentPlan, plan_segment, segment_id
from .atomic import settle
from .forest import check_no_stale, check_not_retired
from .gather import Target
from .placement import (
    delete_or_orphan,
    demote,
    drop_damaged,
    forget_history,
    promote,
    purge_orphans,
    remove_copy,
    reserve,
    unlist,
)
from .shared_forest import check_forks
from .sharing import check_writer, discover
from .state import Core, Seg, Session
from .writethrough import WriteThrough

_LOSS = "its last copy was evicted or found damaged, or the shared tier lost it"
"""Why a conversation in :attr:`Core.unreported` has no history (:class:`HistoryLostError`)."""

BUSY_WAIT = 10.0
"""Longest wait, s, for busy conversations to become victims again before a fork's first
turn is refused for want of room in its parent's tier."""

__all__ = [
    "append",
    "commit_append",
    "commit_load",
    "damaged",
    "load",
    "missed",
    "plan_turn",
    "restore",
    "store",
]


async def append(
    core: Core,
    pumps: WriteThrough,
    session: str,
    tensors: Mapping[str, Any],
    answer_tokens: int,
    dim: int,
    codec: str,
    parent: tuple[str, int | None] | None = None,
    expected: int | None = None,
) -> KVMeta:
    """Store one turn of ``session`` (see :meth:`~tieredkv.TieredKVCache.append`): under the
    session's lock, all or nothing whatever cancels it; in inclusive mode a background copy
    to the next tier follows. With ``parent`` (``(conversation, tokens)``, ``None`` tokens
    for all of them) the turn is the first of a fork: under the parent's lock too. With
    ``expected``, only if the history it extends holds that many tokens."""
    sessions = core.sessions
    while True:
        s = await core.session(session)
        try:
            async with core.hold(s):
                if sessions.get(session) is not s:  # dropped while we waited
                    continue
                if parent is not None:
                    return await _fork_locked(
                        core, pumps, s, parent, tensors, answer_tokens, dim, codec, expected
                    )
                if core.sharing:  # one writer per conversation across replicas
                    await check_writer(core, session, commits=_commits_into(core, s))
                return await _append_locked(
                    core, pumps, s, tensors, answer_tokens, dim, codec, None, expected
                )
        finally:
            core.discard_unused(s)  # a first append that failed or was cancelled


async def _fork_locked(
    core: Core,
    pumps: WriteThrough,
    s: Session,
    parent: tuple[str, int | None],
    tensors: Mapping[str, Any],
    answer_tokens: int,
    dim: int,
    codec: str,
    expected: int | None = None,
) -> KVMeta:
    """The first turn of ``s`` (locked), a fork of ``parent``'s first tokens: stored in
    the tier that serves the parent, referencing the parent's segments (held, with the
    parent's lock, until the turn is committed)."""
    key, tokens = parent
    if s.segs and s.primary is not None:
        raise InvalidArgumentError(
            f"conversation {s.key!r} is already stored; a conversation becomes a fork at its "
            f"first turn (drop it first, or fork under a new key)"
        )
    if key == s.key:
        raise InvalidArgumentError(f"conversation {key!r} cannot be forked from itself")
    if core.sharing:  # the fork's writer lease (as for any new conversation), and the
        check_forks(core)  # parent's current history (another replica's, maybe)
        await check_writer(core, s.key)
        if not await discover(core, key, take=False):
            raise SessionNotFoundError(key)
    p = core.sessions.get(key)
    if p is None or p.primary is None:
        raise SessionNotFoundError(key)
    async with core.hold(p):
        if core.sessions.get(key) is not p or p.primary is None:  # dropped or lost meanwhile
            raise SessionNotFoundError(key)
        inherited = fork_point(p, tokens)
        return await _append_locked(
            core, pumps, s, tensors, answer_tokens, dim, codec, (p, inherited), expected
        )


def _check_expected(
    s: Session, expected: int, fork: tuple[Session, list[tuple[Seg, int]]] | None
) -> None:
    """Refuse ``s``'s next turn (planned: a lost history is unlisted) unless the history it
    extends holds ``expected`` tokens (a fork's: those it inherits).

    :raises HistoryLengthError: the history holds another number of tokens
    """
    held = s.tokens() if fork is None else sum(n for _, n in fork[1])
    if held != expected:
        raise HistoryLengthError(s.key, held=held, expected=expected)


def _commits_into(core: Core, s: Session) -> int | None:
    """The level of the shared tier that ``s``'s next segment is written into and committed
    in, if it can go nowhere else: the tier its store starts at (its history's, or the
    first), when that is a shared tier and the last one (no tier below to fall back to)."""
    t = 0 if s.primary is None else s.primary
    return t if t == len(core.tiers) - 1 and core.io[t].shared is not None else None


def fork_point(p: Session, tokens: int | None) -> list[tuple[Seg, int]]:
    """The segments (and tokens of each) of ``p``'s first ``tokens`` tokens (all if ``None``).

    :raises ValueError: ``tokens`` out of range
    """
    total = p.tokens()
    if tokens is None:
        tokens = total
    check_int("parent_tokens", tokens, minimum=1)
    if tokens > total:
        raise InvalidArgumentError(
            f"parent_tokens is {tokens}, but conversation {p.key!r} holds {total} tokens"
        )
    out: list[tuple[Seg, int]] = []
    left = tokens
    for seg, take in zip(p.segs, p.takes, strict=True):
        if left <= 0:
            break
        out.append((seg, min(take, left)))
        left -= take
    return out


async def _append_locked(
    core: Core,
    pumps: WriteThrough,
    s: Session,
    tensors: Mapping[str, Any],
    answer_tokens: int,
    dim: int,
    codec: str,
    fork: tuple[Session, list[tuple[Seg, int]]] | None = None,
    expected: int | None = None,
) -> KVMeta:
    began = core.clock()
    plan = plan_turn(core, s, tensors, answer_tokens, dim, codec, fork)
    since = core.unreported.get(s.key)
    if since is not None and fork is None:  # the history this turn extends is gone: told
        core.told(s.key)  # once (a first turn, expected 0, starts the conversation afresh)
        if expected != 0:
            raise HistoryLostError(s.key, _LOSS)
    if expected is not None:
        _check_expected(s, expected, fork)
    start, parent = (None, "") if fork is None else (fork[0].primary, fork[0].key)
    try:
        t, cancel = await settle(lambda: store(core, s, plan, start, parent))
        if cancel is not None and core.io[t].shared is None:  # roll back: it never happened
            await settle(lambda: delete_or_orphan(core, t, (s.key, plan.header.seq)))
            raise cancel
    finally:
        s.outdated.clear()  # (from the commit below on, the index says it)
    # the point of no return: from here on, nothing awaits. A turn committed to a shared
    # tier cannot be taken back (other replicas may serve it already): the append
    # completes, and a cancellation that arrived meanwhile is raised after it
    if fork is not None:
        inherit(core, s, fork[0], fork[1])
        if since is not None:  # (a fork's first turn starts afresh: its loss is no news now
            core.told(s.key, since)  # it is stored, and stays to be told if it is not)
    meta = commit_append(core, s, plan, t, answer_tokens, began)
    if core.mode == "inclusive":
        pumps.start(s)
    if cancel is not None:
        core.completed_despite_cancel()
        raise cancel
    return meta


async def load(core: Core, s: Session, target: Target) -> int:
    """Restore ``s`` (locked, stored) into what ``target`` gives, count it and record the
    access; its token count. All or nothing whatever cancels it.

    :raises SessionNotFoundError: the history was found damaged, with no whole copy left
        (a miss: nothing of it stays listed)
    """
    assert s.schema is not None
    out = target(s.schema, s.tokens())
    began = core.clock()
    hit = s.primary == 0
    for tries in range(len(core.tiers), -1, -1):  # (each damaged copy found goes)
        try:
            _, cancel = await settle(lambda: restore(core, s, out))
        except CorruptSegmentError as exc:
            if s.primary is not None and tries:  # the damage cost that copy: another
                continue  # holds all of it
            await missed(core, s)
            raise SessionNotFoundError(s.key, damaged(exc)) from None
        break
    if cancel is not None:
        raise cancel
    commit_load(core, s, hit, began)
    return s.tokens()


async def missed(core: Core, s: Session) -> None:
    """A load found ``s``'s history damaged and reports a miss: count it, and let nothing
    of the history stay listed (a whole copy left in another tier too), so that the next
    append starts the conversation afresh rather than extending what the caller was told
    is gone."""
    core.stats.misses += 1
    with anyio.CancelScope(shield=True):
        await forget_history(core, s)


def damaged(exc: CorruptSegmentError) -> str:
    """Why a history found damaged is not served (a :class:`SessionNotFoundError` reason)."""
    return f"its stored history was found damaged and set aside ({exc})"


def plan_turn(
    core: Core,
    s: Session,
    tensors: Mapping[str, Any],
    answer_tokens: int,
    dim: int,
    codec: str,
    fork: tuple[Session, list[tuple[Seg, int]]] | None = None,
) -> SegmentPlan:
    """Plan ``s``'s next segment, refusing what cannot be stored before any I/O (a fork's
    first turn: after the segments it inherits, which it names in its header)."""
    if s.primary is None and s.segs:  # lost or damaged earlier: start afresh
        unlist(core, s)
    check_not_retired(core, s.key, len(s.segs))
    base = () if fork is None else tuple((g.key[0], g.key[1], n) for g, n in fork[1])
    # (and which segments those are: another history's turn stored under one of their
    # keys later is never taken for it)
    ids = () if fork is None else tuple(segment_id(g.header) for g, _ in fork[1])
    # the parent, named where a restart could not tell it from the turns listed
    parent = "" if fork is None or fork[0].key == base[-1][0] else fork[0].key
    plan = plan_segment(
        s.key,
        len(base) if fork is not None else len(s.segs),
        tensors,
        token_dim=dim,
        answer_tokens=answer_tokens,
        codec=codec,
        created=time.time(),
        base=base,
        parent=parent,
        base_ids=ids,
    )
    schema = s.schema if fork is None else fork[0].schema
    if schema is not None and (s.segs or fork is not None):
        diff = schema.describe_difference(plan.schema)
        if diff is not None:
            raise SchemaMismatchError(s.key, diff)
    largest = max(t.capacity for t in core.tiers)
    before = s.nbytes() if fork is None else sum(g.length for g, _ in fork[1])
    if plan.length + before > largest:
        what = "the segment" if not before else "the session with this segment"
        raise CapacityError(what, plan.length + before, largest)
    return plan


async def store(
    core: Core, s: Session, plan: SegmentPlan, start: int | None = None, parent: str = ""
) -> int:
    """Write the planned segment into the highest tier that can take it; return the tier.

    The segment is committed in that tier but not yet in the index. A fork's first turn
    (``start``: the tier that serves its parent, ``parent``, held by the caller) goes into
    that tier or nowhere: while conversations busy there (a background copy, a load) are
    the only victims left, it waits for them, for up to :data:`BUSY_WAIT` seconds.
    """
    await purge_orphans(core, s.key)
    check_no_stale(core, s.key)
    key: SegmentKey = (s.key, plan.header.seq)
    t = start if start is not None else 0 if s.primary is None else s.primary
    deadline = anyio.current_time() + BUSY_WAIT
    try:
        while not await reserve(core, t, key, plan.length, {s.key}):
            if start is not None and await _wait_for_victims(core, t, {s.key, parent}, deadline):
                continue
            if start is not None:
                tier = core.tiers[t]
                what = f"the fork's first turn (stored in its parent's tier, {tier.name!r})"
                raise CapacityError(what, plan.length, tier.capacity - tier.used)
            if t + 1 >= len(core.tiers):
                tier = core.tiers[t]
                raise CapacityError("the segment", plan.length, tier.capacity - tier.used)
            if s.primary == t:
                # the session itself no longer fits here: move it down whole
                await s.wait_quiet()
                await demote(core, s, t, may_lose=False)
                if s.primary is not None and s.primary > t + 1:
                    # it moved past the next tier, into a lower one that held all of it:
                    # its turn goes there too (in a tier above it, its history would be
                    # split, and every load would read the turn where it is not)
                    t = s.primary
                    continue
            t += 1
        await core.io[t].write_new(key, plan, core.staging)
    except CommitDelayedError as exc:  # written straight to a shared tier: not kept here
        raise CommitDelayedError(
            exc.tier, exc.session, exc.retry_in, kept=False, why=exc.why
        ) from exc
    finally:
        core.tiers[t].release(key)
    outdated = _outdated(core, s, t)
    s.outdated.update(outdated)  # until the turn is committed or rolled back
    for u in outdated:
        await remove_copy(core, s, u)
    if outdated:
        core.publish(s)  # (its copies, whether or not the turn is committed now)
    return t


def _outdated(core: Core, s: Session, t: int) -> list[int]:
    """The local tiers whose complete copy of ``s`` its next turn, stored in tier ``t``, will
    leave incomplete for good: a copy above ``t`` (in inclusive mode, one its forks kept
    whole there when ``s`` moved down), or one below that no background copy extends (only
    the tier right below ``t`` is written through). Left there, it would be a partial copy
    that no policy tracks and nothing frees; its segments that another conversation needs
    there stay (:func:`~tieredkv._cache.placement.remove_copy`).

    Removed before the turn is committed, so the append has nothing left to await after
    its point of no return (a cancellation arriving then would read as not stored); from
    then until the commit (or the roll-back), ``s`` keeps nothing in those tiers for
    another conversation leaving them to keep (:attr:`Session.outdated`). If the append is
    rolled back, only that copy is gone: loads are served from ``t``."""
    follows = t + 1 if core.mode == "inclusive" else None
    return [
        u
        for u in range(len(core.tiers))
        if u not in (t, follows) and core.io[u].shared is None and s.complete(u)
    ]


async def _wait_for_victims(core: Core, t: int, held: set[str], deadline: float) -> bool:
    """Wait until a conversation busy now with a copy in tier ``t`` (a victim once idle
    again), other than ``held``, is idle; ``False`` at once if there is none, or by
    ``deadline``.

    Conversations held by another operation waiting here too are not waited for: each
    would wait for the other (two forks, each holding its parent, each parent the only
    victim left for the other), so the later one gives up and the earlier one gets the
    room when it does. Only the conversations busy now count: one another operation makes
    busy and idle again meanwhile (a victim it tried) does not end the wait, so two waiting
    operations never wake each other in turn without end; and the deadline is checked
    here, not left to a cancellation that a wakeup arriving first would pre-empt.
    """
    waiting = core.waiting_for_room
    blockers = {
        k
        for k in core.busy.keys() - held - waiting.keys()
        if (u := core.sessions.get(k)) is not None and u.holds(t)
    }
    if not blockers or anyio.current_time() >= deadline:
        return False
    mine = Counter(held)
    waiting += mine
    try:
        with anyio.move_on_after(deadline - anyio.current_time()):
            while blockers <= core.busy.keys():
                await core.wait_unbusy()
    finally:
        waiting -= mine  # (in place; keys whose count reaches 0 go)
    return anyio.current_time() < deadline


async def restore(core: Core, s: Session, out: dict[str, torch.Tensor]) -> None:
    """Promote ``s`` if it is not in tier 0 (and fits), then copy it into ``out`` (the way
    its tier's I/O was bound: :mod:`tieredkv._cache.tierio`). A damaged segment costs ``s``
    that copy (and raises)."""
    if s.primary != 0:
        await promote(core, s)
    assert s.primary is not None
    assert s.schema is not None
    t = s.primary
    headers = [seg.header for seg in s.segs]
    try:
        await core.io[t].restore(
            s.segment_keys(), headers, s.takes, out, s.schema.token_dim, core.staging
        )
    except CorruptSegmentError as exc:
        await drop_damaged(core, s, t, exc.where)
        raise


def commit_append(
    core: Core, s: Session, plan: SegmentPlan, t: int, answer_tokens: int, began: float
) -> KVMeta:
    """Make a stored segment part of the session: index, counters, channel, policies, event."""
    seg = Seg(plan.header)
    seg.tiers.add(t)
    # a copy elsewhere lacks the new turn now (one its forks made complete, in exclusive
    # mode; in inclusive mode the copy written through is admitted again once complete)
    stored = s.primary is not None  # (not a fork's first turn: no policy tracks it yet)
    stale = [u for u in range(len(core.tiers)) if stored and u != t and s.complete(u)]
    s.add(seg)
    for u in stale:
        core.residency.removed(s.key, u)
    s.schema = plan.schema
    if s.primary is None:
        s.primary = t
    core.stats.appends += 1
    now = core.clock()
    event = Stored(
        session=s.key,
        time=now,
        nbytes=plan.length,
        tier=core.tiers[t].name,
        tokens=plan.header.tokens,
        seconds=now - began,
    )
    # the access, then the admission: a new session's first turn is its first access
    meta = core.meta(s, now, access=True, answer=answer_tokens)
    meta = core.residency.accessed(meta, now, admit=t, event=event)
    if s.base and len(s.segs) == s.base + 1:  # a fork's first turn: it joins t
        core.joined(s, t)
    return meta


def inherit(core: Core, s: Session, p: Session, inherited: list[tuple[Seg, int]]) -> None:
    """``s`` (a fork being committed) lists ``p``'s segments ``inherited``; a conversation
    that listed one of them alone until now is published with its new shared bytes."""
    sharers = {u for seg, _ in inherited if len(seg.users) == 1 for u in seg.users}
    for seg, take in inherited:
        s.add(seg, take)
    s.base = len(inherited)
    s.parent = (p.key, sum(take for _, take in inherited))
    for u in sharers:
        core.reshared(u)


def commit_load(core: Core, s: Session, hit: bool, began: float) -> None:
    """Count a served load and record it as an access (channel, policies, event)."""
    now = core.clock()
    if hit:
        core.stats.hits += 1
    else:
        core.stats.misses += 1
    core.stats.loads += 1
    meta = core.meta(s, now, access=True)
    assert s.primary is not None
    event = Loaded(
        session=s.key,
        time=now,
        nbytes=meta.nbytes,
        tier=core.tiers[s.primary].name,
        hit=hit,
        seconds=now - began,
    )
    core.residency.accessed(meta, now, event=event)
