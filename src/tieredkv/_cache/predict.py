"""Predictive prefetch: while the cache is idle, bring up the sessions whose users the
eviction policy expects back soon (beyond the Bidaw paper, which loads a history only once
its request has arrived).

Bidaw's eviction already models when each conversation comes back: the reuse distances
observed after answers of each length, and the distance elapsed since each session's latest
access (:class:`~tieredkv.policies.BidawEviction`). The same model, asked about a session
on a lower tier (:meth:`~tieredkv.policies.base.Foresight.foresee`), gives the chance its
next access would be a hit if its KV were in tier 0 now. A promotion is worth making when
that chance beats the summed chances of the residents it would displace: the expected host
hits gained against those lost, in the policy's own terms. The decision is pure
(:func:`tieredkv.policies.prefetch.pick`, which the simulator runs too); the promotion is
the cache's ordinary, atomic one.
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections.abc import Set as AbstractSet

from ..errors import CorruptSegmentError, TierIOError
from ..policies.base import Eviction, Foresight
from ..policies.prefetch import pick
from .atomic import settle
from .placement import promote
from .sharing import examine
from .state import Core, Session

__all__ = ["Candidate", "choose", "prefetch", "prefetch_predicted"]

_log = logging.getLogger("tieredkv.cache")

Candidate = tuple[Session, float, list[str]]
"""A session to promote, its chance of a hit, and the residents it would displace."""


def choose(core: Core, scan: int, passed: AbstractSet[str] = frozenset()) -> Candidate | None:
    """The lower-tier session most worth bringing into tier 0 now, or ``None``.

    Looks at the ``scan`` most recently accessed sessions (a user who just left is likelier
    due than one gone for hours, and the scan stays bounded with many sessions), residents
    included (their ages decide ties); ranks the lower-tier ones by chance of a hit, and
    those of (about) equal chance by how long their user has been gone (the one due first);
    takes the first whose chance exceeds what the victims the policy would choose for it
    are worth. Sessions in ``passed`` are passed over.
    """
    policy = core.policies[0]
    if not isinstance(policy, Foresight) or not isinstance(policy, Eviction):
        return None
    tier = core.tiers[0]
    skip = core.busy.keys() | core.protected() | passed
    # residents too: a victim's age decides a tie with the candidate that would displace it
    recent = heapq.nlargest(  # O(n log scan)
        scan,
        (s for s in core.sessions.values() if s.primary is not None and not s.dropped),
        key=lambda s: core.channel[s.key].last_access,
    )

    def eligible(s: Session, n: int) -> bool:
        assert s.primary is not None
        return s.primary > 0 and s.key not in skip and 0 < n <= tier.capacity

    chosen = pick(
        policy,
        policy.foresee,
        [(s.key, n, eligible(s, n)) for s in recent for n in [s.nbytes()]],
        tier.capacity - tier.used,
        core.clock(),
        core.channel,
        skip,
        scan,
    )
    if chosen is None:
        return None
    key, chance, victims = chosen
    return core.sessions[key], chance, victims


async def prefetch(core: Core, s: Session) -> bool | None:
    """Promote ``s`` (locked, stored) to tier 0 if it fits, atomically whatever cancels it;
    whether it moved (``None``: it was found damaged, and is gone)."""
    if s.primary == 0:
        return False
    try:
        moved, cancel = await settle(functools.partial(promote, core, s))
    except CorruptSegmentError:
        return None
    if moved:  # (kept, even if the caller was cancelled meanwhile)
        core.stats.prefetches += 1
    if cancel is not None:
        raise cancel
    return moved


async def prefetch_predicted(core: Core, limit: int, scan: int) -> list[str]:
    """Promote up to ``limit`` sessions the tier-0 policy expects back soon, while no other
    operation is under way (see :meth:`~tieredkv.TieredKVCache.prefetch_predicted`); the
    sessions promoted, in order. A read that fails ends it (logged)."""
    promoted: list[str] = []
    passed: set[str] = set()
    while len(promoted) < limit and not core.busy and not core.closing:
        chosen = choose(core, scan, passed)
        if chosen is None:
            break
        s, _, _ = chosen
        if core.sharing:  # what another replica committed since is taken in first
            passed.add(s.key)
            if s.key in core.refused:
                continue  # (its next operation reports the refusal)
            if await examine(core, s.key, take=False) is not None:
                continue  # its current history cannot be proven: its own load will say
        async with core.hold(s):
            if s.primary is None or s.primary == 0:
                continue
            try:
                moved = await prefetch(core, s)
            except TierIOError as exc:  # (counted in stats().errors)
                _log.warning(
                    "predictive prefetch: could not bring %.80r up, it stays where it is: %s",
                    s.key,
                    exc,
                )
                break
            if moved is None:
                continue
        if not moved:
            break  # room could not be made after all: try again when called next
        core.stats.predicted += 1
        promoted.append(s.key)
    return promoted
