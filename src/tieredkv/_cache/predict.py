"""Predictive prefetch: while the cache is idle, bring up the sessions whose users the
eviction policy expects back soon (beyond the Bidaw paper, which loads a history only once
its request has arrived).

Bidaw's eviction already models when each conversation comes back: the reuse distances
observed after answers of each length, and the distance elapsed since each session's latest
access (:class:`~tieredkv.policies.BidawEviction`). The same model, asked about a session
on a lower tier (:meth:`~tieredkv.policies.base.Foresight.foresee`), gives the chance its
next access would be a hit if its KV were in tier 0 now. A promotion is worth making when
that chance beats the summed chances of the residents it would displace: the expected host
hits gained against those lost, in the policy's own terms. The decision is pure; the
promotion is the cache's ordinary, atomic one.
"""

from __future__ import annotations

import heapq

from ..policies.base import Foresight
from .state import Core, Session

__all__ = ["Candidate", "choose"]

Candidate = tuple[Session, float, list[str]]
"""A session to promote, its chance of a hit, and the residents it would displace."""


def choose(core: Core, scan: int) -> Candidate | None:
    """The lower-tier session most worth bringing into tier 0 now, or ``None``.

    Looks at up to ``scan`` lower-tier sessions, the most recently accessed first (a user
    who just left is likelier due than one gone for hours, and the scan stays bounded with
    many sessions), best chance per byte first; takes the first whose chance exceeds what
    the victims the policy would choose for it are worth.
    """
    policy = core.policies[0]
    if not isinstance(policy, Foresight):
        return None
    tier = core.tiers[0]
    skip = core.busy.keys() | core.protected()
    lower = heapq.nlargest(  # O(n log scan)
        scan,
        (
            s
            for s in core.sessions.values()
            if s.primary is not None and s.primary > 0 and not s.dropped and s.key not in skip
        ),
        key=lambda s: core.channel[s.key].last_access,
    )
    scored: list[tuple[float, float, Session]] = []
    for s in lower:
        size = s.nbytes()
        if not 0 < size <= tier.capacity:
            continue
        chance = policy.foresee(s.key)
        if chance:
            scored.append((chance / size, chance, s))
    scored.sort(key=lambda c: c[0], reverse=True)
    now = core.clock()
    for _, chance, s in scored:
        need = s.nbytes() - (tier.capacity - tier.used)
        if need <= 0:
            return s, chance, []
        victims = policy.victims(need, now, core.channel, skip | {s.key})
        if victims is None:
            continue
        lost = sum(policy.foresee(v) or 0.0 for v in victims)
        if chance > lost:
            return s, chance, victims
    return None
