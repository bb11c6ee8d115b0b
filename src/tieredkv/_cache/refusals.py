"""Turns a shared tier refused: counted, logged, announced, and reported to the caller once.

In the local-first write-through (see :mod:`tieredkv._cache.writethrough`), an appended
turn is acknowledged once it is in this replica's own tiers and committed to the shared
tier in the background. If the shared tier refuses it for good (another replica took the
conversation over, or its history there changed, first), the turn can never join the
conversation's history: it is counted (``stats().refused``), logged, announced as a
:class:`~tieredkv.meta.Refused` event, and reported by a
:class:`~tieredkv.errors.TurnRefusedError` from the next call on that conversation or from
:meth:`~tieredkv.TieredKVCache.flush`, whichever comes first. The next call on the
conversation also drops this replica's copies of it (they hold the refused turns), so it
is loaded afresh from the shared tier.
"""

from __future__ import annotations

import logging

from ..errors import TurnRefusedError
from ..meta import Refused
from .state import Core, Refusal, Session

__all__ = ["Owed", "pending", "record_refusal", "report"]

_log = logging.getLogger("tieredkv.cache")


def pending(s: Session, t: int) -> list[int]:
    """The turns of ``s`` that shared tier ``t`` has not committed, in order."""
    return [seg.header.seq for seg in s.segs if t not in seg.tiers]


def record_refusal(
    core: Core, s: Session, t: int, reason: str, turns: list[int] | None = None
) -> None:
    """Shared tier ``t`` refused ``s``'s uncommitted turns (``turns``, by default every one
    it has not committed) for good (``reason``, from the tier's error): count, log and
    announce the ones not refused before, and keep them for :func:`report`."""
    turns = pending(s, t) if turns is None else turns
    if not turns:
        return
    tier = core.tiers[t].name
    old = core.refused.get(s.key)
    new = [seq for seq in turns if old is None or seq not in old.turns]
    if new:
        core.refusals += 1
    if old is None:
        core.refused[s.key] = Refusal(tier, turns, reason, core.refusals)
    else:
        old.turns = sorted({*old.turns, *turns})
        old.reported = old.reported and not new
        old.seq = core.refusals
    if not new:
        return
    core.stats.refused += len(new)
    lengths = {seg.header.seq: seg.length for seg in s.segs}
    _log.warning(
        "tier %r refused turn(s) %s of %.80r, acknowledged here: %s", tier, new, s.key, reason
    )
    core.residency.announced(
        Refused(
            session=s.key,
            time=core.clock(),
            nbytes=sum(lengths[seq] for seq in new),
            tier=tier,
            turns=tuple(new),
            reason=reason,
        )
    )


class Owed:
    """What one caller waiting for the shared tier (a ``flush()``) is owed: the refusals not
    reported when it began, and every one recorded while it waits, even if a concurrent
    caller reports them first (each caller whose turns a refusal concerns hears of it)."""

    __slots__ = ("since", "unreported")

    def __init__(self, core: Core) -> None:
        self.since = core.refusals
        self.unreported = {key for key, r in core.refused.items() if not r.reported}

    def __contains__(self, item: tuple[str, Refusal]) -> bool:
        key, r = item
        return key in self.unreported or r.seq > self.since


def report(core: Core, sessions: list[str], owed: Owed | None = None) -> None:
    """Raise the refusals of ``sessions`` not reported yet (and those ``owed``), as one
    :class:`~tieredkv.errors.TurnRefusedError` (and mark them reported)."""
    found = [(key, core.refused[key]) for key in sessions if key in core.refused]
    fresh = [(k, r) for k, r in found if not r.reported or (owed is not None and (k, r) in owed)]
    if not fresh:
        return
    for _, r in fresh:
        r.reported = True
    raise TurnRefusedError(
        fresh[0][1].tier, [(key, list(r.turns)) for key, r in fresh], fresh[0][1].reason
    )
