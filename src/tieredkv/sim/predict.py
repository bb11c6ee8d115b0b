"""Predictive prefetch in the simulator (beyond the paper): while the SSD idles and nobody
waits, read up the SSD-resident session the eviction policy's own model of reuse gives the
best chance of a hit (:func:`tieredkv.policies.prefetch.pick`, as
:meth:`tieredkv.TieredKVCache.prefetch_predicted` does), one read at a time, among the
most recently active users."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence, Set

from ..policies.base import Eviction
from ..policies.prefetch import pick
from ..policies.scheduling import Scheduler
from .host import DecisionView, HostMemory, Session
from .ssd import SSDQueue

__all__ = ["SCAN", "Predictor"]

SCAN = 256
"""Most recently active users a predictive prefetch considers."""


class Predictor:
    """Chooses and counts the predictive reads of one simulation.

    :param policy: the host tier's eviction policy
    :param foresee: its :meth:`~tieredkv.policies.base.Foresight.foresee`
    :param scheduler: the engine's scheduler (a queued request comes first)
    :param host: host memory (its room, the read's landing)
    :param ssd: the SSD (its idle time)
    :param sessions: the sessions, by user index
    :param users: user index by session name
    :param pinned: sessions handed out to the GPU (never read up: they are there)
    :param view: what ``victims`` sees
    :param protected: sessions that must not be displaced
    :param read: starts the read of a user's KV at a time (it lands as a prefetch event)
    """

    __slots__ = (
        "_foresee",
        "_host",
        "_pinned",
        "_policy",
        "_protected",
        "_read",
        "_recent",
        "_scheduler",
        "_sessions",
        "_ssd",
        "_users",
        "_view",
        "busy",
        "predicted",
    )

    def __init__(
        self,
        policy: Eviction,
        foresee: Callable[[str], float | None],
        scheduler: Scheduler,
        host: HostMemory,
        ssd: SSDQueue[Session],
        sessions: Sequence[Session],
        users: Mapping[str, int],
        pinned: Mapping[str, int],
        view: DecisionView,
        protected: Set[str],
        read: Callable[[int, float], None],
    ) -> None:
        self._policy = policy
        self._foresee = foresee
        self._scheduler = scheduler
        self._host = host
        self._ssd = ssd
        self._sessions = sessions
        self._users = users
        self._pinned = pinned
        self._view = view
        self._protected = protected
        self._read = read
        self._recent: OrderedDict[int, None] = OrderedDict()  # users, least recent first
        self.busy = False
        """A predictive read is in flight."""
        self.predicted = 0
        """Sessions brought into host memory so far."""

    def arrived(self, user: int) -> None:
        """``user`` is active (a turn arrived)."""
        self._recent[user] = None
        self._recent.move_to_end(user)

    def consider(self, now: float, loads: int) -> None:
        """Start a predictive read if the SSD idles (``loads``: SSD loads in flight),
        nobody waits, and a session's chance of a hit beats what the residents it would
        displace are worth (of equal chances, the one whose user has been gone longest:
        the one due first)."""
        if self.busy or loads or self._ssd.free_at > now:
            return
        if self._scheduler.waiting(1):
            return  # requests are queued: an arriving one's load must not wait behind a guess
        if self._ssd.writing(now):
            return  # the idle SSD is writing back first
        policy = self._policy
        sessions = self._sessions
        recent = [
            (
                s.name,
                s.nbytes,
                s.nbytes > 0 and not s.in_host and s.on_ssd and s.name not in self._pinned,
            )
            for user in itertools.islice(reversed(self._recent), SCAN)
            for s in [sessions[user]]
        ]
        chosen = pick(
            policy,
            self._foresee,
            recent,
            self._host.free,
            now,
            self._view,
            self._protected,
            SCAN,
        )
        if chosen is not None:
            self.busy = True
            self._read(self._users[chosen[0]], now)

    def landed(self, user: int, now: float) -> None:
        """The read of ``user``'s KV ended: admitted if there is room (still on SSD, not
        brought up by a load meanwhile)."""
        self.busy = False
        s = self._sessions[user]
        host = self._host
        if s.on_ssd and not s.in_host and host.reserve(s.nbytes, now):
            host.loaded(s, now)
            self.predicted += 1
