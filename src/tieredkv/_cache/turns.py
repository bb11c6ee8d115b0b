"""One turn's storage work: writing a new segment, and restoring a history into tensors.

Each runs inside :func:`~tieredkv._cache.atomic.settle` with the session's lock held. The
caller commits the result to the index (append) or the counters (load) only after it
returns, with nothing awaited in between: that is the operation's point of no return.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from ..backends.base import AddressableTier, SegmentKey, StreamingReadTier
from ..errors import CapacityError, CorruptSegmentError, SchemaMismatchError
from ..meta import KVMeta, Loaded, Stored
from ..payload import SegmentPlan, plan_segment
from .gather import StreamScatter, copy_out_addressable, scatter, write_new
from .placement import demote, drop_damaged, promote, purge_orphans, reserve
from .state import Core, Seg, Session

__all__ = ["commit_append", "commit_load", "plan_turn", "restore", "store"]


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
        await write_new(core.tiers[t], key, plan, core.staging)
    finally:
        core.tiers[t].release(key)
    return t


async def restore(core: Core, s: Session, out: dict[str, torch.Tensor]) -> None:
    """Promote ``s`` if it is not in tier 0 (and fits), then copy it into ``out``."""
    if s.primary != 0:
        await promote(core, s)
    assert s.primary is not None
    assert s.schema is not None
    t = s.primary
    tier = core.tiers[t]
    dim = s.schema.token_dim
    if isinstance(tier, AddressableTier):
        parts = [(k, g.header) for k, g in zip(s.segment_keys(), s.segs, strict=True)]
        await copy_out_addressable(tier, parts, out, dim)
        return
    if isinstance(tier, StreamingReadTier):
        await _stream(core, s, t, tier, out, dim)
        return
    await _read_through_staging(core, s, t, out, dim)


async def _stream(
    core: Core,
    s: Session,
    t: int,
    tier: StreamingReadTier,
    out: dict[str, torch.Tensor],
    dim: int,
) -> None:
    """Copy ``s``'s history into ``out`` as tier ``t`` streams it, span by span: one
    worker-thread call for the whole history, the device's queue kept full across segments,
    and each tensor copied once, from the span that holds it, while later spans are read."""
    consume = StreamScatter([seg.header for seg in s.segs], out, dim, tier.span_bytes)
    items = list(zip(s.segment_keys(), consume.spans, strict=True))
    try:
        await tier.read_spans(items, consume)
    except CorruptSegmentError as exc:
        await drop_damaged(core, s, t, exc.where)
        raise


_READS_AHEAD = 2
"""Segment reads in flight while a load scatters the segment before them."""


async def _read_through_staging(
    core: Core, s: Session, t: int, out: dict[str, torch.Tensor], dim: int
) -> None:
    """Read ``s``'s segments from tier ``t`` into reused staging buffers and scatter each
    into ``out`` as it arrives.

    For tiers that neither stream (:class:`StreamingReadTier`: the SSD tier loads through
    :func:`_stream`) nor give addressable slots, such as a shared tier. Up to
    :data:`_READS_AHEAD` segment reads are in flight while segment i is scattered (in a
    worker thread), so the tier is not idle while the copy runs. A failed read stops the
    load at the first segment that failed; reads already in flight finish first (a worker
    thread is never abandoned while it writes into a staging buffer).
    """
    tier = core.tiers[t]
    segs = s.segs
    size = max(seg.length for seg in segs)
    depth = min(len(segs), _READS_AHEAD + 1)
    failure: dict[int, BaseException] = {}
    done = [anyio.Event() for _ in segs]

    with contextlib.ExitStack() as stack:
        bufs = [stack.enter_context(core.staging.buffer(size)) for _ in range(depth)]

        async def read(i: int) -> None:
            seg = segs[i]
            try:
                await tier.read_into((s.key, seg.header.seq), bufs[i % depth][: seg.length])
            except BaseException as exc:  # re-raised below, outside the task group
                failure[i] = exc
            finally:
                done[i].set()

        async with anyio.create_task_group() as tg:
            for i in range(depth - 1):
                tg.start_soon(read, i)
            offset = 0
            for i, seg in enumerate(segs):
                await done[i].wait()
                if failure:
                    break
                if i + depth - 1 < len(segs):  # into the buffer segment i - 1 was copied from
                    tg.start_soon(read, i + depth - 1)
                view = bufs[i % depth][: seg.length]
                await anyio.to_thread.run_sync(scatter, view, seg.header, out, dim, offset, False)
                offset += seg.header.tokens
    if failure:
        exc = failure[min(failure)]
        if isinstance(exc, CorruptSegmentError):
            await drop_damaged(core, s, t, exc.where)
        raise exc


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
    meta = core.publish(s, now, access=True, answer=answer_tokens)
    # the access first, then the admission (as the replay does): a policy must see a new
    # session's first turn as its first access, not as a reuse at distance 0
    for policy in core.policies:
        policy.on_access(s.key, meta, now)
    core.policies[t].on_admit(s.key, meta, now)
    core.channel.emit(
        Stored(
            session=s.key,
            time=now,
            nbytes=plan.length,
            tier=core.tiers[t].name,
            tokens=plan.header.tokens,
            seconds=now - began,
        )
    )
    return meta


def commit_load(core: Core, s: Session, hit: bool, began: float) -> None:
    """Count a served load and record it as an access (channel, policies, event)."""
    now = core.clock()
    if hit:
        core.stats.hits += 1
    else:
        core.stats.misses += 1
    core.stats.loads += 1
    meta = core.publish(s, now, access=True)
    for policy in core.policies:
        policy.on_access(s.key, meta, now)
    assert s.primary is not None
    core.channel.emit(
        Loaded(
            session=s.key,
            time=now,
            nbytes=meta.nbytes,
            tier=core.tiers[s.primary].name,
            hit=hit,
            seconds=now - began,
        )
    )
