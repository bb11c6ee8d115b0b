"""The SharedTier protocol: a tier that several caches (replicas, machines) use at once.

A shared tier stores the same segments as any :class:`~tieredkv.backends.base.Tier`, in a
store that several :class:`~tieredkv.TieredKVCache` instances reach (for example
:class:`~tieredkv.backends.redis.RedisTier`). On top of the Tier protocol it lets a cache
*discover* conversations that another replica wrote (:meth:`SharedTier.lookup`) and take
a conversation's writer lease (:meth:`SharedTier.acquire`), so that one replica at a time
appends to it.

This module imports no client library: the cache checks for the protocol without needing
``redis`` installed.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..payload import SegmentHeader
from .base import Tier

__all__ = ["SharedTier"]


@runtime_checkable
class SharedTier(Tier, Protocol):
    """A tier whose segments other caches (replicas) also read and write."""

    async def lookup(self, session: str) -> list[SegmentHeader]:
        """Refresh what this tier knows of ``session`` from the shared store.

        Afterwards :meth:`~tieredkv.backends.base.Tier.contains`,
        :meth:`~tieredkv.backends.base.Tier.length` and
        :meth:`~tieredkv.backends.base.Tier.read_into` reflect the store's current
        manifest for ``session``.

        :returns: the headers of the conversation's published segments, ``seq`` 0, 1, ...
            in order (empty if the store holds none, or holds an unusable set)
        :raises TierIOError: if the store cannot be reached
        """
        ...

    async def acquire(self, session: str, *, force: bool = False) -> int:
        """Take ``session``'s writer lease; later writes to it carry the returned token.

        :param force: take the conversation over even while another replica's lease is
            live (its next write is then refused)
        :returns: the fencing token, larger than every token given out before for ``session``
        :raises LeaseHeldError: if another replica's lease is live and ``force`` is false
        :raises TierIOError: if the store cannot be reached
        """
        ...

    async def ensure_writer(self, session: str) -> int:
        """Make sure this replica may append to ``session`` (taking a free lease); return
        its fencing token.

        :raises StaleWriterError: another replica took the conversation over since this one
            acquired it
        :raises LeaseHeldError: this replica holds no lease and another one's is live
        :raises TierIOError: if the store cannot be reached
        """
        ...
