"""Forks with a tier shared between replicas (see :mod:`tieredkv._cache.sharing`).

A shared tier that takes forks (its ``forks`` property is true: Redis on one server)
commits a fork's first turn with references to the segments it inherits, in the same
atomic step, under the fork's own writer lease; the store keeps a referenced segment while
any committed fork lists it, and refuses a fork whose inherited range is gone
(:mod:`tieredkv.backends.redis`). A shared tier without the property takes no forks.

This module lets the cache make forks over such tiers, and take a fork another replica
committed into its index: the history a shared tier gives for a fork starts with the
inherited segments' headers (under their owners' keys), and the first header of the fork's
own lists them with the tokens it takes of each. An inherited segment this replica already
lists (its owner's, or another fork's) is the same :class:`~tieredkv._cache.state.Seg`: a
segment is stored once per tier.
"""

from __future__ import annotations

from ..backends.shared import plain_header
from ..errors import InvalidArgumentError
from ..payload import SegmentHeader, inherits
from .state import Core, Retired, Seg, Session

__all__ = ["check_forks", "keep_for_forks", "list_shared"]


def check_forks(core: Core) -> None:
    """Refuse a fork when a shared tier takes none.

    :raises InvalidArgumentError: which tier, and what to do instead
    """
    for io in core.io:
        tier = io.shared
        if tier is not None and not getattr(tier, "forks", False):
            raise InvalidArgumentError(
                f"forks are not supported with tier {tier.name!r}, shared between replicas "
                f"(a Redis Cluster, or a shared tier that takes no forks); append the fork's "
                f"whole history instead"
            )


def list_shared(core: Core, s: Session, t: int, headers: list[SegmentHeader]) -> int:
    """Make ``s`` (cleared) list the history shared tier ``t`` holds (``headers``): a
    plain conversation's own turns, or a fork's inherited segments then its own. Returns
    how many segments it lists (0 when a fork's inherited segment conflicts with one this
    replica lists under the same key: not served, a miss)."""
    base = next((i for i, h in enumerate(headers) if h.session == s.key), len(headers))
    if base and (base == len(headers) or not inherits(headers[base], headers[:base])):
        return 0  # (a shared tier gives a fork's history whole, or not at all)
    takes = [take for _, _, take in headers[base].base] if base else []
    segs: list[Seg] = []
    for h in headers:  # (its own turns too: forks made here may list them)
        seg = _listed(core, h)
        if seg is not None and plain_header(seg.header) != plain_header(h):
            _retire_unlisted(core, [seg])  # (forks here list another one: key taken)
            _displaced(core, seg, t)
            return 0
        segs.append(Seg(h) if seg is None else seg)
    sharers = {u for seg in segs if len(seg.users) == 1 for u in seg.users}
    for i, seg in enumerate(segs):
        seg.tiers.add(t)
        s.add(seg, takes[i] if i < base else None)
    if base:
        s.base = base
        s.parent = (headers[base - 1].session, sum(takes))
        _retire_unlisted(core, segs[:base])
    r = core.retired.get(s.key)
    if r is not None:  # what it lists again is this history's, no longer only its forks'
        r.segs = [seg for seg in r.segs if seg not in segs]  # (the rest: forest.relisted)
    for u in sharers:
        core.reshared(u)
    return len(headers)


def _displaced(core: Core, seg: Seg, t: int) -> None:
    """Shared tier ``t``'s index holds another segment under ``seg``'s key now (its owner's
    new history). Unless a fork here has committed a history there that references
    ``seg`` (the server keeps it for that fork: its view is only stale, and its next
    load reads it again), ``seg`` is not in ``t`` for this replica any more: a fork of the
    old history whose first turn is not committed yet cannot be (see the write-through),
    and must not reference the new one. Such a fork never had a complete copy in ``t``."""
    if not any(u.references(seg, t) for u in seg.users):
        seg.tiers.discard(t)


def keep_for_forks(core: Core, s: Session) -> None:
    """``s``'s history is leaving this replica's index because the shared tier does not
    hold it (lost, damaged, or another history): its own segments that forks here still
    list stay theirs, and its key stays taken for them (as for a retired conversation)."""
    _retire_unlisted(core, [seg for seg in s.own() if seg.users - {s}], but=s)


def _retire_unlisted(core: Core, inherited: list[Seg], but: Session | None = None) -> None:
    """Record as retired the owners of ``inherited`` segments that this replica does not
    index (another replica's conversation, or one dropped while forks list it): their keys
    stay taken here while the fork lists their segments (a new conversation under one is
    refused, as the shared tier refuses it), until this replica takes the owner's history
    in (a load) or the fork lets go of them."""
    for seg in inherited:
        owner = core.sessions.get(seg.key[0])
        if owner is not None and owner is not but and seg in owner.segs:
            continue
        r = core.retired.get(seg.key[0])
        if r is None:
            core.retired[seg.key[0]] = Retired([seg])
        elif seg not in r.segs:
            r.segs.append(seg)


def _listed(core: Core, h: SegmentHeader) -> Seg | None:
    """The segment this replica lists under ``h``'s key (its owner's, a retired owner's,
    or a fork's), if any: the same as ``h`` or another one (a history not taken then: a
    miss, never a segment of another history)."""
    key = (h.session, h.seq)
    owner = core.sessions.get(h.session)
    retired = core.retired.get(h.session)
    candidates = [
        *(owner.segs if owner is not None else ()),
        *(retired.segs if retired is not None else ()),
        *(seg for u in core.sessions.values() if u.base for seg in u.segs[: u.base]),
    ]
    return next((g for g in candidates if g.key == key), None)
