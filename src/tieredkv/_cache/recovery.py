"""Rebuilding the index at open from what persistent tiers kept.

Per session, the longest run of segments ``0..n-1`` that some tier holds completely, with
one schema throughout, is the history; each tier keeps its segments of that history only
if it holds the whole of it (a partial copy is of no use). Everything else a tier listed
(gaps, segments past a schema change, stale lengths) is deleted. A tier that shrank since
the last run evicts down to its capacity.

A session whose tiers stored more turns than that history has (a turn the tier's open
found damaged and set aside, a missing one, or one of another schema, and whatever
followed) is *truncated*: :func:`recover` returns a :class:`Truncation` for each, and logs
it, so that a shorter history is never served without a word.
"""

from __future__ import annotations

import logging

import anyio
import msgspec

from ..backends.base import Tier
from ..meta import TierInfo
from ..payload import SegmentHeader, header_schema
from .atomic import settle
from .placement import delete_or_orphan, evict_copy, remove_copy
from .state import Core, Seg, Session

__all__ = ["Truncation", "open_tiers", "recover"]

_log = logging.getLogger("tieredkv.cache")


class Truncation(msgspec.Struct, frozen=True, kw_only=True):
    """A history that the last open brought back shorter than its tiers had stored it.

    :param session: the session key
    :param turns: the turns it came back with (0: it did not come back)
    :param stored: the turns its tiers held, as far as the open could tell (the highest
        segment number found, damaged ones included, plus one)
    :param reason: why turn ``turns`` and those after it were not recovered
    """

    session: str
    turns: int
    stored: int
    reason: str


async def open_tiers(core: Core) -> tuple[dict[str, Truncation], BaseException | None]:
    """Open every tier (closing those opened if one fails), tell the channel about them,
    and rebuild the index from what persistent tiers kept; the truncated sessions, and a
    cancellation that arrived while the index was rebuilt (it completes first; the caller
    raises it)."""
    opened: list[Tier] = []
    recovered = []
    try:
        for tier in core.tiers:
            recovered.append(await tier.open())
            opened.append(tier)
    except BaseException:
        with anyio.CancelScope(shield=True):
            for tier in opened:
                await tier.aclose()
        raise
    core.channel.set_tiers(
        TierInfo(name=t.name, level=i, capacity=t.capacity) for i, t in enumerate(core.tiers)
    )
    core.outputs.open()
    return await settle(lambda: recover(core, recovered))


async def recover(core: Core, recovered: list[list[SegmentHeader]]) -> dict[str, Truncation]:
    """Index what each tier recovered (``recovered[t]``: tier ``t``'s headers); return the
    truncated sessions (also counted in ``core.stats.truncated``)."""
    ntiers = len(core.tiers)
    by_session: dict[str, list[dict[int, SegmentHeader]]] = {}
    for t, headers in enumerate(recovered):
        for h in headers:
            by_session.setdefault(h.session, [{} for _ in range(ntiers)])[t][h.seq] = h
    now = core.clock()
    truncated: dict[str, Truncation] = {}
    for key, per_tier in by_session.items():
        s = _rebuild(key, per_tier, ntiers)
        cut = _truncation(core, s, per_tier)
        if cut is not None:
            truncated[key] = cut
        for t, segs in enumerate(per_tier):
            for seq in sorted(segs, reverse=True):
                if seq not in s.held[t]:
                    await delete_or_orphan(core, t, (key, seq))
        if not any(s.complete(t) for t in range(ntiers)):
            for t in range(ntiers):
                await remove_copy(core, s, t)
            continue
        for t in range(ntiers):
            if s.held[t] and not s.complete(t):
                await remove_copy(core, s, t)
        s.primary = next(t for t in range(ntiers) if s.complete(t))
        core.sessions[key] = s
        meta = core.meta(s, now, answer=s.segs[-1].header.answer_tokens, restart=True)
        core.residency.published(meta)
        for t in range(ntiers):
            if s.complete(t):
                core.residency.admitted(meta, now, t)
    for t, tier in enumerate(core.tiers):  # a tier may have shrunk since the last run
        if tier.used > tier.capacity:
            victims = core.policies[t].victims(tier.used - tier.capacity, now, core.channel) or []
            for victim in victims:
                vs = core.sessions[victim]
                async with core.hold(vs):
                    await evict_copy(core, vs, t)
    core.stats.truncated = len(truncated)
    for cut in truncated.values():
        _log.warning(
            "session %.80r came back with %d of the %d turns its tiers stored: %s",
            cut.session,
            cut.turns,
            cut.stored,
            cut.reason,
        )
    return truncated


def _truncation(
    core: Core, s: Session, per_tier: list[dict[int, SegmentHeader]]
) -> Truncation | None:
    """What ``s`` (just rebuilt) lost against what its tiers held, or ``None``."""
    aside: set[int] = set()
    for io in core.io:
        if io.set_aside is not None:
            aside.update(io.set_aside(s.key))
    found = set(aside).union(*per_tier)
    kept = len(s.segs) if any(s.complete(t) for t in range(len(core.tiers))) else 0
    stored = max(found) + 1 if found else 0
    if stored <= kept:
        return None
    if kept in aside:
        reason = f"turn {kept} was damaged (quarantined)"
    elif not any(kept in segs for segs in per_tier):
        reason = f"turn {kept} is missing"
    else:
        reason = f"turn {kept} does not fit the turns before it (another schema or length)"
    return Truncation(session=s.key, turns=kept, stored=stored, reason=reason)


def _rebuild(key: str, per_tier: list[dict[int, SegmentHeader]], ntiers: int) -> Session:
    """The session's history: the longest gap-free prefix some tier holds, one schema."""
    prefix: list[int] = []
    for segs in per_tier:
        n = 0
        while n in segs:
            n += 1
        prefix.append(n)
    n = max(prefix)
    best = prefix.index(n)
    headers = [per_tier[best][i] for i in range(n)]
    schema = header_schema(headers[0]) if headers else None
    good = 0
    for h in headers:
        if schema is None or header_schema(h) != schema:
            break
        good += 1
    s = Session(key, ntiers)
    s.segs = [Seg(h) for h in headers[:good]]
    s.schema = schema
    for t, segs in enumerate(per_tier):
        keep = good if prefix[t] >= good else 0
        for seq in segs:
            if seq < keep and segs[seq].length == s.segs[seq].length:
                s.held[t].add(seq)
    return s
