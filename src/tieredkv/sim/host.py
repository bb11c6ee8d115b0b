"""The simulated host memory: which sessions' KV is resident, room made by the eviction
policy, and the metadata channel the policies and the scheduler read.

Every residency change goes through :class:`~tieredkv.residency.Residency` (publish, then
notify the policy, in the live cache's order); victims without a complete SSD copy are
written there first (:class:`~tieredkv.sim.writepath.WritePath`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Set
from typing import Literal, TypeVar

from ..meta import KVMeta, MetadataChannel, TierInfo, advance_meta
from ..policies.base import Eviction
from ..policies.scheduling import Scheduler
from ..residency import Residency
from .ssd import SSDQueue
from .writepath import WritePath

__all__ = ["HOST", "SSD", "UNBOUNDED", "DecisionView", "HostMemory", "Protected", "Session"]

_S = TypeVar("_S")
HOST = "host"
SSD = "ssd"
UNBOUNDED = 1 << 62


class Session:
    """One conversation's KV, as the simulator tracks it."""

    __slots__ = (
        "dirty",
        "gen",
        "in_host",
        "name",
        "nbytes",
        "on_ssd",
        "staged",
        "tokens",
        "turns",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.in_host = False
        self.staged = False  # read from SSD without room in host: goes straight to the GPU
        self.on_ssd = False  # a complete copy is on SSD
        self.dirty = 0  # bytes a move to SSD must write (all of them if no copy is there)
        self.gen = 0  # advances whenever the SSD copy becomes complete
        self.nbytes = 0
        self.tokens = 0
        self.turns = 0


class Protected(Set[str]):
    """The scheduler's ready sessions plus the engine's running ones, without copying."""

    __slots__ = ("_a", "_b")

    def __init__(self, a: Set[str], b: Set[str]) -> None:
        self._a = a
        self._b = b

    def __contains__(self, item: object) -> bool:
        return item in self._a or item in self._b

    def __iter__(self) -> Iterator[str]:
        yield from self._a
        for s in self._b:
            if s not in self._a:
                yield s

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _from_iterable(cls, it: Iterable[_S]) -> frozenset[_S]:
        # set operators (``protected | more``) build a plain frozenset
        return frozenset(it)


class DecisionView:
    """The channel as one ``victims`` call sees it, with the scheduler's queue published
    on first read: computing it costs O(queue), and only queue-aware policies read it."""

    __slots__ = ("_channel", "_scheduler", "_window")

    def __init__(self, channel: MetadataChannel, scheduler: Scheduler, window: int) -> None:
        self._channel = channel
        self._scheduler = scheduler
        self._window = window

    def get(self, session: str) -> KVMeta | None:
        return self._channel.get(session)

    @property
    def tiers(self) -> tuple[TierInfo, ...]:
        return self._channel.tiers

    @property
    def waiting(self) -> tuple[str, ...]:
        self._channel.publish_waiting(self._scheduler.waiting(self._window))
        return self._channel.waiting

    @property
    def pins(self) -> Mapping[str, float]:
        return self._channel.pins


class HostMemory:
    """Host memory of ``capacity`` bytes over an SSD (``ssd``; ``None``: host memory only,
    nothing ever leaves it), sessions' residency, and the channel.

    :param capacity: bytes (:data:`UNBOUNDED` for the ideal system)
    :param eviction: the host tier's policy
    :param channel: the metadata channel (its tiers set by the caller)
    :param codec: what the sessions store (``"kv"`` or ``"act"``), published
    :param bytes_per_token: stored bytes per history token
    :param write_path: when KV reaches the SSD
    :param ssd: the SSD, or ``None``
    :param view: what ``victims`` sees
    :param protected: sessions ``victims`` must not choose
    """

    __slots__ = (
        "_bpt",
        "_codec",
        "_eviction",
        "_protected",
        "_view",
        "_write",
        "capacity",
        "channel",
        "evictions",
        "residency",
        "sessions",
        "ssd",
        "used",
    )

    def __init__(
        self,
        capacity: int,
        eviction: Eviction,
        channel: MetadataChannel,
        *,
        codec: Literal["kv", "act"],
        bytes_per_token: int,
        write_path: WritePath,
        ssd: SSDQueue[Session] | None,
        view: DecisionView,
        protected: Set[str],
    ) -> None:
        self.capacity = capacity
        self._eviction = eviction
        self.channel = channel
        self.residency = Residency(channel, [eviction])
        self._codec: Literal["kv", "act"] = codec
        self._bpt = bytes_per_token
        self._write = write_path
        self.ssd = ssd
        self._view = view
        self._protected = protected
        self.sessions: dict[str, Session] = {}
        self.used = 0
        self.evictions = 0

    @property
    def free(self) -> int:
        """Bytes not taken."""
        return self.capacity - self.used

    def meta(
        self,
        s: Session,
        now: float,
        *,
        access: bool = False,
        answer: int | None = None,
        next_access: float | None = None,
        turn_tokens: int | None = None,
    ) -> KVMeta:
        """``s``'s metadata as it stands now (not published); ``turn_tokens`` with an
        ``answer``: the tokens that turn added."""
        if s.in_host:
            tier: str | None = HOST
            copies: tuple[str, ...] = (HOST, SSD) if s.on_ssd else (HOST,)
        elif s.on_ssd:
            tier, copies = SSD, (SSD,)
        else:
            tier, copies = None, ()
        return advance_meta(
            self.channel.get(s.name),
            session=s.name,
            tier=tier,
            copies=copies,
            nbytes=s.nbytes,
            tokens=s.tokens,
            turns=s.turns,
            now=now,
            access=access,
            answer=answer,
            turn_tokens=turn_tokens,
            codec=self._codec,
            next_access=next_access if answer is not None else ...,
        )

    def read(self, s: Session, now: float) -> None:
        """A prefill reads ``s``'s history from host memory: an access."""
        self.residency.accessed(self.meta(s, now, access=True), now)

    def append(
        self,
        s: Session,
        tokens: int,
        new_tokens: int,
        answer: int,
        next_access: float | None,
        now: float,
    ) -> None:
        """A turn of ``s`` ended: its history is ``tokens`` (``new_tokens`` of them new), the
        answer ``answer`` tokens; the user comes back at ``next_access`` (``None``: never)."""
        nbytes = tokens * self._bpt
        old = s.nbytes if s.in_host else 0
        ssd = self.ssd
        if ssd is None:
            self.used += nbytes - old
            s.in_host = True
        else:
            segment = min(new_tokens * self._bpt, nbytes)
            self._write.appended(s, segment, nbytes, ssd, now)
            if self.reserve(nbytes - old, now):
                s.in_host = True
            else:
                if s.in_host:
                    s.in_host = False
                    self.used -= old
                    self.residency.removed(s.name, 0)
                self._write.flush(s, ssd, now)
        s.nbytes = nbytes
        s.tokens = tokens
        s.turns += 1
        meta = self.meta(
            s, now, access=True, answer=answer, next_access=next_access, turn_tokens=new_tokens
        )
        self.residency.accessed(meta, now, admit=0 if s.in_host else None)

    def reserve(self, need: int, now: float) -> bool:
        """Make ``need`` bytes available (evicting) and take them; ``False`` if the policy
        cannot free enough (nothing taken)."""
        free = self.capacity - self.used
        if need <= free:
            self.used += need
            return True
        ssd = self.ssd
        if ssd is not None:
            ssd.catch_up(now)  # segments written while the SSD idled need no write now
        victims = self._eviction.victims(need - free, now, self._view, self._protected)
        if victims is None:
            return False
        sessions = self.sessions
        for name in victims:
            v = sessions[name]
            if not v.in_host:
                continue
            v.in_host = False
            self.used -= v.nbytes
            if ssd is not None:
                self._write.flush(v, ssd, now)
            self.residency.removed(name, 0, self.meta(v, now))
            self.evictions += 1
        if need > self.capacity - self.used:
            return False
        self.used += need
        return True

    def loaded(self, s: Session, now: float) -> None:
        """``s`` was read from SSD into host memory (room already taken): resident."""
        s.in_host = True
        self._write.loaded(s)
        self.residency.admitted(self.meta(s, now), now, 0)

    def cleaned(self, s: Session, when: float) -> None:
        """``s``'s SSD copy became complete while it is resident: publish it."""
        self.residency.published(self.meta(s, when))
