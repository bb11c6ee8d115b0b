"""Protocols for the pure decision makers: eviction (and, in its own module, scheduling).

A policy is a synchronous object with no I/O, no clock and no asyncio: time comes in as
``now``, and what it knows about sessions comes from the metadata channel
(:class:`tieredkv.meta.MetadataView`) and from the notifications below. The same object
therefore runs inside :class:`tieredkv.TieredKVCache` (wall clock) and inside the
simulator (virtual clock), and a test can drive it with plain numbers.

Eviction, phase by phase, for one tier:

1. ``on_access(session, meta, now)`` for *every* access (append or load) of any session,
   resident in this tier or not, with the metadata as it stands after the access. Learning
   policies (Bidaw) observe reuse here; recency policies (LRU) refresh resident entries.
2. ``on_admit(session, meta, now)`` when the session's complete history becomes resident
   in this tier, or when its resident size changes (an append, or a fork sharing its
   history); ``meta.nbytes`` is the size of its history, :func:`freed_bytes` what
   evicting it would free (less when it shares segments with other conversations).
3. ``victims(need, now, view, protected)`` when the tier needs ``need`` more free bytes.
   The answer is atomic: a list of resident sessions, none of them in ``protected``, whose
   sizes add up to at least ``need``; or ``None`` (and nothing changes) when that is
   impossible. Choosing victims does not remove them: the cache moves each one and then
   calls ``on_remove``. A victim it could not move stays resident.
4. ``on_remove(session)`` when the session is no longer resident in this tier (demoted,
   promoted away in exclusive mode, evicted, dropped). Unknown sessions are ignored.

Optionally, ``on_hint(session, meta, now)`` when a caller's hint changed a session's
metadata between accesses (:class:`Hinted`); a policy without it reads hints at the next
access.

**Pins.** A session the caller pinned (``KVMeta.pinned_until`` after ``now``; the view's
``pins`` index them) is never a victim: every policy's :meth:`~Eviction.victims` treats it
as protected (:func:`shielded`), so the live cache and the simulator enforce pins the same
way, at the place victims are chosen.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Protocol, runtime_checkable

from ..meta import KVMeta, MetadataView

__all__ = ["Eviction", "Foresight", "Hinted", "freed_bytes", "shielded", "stored_share"]


def freed_bytes(meta: KVMeta, tier: int = 0) -> int:
    """What moving the conversation out of tier ``tier`` (by index; the host tier by
    default) frees there: its history's bytes less those another conversation resident in
    that tier also lists (:attr:`~tieredkv.meta.KVMeta.tier_shared`; all of ``nbytes`` for
    a conversation that shares nothing).

    Conversations form a forest: a fork lists its parent's history up to the fork point,
    stored once. A range shared by several conversations stays in a tier while any of them
    is resident there, so evicting one of them frees what no other resident lists; once
    the others have left the tier, the range is freed with the last of them, and counts
    in full in what evicting it frees (its publisher tells the policy again when that
    changes). A policy that ranks by value per byte divides by this.
    """
    shared = meta.tier_shared
    return meta.nbytes - (shared[tier] if tier < len(shared) else meta.shared_bytes)


def stored_share(meta: KVMeta) -> int:
    """The conversation's share of the bytes stored (:attr:`~tieredkv.meta.KVMeta.share_bytes`:
    what it owns, plus each range it shares divided among the conversations listing it;
    ``nbytes`` for one that shares nothing). The bytes that pass through a tier when a set
    of conversations is accessed add up to about their shares (exactly, when every
    conversation listing a range is in the set): a policy that measures reuse distances
    in bytes, or simulates a cache of the tier's capacity, weighs each access by it."""
    share = meta.share_bytes
    return meta.nbytes if share is None else share


def shielded(protected: Set[str], view: MetadataView, now: float) -> Set[str]:
    """``protected`` and every session pinned at ``now`` (the sessions a victim may not be).

    O(pinned sessions): pins are few (the cache bounds the bytes they hold)."""
    pins = view.pins
    if not pins:
        return protected
    pinned = {session for session, until in pins.items() if until > now}
    return protected | pinned if pinned else protected


@runtime_checkable
class Eviction(Protocol):
    """Chooses which sessions leave a tier when it needs room. See the module docstring."""

    name: str
    """Registry name of the policy (``"lru"``, ``"bidaw"``, ...)."""

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        """Observe an access (append or load) of any session."""
        ...

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        """The session is resident in this tier with ``meta.nbytes`` bytes (insert or resize)."""
        ...

    def on_remove(self, session: str) -> None:
        """The session left this tier (no-op if it was not resident)."""
        ...

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        """Resident sessions, outside ``protected``, whose bytes add up to ``need`` or more.

        :returns: the sessions to move out, in eviction order; ``None`` if no choice frees
            enough (the policy's state is then unchanged)
        """
        ...

    def __len__(self) -> int:
        """Resident sessions tracked."""
        ...

    def resident_bytes(self) -> int:
        """Bytes of the resident sessions tracked."""
        ...


@runtime_checkable
class Foresight(Protocol):
    """An eviction policy that can say how soon a session is likely back, whether its KV is
    in the policy's tier or not. The cache's predictive prefetch
    (:meth:`tieredkv.TieredKVCache.prefetch_predicted`) asks it which sessions on lower
    tiers are worth bringing up, and what the sessions they would displace are worth."""

    def foresee(self, session: str) -> float | None:
        """The chance (0 to 1) that ``session``'s next access is a hit if its KV were in this
        tier now, as the policy's model of reuse puts it; ``None`` if it knows nothing of
        the session (never seen, or forgotten)."""
        ...


@runtime_checkable
class Hinted(Protocol):
    """An eviction policy that weighs a caller's hints given between accesses
    (:meth:`tieredkv.TieredKVCache.hint`)."""

    def on_hint(self, session: str, meta: KVMeta, now: float) -> None:
        """The session's hints changed (``meta`` has them); no access happened."""
        ...
