"""The SharedTier protocol: a tier that several caches (replicas, machines) use at once.

A shared tier stores the same segments as any :class:`~tieredkv.backends.base.Tier`, in a
store that several :class:`~tieredkv.TieredKVCache` instances reach (for example
:class:`~tieredkv.backends.redis.RedisTier`). Each conversation is a replicated log there:
a manifest lists its committed segments, ``seq`` 0, 1, ..., under a version that every
change advances, and one replica at a time (the holder of its fencing token) may extend it.

On top of the Tier protocol a shared tier lets a cache

* *refresh* its view of a conversation (:meth:`SharedTier.refresh`): the committed history
  and whether it is the one this replica last committed or read (``"current"``), another
  one (``"changed"``: another replica appended, or the server lost and rebuilt it), or
  none (``"absent"``; ``"lost"`` when this replica knew a committed history that is gone;
  ``"damaged"`` when the store's copy fails its checks). With ``take`` the replica becomes
  the conversation's writer in the same step;
* take the writer's fencing token (:meth:`SharedTier.acquire`,
  :meth:`SharedTier.ensure_writer`): the store itself refuses a commit that does not carry
  the current token, does not extend the version the writer last saw, or comes after the
  writer stopped waiting for it;
* decide whether its local copy may be served while the store cannot be reached
  (:meth:`SharedTier.may_serve_local`);
* remove a conversation for every replica (:meth:`SharedTier.discard`).

:meth:`~tieredkv.backends.base.Tier.delete` on a shared tier only stops this cache from
counting a segment: a cache's own bookkeeping (an eviction, a promotion, a failed copy)
never removes what other replicas read.

This module imports no client library: the cache checks for the protocol without needing
``redis`` installed.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import msgspec

from ..payload import SegmentHeader, plain_header
from .base import Tier

__all__ = ["SharedState", "SharedTier", "plain_header"]


class SharedState(msgspec.Struct, frozen=True, kw_only=True):
    """What a shared tier holds of one conversation, from :meth:`SharedTier.refresh`.

    :param status: ``"current"`` (the committed history is the one this tier last
        committed or read for the conversation), ``"changed"`` (another one), ``"absent"``
        (none, and this tier knew of none), ``"lost"`` (none, or an older one, where this
        tier knew a committed history, even one whose view it has dropped since while this
        replica stayed its writer: the server lost data, or another replica took the
        conversation over and dropped it), ``"damaged"`` (the store's
        copy fails its checks: never served)
    :param headers: the committed segments' headers, ``seq`` 0, 1, ... (empty unless
        ``"current"`` or ``"changed"``)
    """

    status: Literal["current", "changed", "absent", "lost", "damaged"]
    headers: tuple[SegmentHeader, ...] = ()


@runtime_checkable
class SharedTier(Tier, Protocol):
    """A tier whose segments other caches (replicas) also read and write."""

    async def refresh(self, session: str, *, take: bool = False) -> SharedState:
        """Read the store's committed history of ``session`` and index it.

        Afterwards :meth:`~tieredkv.backends.base.Tier.contains`,
        :meth:`~tieredkv.backends.base.Tier.length` and
        :meth:`~tieredkv.backends.base.Tier.read` reflect the store's current
        manifest for ``session``.

        :param take: also become the conversation's writer, in the same atomic step (only
            if it has committed segments): a later commit by the replica that was its writer
            is refused
        :raises TierIOError: if the store cannot be reached (nothing changed)
        """
        ...

    async def lookup(self, session: str) -> list[SegmentHeader]:
        """The headers of ``session``'s committed segments (``refresh`` without ``take``);
        empty if the store holds none, or an unusable set.

        A look only: the cache does not make its copies agree with what it finds, so it is
        not a read of the history that :meth:`acquire` accepts as proof.

        :raises TierIOError: if the store cannot be reached
        """
        ...

    async def acquire(self, session: str, *, force: bool = False) -> int:
        """Take ``session``'s writer lease; later writes to it carry the returned token.

        Without ``force`` the store grants it only to a replica whose copy is the current
        history: the version this replica last committed, or last read with
        :meth:`refresh` (which the cache makes its copies agree with), or none for a
        conversation it does not hold. A newer version that only a :meth:`lookup` (or
        another look the cache did not take in) found is not proof: the cache's copy is
        the older one, and a turn after it must not be committed after the newer one.

        :param force: take the conversation over even while another replica's lease is
            live (its next write is then refused)
        :returns: the fencing token, larger than every token given out before for ``session``
        :raises LeaseHeldError: if another replica's lease is live and ``force`` is false
        :raises HistoryConflictError: the history changed since this replica last read it
        :raises TierIOError: if the store cannot be reached
        """
        ...

    async def ensure_writer(self, session: str) -> int:
        """Make sure this replica may append to ``session`` (taking a free lease); return
        its fencing token.

        :raises StaleWriterError: another replica took the conversation over since this one
            acquired it
        :raises LeaseHeldError: this replica holds no lease and another one's is live
        :raises HistoryConflictError: this replica holds no lease and the history changed
            since it last read it (or the store lost it)
        :raises TierIOError: if the store cannot be reached
        """
        ...

    def token(self, session: str) -> int | None:
        """This replica's fencing token for ``session`` (``None``: it is not the writer)."""
        ...

    def may_serve_local(self, session: str) -> bool:
        """Whether, with the store unreachable, this replica may serve its own copy of
        ``session`` as current: it is the writer and its lease has not run out by its own
        clock (so no other replica can have committed since)."""
        ...

    async def discard(self, session: str) -> bool:
        """Remove ``session``'s history from the store for every replica, if this replica is
        its writer; ``False`` (and only this tier's view is dropped) otherwise.

        :raises TierIOError: if the store cannot be reached
        """
        ...
