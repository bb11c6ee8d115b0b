"""One rule for every change of where a session's KV lives: publish its metadata, then
notify the eviction policies, then announce the event, in that order.

The live cache (:mod:`tieredkv._cache`), the simulator (:mod:`tieredkv.sim.engine`) and the
eviction-only replay (:mod:`tieredkv.sim.replay`) all keep a metadata channel and a set of
pure eviction policies (:class:`~tieredkv.policies.Eviction`, one per tier) in step with
their own placement state. What they share is this module: the caller computes the
session's new :class:`~tieredkv.meta.KVMeta` from its own state (placement, sizes, turns:
:func:`~tieredkv.meta.advance_meta`), and :class:`Residency` does the rest in the one order,

1. **publish**: the metadata goes to the channel first, so that a policy notified next, or
   a subscriber told of the event, reads the session as it now is;
2. **notify**: ``on_access`` to every tier's policy (an access is seen by all: a learning
   policy observes reuse wherever the KV lives), then ``on_admit`` to the policy of the
   tier the KV is resident in (a new session's first turn is thus its first access, not a
   reuse at distance 0); ``on_remove`` to the tier's policy it left;
3. **announce**: the event (``Stored``, ``Loaded``, ``Promoted``, ``Demoted``,
   ``Evicted``, ...) to the channel's subscribers, if the caller has one to announce.

When victims must be evicted between an access and an admission (the replay evicts to fit
the session it is admitting), the caller makes the two calls with the evictions between
them: the order inside each call is the rule, the order of the calls is the caller's.
Nothing here performs I/O or reads a clock: ``now`` comes in, like everything else.

How the live cache's sites map onto it (:class:`~tieredkv._cache.state.Core` computes a
session's metadata from its index, and its ``residency`` does the rest):

- a turn stored in tier ``t`` (``_cache/turns.commit_append``):
  ``accessed(meta, now, admit=t, event=Stored(...))``;
- a load served (``commit_load``): ``accessed(meta, now, event=Loaded(...))``;
- a promotion into tier 0 (``placement.finish_promotion``):
  ``admitted(meta, now, 0, Promoted(...))``, then in exclusive mode ``removed(key, src)``
  for the copy it came from, and ``published(meta_after)``;
- a copy leaving tier ``t`` (``placement.remove_copy``: a demotion, an eviction, a drop,
  a partial copy let go): ``removed(key, t)``; a demotion then
  ``admitted(meta, now, u, Demoted(...))``, an eviction ``published(meta, Evicted(...))``;
- a recovery, a copy found in a shared tier, a write-through landing in ``t``, a write-down
  at close: ``admitted(meta, now, t)``;
- a transfer starting or ending, a placement that changed without a move: ``published``;
- a drop: ``unpublished(key)``, the copies ``removed``, then ``announced(Dropped(...))``;
  a refused turn: ``announced(Refused(...))``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from .meta import Event, KVMeta
from .policies.base import Eviction

__all__ = ["Publisher", "Residency"]


class Publisher(Protocol):
    """Where metadata is published: a :class:`~tieredkv.meta.MetadataChannel`, or any view
    that keeps the latest :class:`~tieredkv.meta.KVMeta` per session."""

    def put(self, meta: KVMeta) -> None:
        """Store ``meta`` as its session's current metadata."""
        ...


class Residency:
    """Publishes, notifies and announces residency changes in the one order (see the module
    docstring).

    :param channel: where metadata is published (``put``)
    :param policies: the eviction policy of each tier, by tier index (a tier without one:
        pass the tiers that have one first; an index past the end is not notified)
    :param emit: where events are announced (``MetadataChannel.emit``); ``None``: events
        passed in are dropped (a replay has no subscribers)
    :param remove: where a forgotten session's metadata is taken off
        (``MetadataChannel.remove``; needed only for :meth:`unpublished`)
    """

    __slots__ = ("_emit", "_on_access", "_on_admit", "_on_remove", "_policies", "_put", "_remove")

    def __init__(
        self,
        channel: Publisher,
        policies: Sequence[Eviction],
        *,
        emit: Callable[[Event], None] | None = None,
        remove: Callable[[str], object] | None = None,
    ) -> None:
        self._put = channel.put
        self._remove = remove
        self._policies = tuple(policies)
        # bound once: these run for every turn of a simulation
        self._on_access = tuple(p.on_access for p in self._policies)
        self._on_admit = tuple(p.on_admit for p in self._policies)
        self._on_remove = tuple(p.on_remove for p in self._policies)
        self._emit = emit

    @property
    def policies(self) -> tuple[Eviction, ...]:
        """The policies notified, by tier index."""
        return self._policies

    def published(self, meta: KVMeta, event: Event | None = None) -> KVMeta:
        """The metadata changed, not the residency (a copy written, a lease, a move that
        keeps the tier): publish it (and announce ``event``)."""
        self._put(meta)
        if event is not None and self._emit is not None:
            self._emit(event)
        return meta

    def accessed(
        self, meta: KVMeta, now: float, admit: int | None = None, event: Event | None = None
    ) -> KVMeta:
        """The session was accessed (a turn appended, or its history loaded): publish
        ``meta``, tell every policy of the access, and with ``admit`` the policy of that
        tier that the session is resident there with ``meta.nbytes`` (it joined the tier,
        or grew in it); then announce ``event``."""
        self._put(meta)
        session = meta.session
        for on_access in self._on_access:
            on_access(session, meta, now)
        if admit is not None and admit < len(self._on_admit):
            self._on_admit[admit](session, meta, now)
        if event is not None and self._emit is not None:
            self._emit(event)
        return meta

    def admitted(self, meta: KVMeta, now: float, tier: int, event: Event | None = None) -> KVMeta:
        """The session's whole history became resident in ``tier`` (a promotion, a
        demotion, a recovery, a copy written through) without an access: publish ``meta``,
        tell that tier's policy, announce ``event``."""
        self._put(meta)
        if tier < len(self._on_admit):
            self._on_admit[tier](meta.session, meta, now)
        if event is not None and self._emit is not None:
            self._emit(event)
        return meta

    def removed(
        self,
        session: str,
        tier: int,
        meta: KVMeta | None = None,
        event: Event | None = None,
    ) -> None:
        """The session left ``tier`` (evicted, demoted or promoted away, dropped): publish
        its new ``meta`` if given, tell that tier's policy, announce ``event``."""
        if meta is not None:
            self._put(meta)
        if tier < len(self._on_remove):
            self._on_remove[tier](session)
        if event is not None and self._emit is not None:
            self._emit(event)

    def unpublished(self, session: str) -> None:
        """The session is forgotten (dropped): take its metadata off the channel (its
        copies are then ``removed``, and the drop ``announced``)."""
        if self._remove is None:
            raise TypeError("this Residency was built without remove=")
        self._remove(session)

    def announced(self, event: Event) -> None:
        """Announce ``event`` with no change of residency or metadata (a drop's end, a turn
        a shared tier refused)."""
        if self._emit is not None:
            self._emit(event)
