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

__all__ = ["Candidate", "choose", "worth_it"]

Candidate = tuple[Session, float, list[str]]
"""A session to promote, its chance of a hit, and the residents it would displace."""


def choose(core: Core, scan: int) -> Candidate | None:
    """The lower-tier session most worth bringing into tier 0 now, or ``None``.

    Looks at up to ``scan`` lower-tier sessions, the most recently accessed (a user who
    just left is likelier due than one gone for hours, and the scan stays bounded with many
    sessions); ranks them by chance of a hit, and sessions of (about) equal chance by how
    long their user has been gone (the one due first); takes the first whose chance exceeds
    what the victims the policy would choose for it are worth.
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
    scored: list[tuple[float, int, float, Session]] = []
    for age, s in enumerate(lower):
        size = s.nbytes()
        if not 0 < size <= tier.capacity:
            continue
        chance = policy.foresee(s.key)
        if chance:
            scored.append((round(chance, 2), age, chance, s))
    # likeliest first; of (about) equal chances, the user gone longest: the one due first
    scored.sort(key=lambda c: (c[0], c[1]), reverse=True)
    now = core.clock()
    ages = {s.key: age for age, s in enumerate(lower)}
    for _, age, chance, s in scored:
        need = s.nbytes() - (tier.capacity - tier.used)
        if need <= 0:
            return s, chance, []
        victims = policy.victims(need, now, core.channel, skip | {s.key})
        if victims is None:
            continue
        lost = [policy.foresee(v) or 0.0 for v in victims]
        if worth_it(chance, age, lost, [ages.get(v, scan) for v in victims]):
            return s, chance, victims
    return None


def worth_it(chance: float, age: int, lost: list[float], ages: list[int]) -> bool:
    """Whether bringing up a session (its chance of a hit, and how many users were active
    since it was: its age) is worth displacing the residents with chances ``lost`` and
    ages ``ages``: it must gain more expected hits than it loses; or, against one resident
    of (about) the same chance, it must be the one gone longer, so that the one due first
    is kept (a model whose chances saturate, as Bidaw's do when every due user would hit,
    cannot tell them apart otherwise)."""
    total = sum(lost)
    if chance > total + 0.005:
        return True
    return len(lost) == 1 and abs(chance - total) <= 0.005 and age > ages[0]
