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
from collections.abc import Container

import anyio
import msgspec

from ..backends.base import Tier
from ..meta import TierInfo
from ..payload import RETIRED_SEQ, SegmentHeader, header_schema, inherits, is_retirement
from .atomic import settle
from .placement import delete_or_orphan, evict_copy
from .state import Core, Retired, Seg, Session

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
    truncated sessions (also counted in ``core.stats.truncated``).

    Every stored segment becomes one :class:`Seg`, whatever number of conversations list
    it; a fork lists the segments its first turn names (its ``base``). A fork whose
    inherited segments are not all found (a dangling reference) is not recovered. A
    segment stays in a tier only while some conversation has a complete copy there.
    """
    ntiers = len(core.tiers)
    by_session: dict[str, list[dict[int, SegmentHeader]]] = {}
    blobs: dict[tuple[str, int], Seg] = {}
    markers: dict[str, set[int]] = {}  # retired conversations: the tiers with their marker
    for t, headers in enumerate(recovered):
        for h in headers:
            if is_retirement(h):
                markers.setdefault(h.session, set()).add(t)
            else:
                by_session.setdefault(h.session, [{} for _ in range(ntiers)])[t][h.seq] = h
    recovered = [[h for h in headers if not is_retirement(h)] for headers in recovered]
    now = core.clock()
    truncated: dict[str, Truncation] = {}
    rebuilt: list[Session] = []
    for key, per_tier in by_session.items():
        if key in markers:  # retired: its segments are its forks' only
            continue
        s, why = _rebuild(key, per_tier, blobs, recovered)
        if _shared_orphan_fork(core, s, per_tier, by_session):
            continue  # (not indexed, nothing lost: its first load reads it from the server)
        cut = _truncation(core, s, per_tier, why)
        if cut is not None:
            truncated[key] = cut
        if s.segs:
            rebuilt.append(s)
    # a segment stays where some conversation listing it is complete (highest first per
    # conversation, so a crash part-way leaves prefixes)
    listed = {seg.key for s in rebuilt for seg in s.segs}
    for t in range(ntiers):
        stored = {(h.session, h.seq) for h in recovered[t]}
        for sk in sorted(stored, key=lambda k: (k[0], -k[1])):
            seg = blobs.get(sk)
            if (
                seg is None
                or sk not in listed
                or t not in seg.tiers
                or not any(u.complete(t) for u in seg.users)
            ):
                if seg is not None:
                    seg.tiers.discard(t)
                await delete_or_orphan(core, t, sk)
    for owner, tiers in markers.items():
        left = [g for k, g in blobs.items() if k[0] == owner and g.tiers]
        if left:
            r = core.retired[owner] = Retired(left)
            r.markers = set(tiers)
        for t in sorted(tiers):
            if not any(t in g.tiers for g in left):
                await delete_or_orphan(core, t, (owner, RETIRED_SEQ))
                if owner in core.retired:
                    core.retired[owner].markers.discard(t)
    for s in rebuilt:
        if not any(s.complete(t) for t in range(ntiers)):
            s.clear()
            continue
        s.primary = next(t for t in range(ntiers) if s.complete(t))
        core.sessions[s.key] = s
    for s in rebuilt:
        if s.primary is None:
            continue
        meta = core.meta(s, now, answer=s.segs[-1].header.answer_tokens, restart=True)
        core.residency.published(meta)
        for t in range(ntiers):
            if s.complete(t):
                core.residency.admitted(meta, now, t)
    for t, tier in enumerate(core.tiers):  # a tier may have shrunk since the last run
        if tier.used > tier.capacity:
            victims = core.policies[t].victims(tier.used - tier.capacity, now, core.channel) or []
            below = "moved down" if t + 1 < ntiers else "deleted: lost"
            _log.warning(
                "tier %r holds %s bytes, past its capacity of %s (smaller than when they "
                "were stored): %d conversation(s) evicted to fit, %s: %s",
                tier.name,
                f"{tier.used:,}",
                f"{tier.capacity:,}",
                len(victims),
                below,
                ", ".join(repr(v[:80]) for v in victims),
            )
            for victim in victims:
                vs = core.sessions[victim]
                async with core.hold(vs):
                    await evict_copy(core, vs, t)
    core.stats.truncated += len(truncated)
    for cut in truncated.values():
        _log.warning(
            "session %.80r came back with %d of the %d turns its tiers stored: %s",
            cut.session,
            cut.turns,
            cut.stored,
            cut.reason,
        )
    return truncated


def _shared_orphan_fork(
    core: Core,
    s: Session,
    per_tier: list[dict[int, SegmentHeader]],
    listed: Container[str],
) -> bool:
    """Whether ``s`` (just rebuilt, empty) is a fork that only shared tiers hold and whose
    parent no tier lists (not among ``listed``, the conversations some tier holds a turn
    of): dropped while the fork lists its turns, which the server keeps for the fork under
    the parent's key, listed by no manifest an open's scan reads."""
    held = [t for t, segs in enumerate(per_tier) if segs]
    if s.segs or not all(core.io[t].shared is not None for t in held):
        return False
    first = min((h for t in held for h in per_tier[t].values()), key=lambda h: h.seq)
    owners = {owner for owner, _, _ in first.base}
    return bool(owners) and not any(owner in listed for owner in owners)


def _truncation(
    core: Core, s: Session, per_tier: list[dict[int, SegmentHeader]], why: str | None
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
    if why is not None:
        reason = why
    elif kept in aside:
        reason = f"turn {kept} was damaged (quarantined)"
    elif not any(kept in segs for segs in per_tier):
        reason = f"turn {kept} is missing"
    else:
        reason = f"turn {kept} does not fit the turns before it (another schema or length)"
    return Truncation(session=s.key, turns=kept, stored=stored, reason=reason)


def _blob(
    blobs: dict[tuple[str, int], Seg], recovered: list[list[SegmentHeader]], key: tuple[str, int]
) -> Seg | None:
    """The one :class:`Seg` of ``key``, holding the tiers that store it at one length."""
    seg = blobs.get(key)
    if seg is not None:
        return seg
    for t, headers in enumerate(recovered):
        for h in headers:
            if (h.session, h.seq) != key:
                continue
            if seg is None:
                seg = blobs[key] = Seg(h)
            if h.length == seg.length:
                seg.tiers.add(t)
    return seg


def _rebuild(
    key: str,
    per_tier: list[dict[int, SegmentHeader]],
    blobs: dict[tuple[str, int], Seg],
    recovered: list[list[SegmentHeader]],
) -> tuple[Session, str | None]:
    """The session's history: its inherited segments (a fork's), then the longest gap-free
    run of its own that some tier holds, one schema; and why it stops short, if a reason
    other than a missing or damaged turn of its own."""
    s = Session(key, len(per_tier))
    lowest = min((h for segs in per_tier for h in segs.values()), key=lambda h: h.seq)
    first = lowest.seq if lowest.base else 0
    prefix: list[int] = []
    for segs in per_tier:
        n = first
        while n in segs:
            n += 1
        prefix.append(n)
    n = max(prefix)
    best = prefix.index(n)
    headers = [per_tier[best][i] for i in range(first, n)]
    if not headers:  # its first turn is missing
        return s, None
    inherited: list[tuple[Seg, int]] = []
    if first:
        base = headers[0].base
        for owner, seq, take in base:
            seg = _blob(blobs, recovered, (owner, seq))
            if seg is None or not seg.tiers or not 0 < take <= seg.header.tokens:
                return s, f"it was forked from {owner!r}, whose turn {seq} is missing"
            inherited.append((seg, take))
        if not inherits(headers[0], [g.header for g, _ in inherited]):
            return (
                s,
                f"it was forked from {base[0][0]!r}, whose turns stored here are another history's",
            )
    schema = header_schema(inherited[0][0].header if inherited else headers[0])
    good = 0
    for h in [g.header for g, _ in inherited] + headers:
        if header_schema(h) != schema:
            break
        good += 1
    if good < len(inherited):
        return s, "the history it was forked from has another schema"
    for seg, take in inherited:
        s.add(seg, take)
    if inherited:
        s.base = len(inherited)
        parent = headers[0].parent or inherited[-1][0].key[0]
        s.parent = (parent, sum(take for _, take in inherited))
    for h in headers[: good - len(inherited)]:
        seg = _blob(blobs, recovered, (key, h.seq))
        assert seg is not None
        if seg.length != h.length:
            break
        s.add(seg)
    s.schema = schema
    return s, None
