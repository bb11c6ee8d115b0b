"""One turn's storage work: writing a new segment, and restoring a history into tensors.

Each runs inside :func:`~tieredkv._cache.atomic.settle` with the session's lock held. The
caller commits the result to the index (append) or the counters (load) only after it
returns, with nothing awaited in between: that is the operation's point of no return.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ..backends.base import SegmentKey
from ..errors import (
    CapacityError,
    CommitDelayedError,
    CorruptSegmentError,
    SchemaMismatchError,
    SessionNotFoundError,
)
from ..meta import KVMeta, Loaded, Stored
from ..payload import SegmentPlan, plan_segment
from .atomic import settle
from .gather import Target
from .placement import delete_or_orphan, demote, drop_damaged, promote, purge_orphans, reserve
from .sharing import check_writer
from .state import Core, Seg, Session
from .writethrough import WriteThrough

__all__ = [
    "append",
    "commit_append",
    "commit_load",
    "damaged",
    "load",
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
) -> KVMeta:
    """Store one turn of ``session`` (see :meth:`~tieredkv.TieredKVCache.append`): under the
    session's lock, all or nothing whatever cancels it; in inclusive mode a background copy
    to the next tier follows."""
    sessions = core.sessions
    while True:
        s = sessions.get(session)
        if s is None:
            s = sessions[session] = Session(session, len(core.tiers))
        try:
            async with core.hold(s):
                if sessions.get(session) is not s:  # dropped while we waited
                    continue
                if core.sharing:  # one writer per conversation across replicas
                    await check_writer(core, session)
                return await _append_locked(core, pumps, s, tensors, answer_tokens, dim, codec)
        finally:
            core.discard_unused(s)  # a first append that failed or was cancelled


async def _append_locked(
    core: Core,
    pumps: WriteThrough,
    s: Session,
    tensors: Mapping[str, Any],
    answer_tokens: int,
    dim: int,
    codec: str,
) -> KVMeta:
    began = core.clock()
    plan = plan_turn(core, s, tensors, answer_tokens, dim, codec)
    t, cancel = await settle(lambda: store(core, s, plan))
    if cancel is not None:  # roll back: the segment never happened
        await settle(lambda: delete_or_orphan(core, t, (s.key, plan.header.seq)))
        core.stats.cancelled += 1
        raise cancel
    # the point of no return: from here on, nothing awaits
    meta = commit_append(core, s, plan, t, answer_tokens, began)
    if core.mode == "inclusive":
        pumps.start(s)
    return meta


async def load(core: Core, s: Session, target: Target) -> int:
    """Restore ``s`` (locked, stored) into what ``target`` gives, count it and record the
    access; its token count. All or nothing whatever cancels it.

    :raises SessionNotFoundError: the history was found damaged (a miss)
    """
    assert s.schema is not None
    out = target(s.schema, s.tokens())
    began = core.clock()
    hit = s.primary == 0
    try:
        _, cancel = await settle(lambda: restore(core, s, out))
    except CorruptSegmentError as exc:
        core.stats.misses += 1
        raise SessionNotFoundError(s.key, damaged(exc)) from None
    if cancel is not None:
        core.stats.cancelled += 1
        raise cancel
    commit_load(core, s, hit, began)
    return s.tokens()


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
) -> SegmentPlan:
    """Plan ``s``'s next segment, refusing what cannot be stored before any I/O."""
    if s.primary is None and s.segs:  # lost or damaged earlier: start afresh
        s.segs.clear()
    plan = plan_segment(
        s.key,
        len(s.segs),
        tensors,
        token_dim=dim,
        answer_tokens=answer_tokens,
        codec=codec,
        created=time.time(),
    )
    if s.schema is not None and s.segs:
        diff = s.schema.describe_difference(plan.schema)
        if diff is not None:
            raise SchemaMismatchError(s.key, diff)
    largest = max(t.capacity for t in core.tiers)
    if plan.length + s.nbytes() > largest:
        what = "the segment" if not s.segs else "the session with this segment"
        raise CapacityError(what, plan.length + s.nbytes(), largest)
    return plan


async def store(core: Core, s: Session, plan: SegmentPlan) -> int:
    """Write the planned segment into the highest tier that can take it; return the tier.

    The segment is committed in that tier but not yet in the index.
    """
    await purge_orphans(core, s.key)
    key: SegmentKey = (s.key, plan.header.seq)
    t = 0 if s.primary is None else s.primary
    try:
        while not await reserve(core, t, key, plan.length, {s.key}):
            if t + 1 >= len(core.tiers):
                tier = core.tiers[t]
                raise CapacityError("the segment", plan.length, tier.capacity - tier.used)
            if s.primary == t:
                # the session itself no longer fits here: move it down whole
                await s.wait_quiet()
                await demote(core, s, t, may_lose=False)
            t += 1
        await core.io[t].write_new(key, plan, core.staging)
    except CommitDelayedError as exc:  # written straight to a shared tier: not kept here
        raise CommitDelayedError(exc.tier, exc.session, exc.retry_in, kept=False) from exc
    finally:
        core.tiers[t].release(key)
    return t


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
        await core.io[t].restore(s.segment_keys(), headers, out, s.schema.token_dim, core.staging)
    except CorruptSegmentError as exc:
        await drop_damaged(core, s, t, exc.where)
        raise


def commit_append(
    core: Core, s: Session, plan: SegmentPlan, t: int, answer_tokens: int, began: float
) -> KVMeta:
    """Make a stored segment part of the session: index, counters, channel, policies, event."""
    s.segs.append(Seg(plan.header))
    s.held[t].add(plan.header.seq)
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
    return core.residency.accessed(meta, now, admit=t, event=event)


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
