"""Predictive prefetch's decision: which lower-tier session to bring up, if any.

Pure, like every policy here: the live cache (:meth:`tieredkv.TieredKVCache.prefetch_predicted`)
and the simulator (``SystemSpec.predictive_prefetch``) both call :func:`pick`. The eviction
policy's own model (:class:`~tieredkv.policies.base.Foresight`) says how likely each
session is to hit if its KV were up now; a promotion is worth making when that chance beats
the summed chances of the residents the policy would displace for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence, Set
from typing import Protocol, runtime_checkable

from ..meta import MetadataView
from .base import Eviction

__all__ = ["TimedForesight", "pick", "worth_it"]


@runtime_checkable
class TimedForesight(Protocol):
    """A :class:`~tieredkv.policies.base.Foresight` whose answer depends on the time (a
    caller's hint of when a turn comes): :func:`pick` asks it with ``now``."""

    def foresee_at(self, session: str, now: float) -> float | None:
        """As :meth:`~tieredkv.policies.base.Foresight.foresee`, at ``now``."""
        ...


def pick(
    policy: Eviction,
    foresee: Callable[[str], float | None],
    recent: Sequence[tuple[str, int, bool]],
    free: int,
    now: float,
    view: MetadataView,
    protected: Set[str],
    unknown_age: int,
) -> tuple[str, float, list[str]] | None:
    """The session to bring up, its chance of a hit and the residents it displaces; or
    ``None``.

    :param policy: the tier's eviction policy (asked for the victims)
    :param foresee: its :meth:`~tieredkv.policies.base.Foresight.foresee`
    :param recent: ``(session, bytes, may be brought up)``, the most recently active first
        (a session's index is its *age*: how many were active since)
    :param free: free bytes in the tier now
    :param protected: sessions that must not be displaced
    :param unknown_age: the age of a victim not in ``recent``

    Candidates are ranked by chance, and of (about) equal chances the one gone longest (the
    one due first) comes first; the first that is :func:`worth_it` is taken. A policy that
    is a :class:`TimedForesight` is asked at ``now`` instead of through ``foresee``.
    """
    if isinstance(policy, TimedForesight):
        foresee = functools.partial(policy.foresee_at, now=now)
    ages = {name: age for age, (name, _, _) in enumerate(recent)}
    scored: list[tuple[int, float, str, int]] = []
    for age, (name, size, eligible) in enumerate(recent):
        if eligible:
            chance = foresee(name)
            if chance:
                scored.append((age, chance, name, size))
    scored.sort(key=lambda c: (round(c[1], 2), c[0]), reverse=True)
    for age, chance, name, size in scored:
        need = size - free
        if need <= 0:
            return name, chance, []
        victims = policy.victims(need, now, view, protected | {name})
        if victims is None:
            continue
        lost = [foresee(v) or 0.0 for v in victims]
        if worth_it(chance, age, lost, [ages.get(v, unknown_age) for v in victims]):
            return name, chance, victims
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
