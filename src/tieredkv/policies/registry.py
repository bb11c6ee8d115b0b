"""Build any policy by name.

>>> from tieredkv.policies.registry import make_eviction, make_scheduler
>>> make_eviction("queue-enhanced", window=10).window
10
>>> make_scheduler("fcfs").name
'fcfs'

Names are case-insensitive and ``_`` equals ``-``. Third-party policies join with
:func:`register_eviction` and :func:`register_scheduler`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..errors import UnknownPolicyError
from .adaptive_bidaw import AdaptiveBidaw
from .base import Eviction
from .belady import Belady
from .bidaw_eviction import BidawEviction
from .bidaw_scheduler import BidawScheduler
from .fcfs import FCFS
from .fifo import FIFO
from .lfu import LFU
from .lookahead import LookAheadFCFS
from .lru import LRU
from .queue_enhanced import QueueEnhanced
from .scheduling import Scheduler

__all__ = [
    "eviction_names",
    "make_eviction",
    "make_scheduler",
    "register_eviction",
    "register_scheduler",
    "scheduler_names",
    "scheduler_parameters",
]

_EVICTIONS: dict[str, Callable[..., Eviction]] = {
    "fifo": FIFO,
    "lru": LRU,
    "lfu": LFU,
    "queue-enhanced": QueueEnhanced,
    "belady": Belady,
    "bidaw": AdaptiveBidaw,
    "bidaw-paper": BidawEviction,
}


def fcfs(max_loads: int = 1, *, prefetch: bool = True, window: int | None = None) -> FCFS:
    """The ``"fcfs"`` scheduler: :class:`FCFS`, or with a look-ahead ``window``
    :class:`LookAheadFCFS` (which decides as ``FCFS(window=...)`` does)."""
    if window is None:
        return FCFS(max_loads, prefetch=prefetch)
    if not prefetch:
        raise ValueError("a look-ahead window bounds prefetching: it needs prefetch=True")
    return LookAheadFCFS(max_loads, window=window)


_SCHEDULERS: dict[str, Callable[..., Scheduler]] = {
    "fcfs": fcfs,
    "bidaw": BidawScheduler,
    "fcfs-lookahead": LookAheadFCFS,
}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def make_eviction(name: str, **kwargs: Any) -> Eviction:
    """A new eviction policy.

    :param name: one of :func:`eviction_names`
    :param kwargs: passed to the policy's constructor
    :raises UnknownPolicyError: for a name not registered (the message lists the known ones)
    """
    try:
        factory = _EVICTIONS[_key(name)]
    except KeyError:
        raise UnknownPolicyError("eviction", name, list(_EVICTIONS)) from None
    return factory(**kwargs)


def make_scheduler(name: str, **kwargs: Any) -> Scheduler:
    """A new scheduler.

    :param name: one of :func:`scheduler_names`
    :param kwargs: passed to the scheduler's constructor
    :raises UnknownPolicyError: for a name not registered (the message lists the known ones)
    """
    try:
        factory = _SCHEDULERS[_key(name)]
    except KeyError:
        raise UnknownPolicyError("scheduler", name, list(_SCHEDULERS)) from None
    return factory(**kwargs)


def scheduler_parameters(name: str) -> frozenset[str]:
    """The keyword arguments the scheduler ``name``'s factory takes (an engine passes the
    settings a scheduler knows what to do with: ``window``, ``prefetch``, ``bandwidth``,
    ``latency``, ...; every registered factory takes ``max_loads``).

    :raises UnknownPolicyError: for a name not registered (the message lists the known ones)
    """
    try:
        factory = _SCHEDULERS[_key(name)]
    except KeyError:
        raise UnknownPolicyError("scheduler", name, list(_SCHEDULERS)) from None
    return frozenset(inspect.signature(factory).parameters)


def eviction_names() -> list[str]:
    """Registered eviction policy names, in registration order."""
    return list(_EVICTIONS)


def scheduler_names() -> list[str]:
    """Registered scheduler names, in registration order."""
    return list(_SCHEDULERS)


def register_eviction(name: str, factory: Callable[..., Eviction]) -> None:
    """Register (or replace) an eviction policy factory under ``name``."""
    _EVICTIONS[_key(name)] = factory


def register_scheduler(name: str, factory: Callable[..., Scheduler]) -> None:
    """Register (or replace) a scheduler factory under ``name``."""
    _SCHEDULERS[_key(name)] = factory
