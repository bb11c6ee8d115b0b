"""The bound on what a cache keeps of the conversations it lost (``max_lost_records``).

A conversation whose last copy is evicted (or found damaged, or lost by a shared tier)
keeps two records: its metadata in the channel, with ``tier`` ``None`` (what tells a
caller the history is gone), and, until a call tells the caller, its unreported loss
(:attr:`~tieredkv._cache.state.Core.unreported`: the next append without
``expected_tokens`` raises :class:`~tieredkv.errors.HistoryLostError`). About 480 bytes
each (``benchmarks/_lost_records.py``); a server whose last tier evicts loses one
conversation per eviction. With a bound, the oldest records go once there are more:
what a cache opened after the loss would know of it, which is nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from ..meta import KVMeta, MetadataChannel

__all__ = ["LostRecords"]


class LostRecords:
    """Publishes a cache's metadata into its channel (the publisher of its
    :class:`~tieredkv.residency.Residency`), keeping at most ``limit`` records of lost
    conversations: past it, the oldest loss's record is taken off the channel and
    ``forget`` is called with its key.

    :param channel: the cache's metadata channel
    :param limit: the most lost conversations kept a record of (``None``: no bound)
    :param forget: called with each key whose record went (the cache drops its unreported
        loss and counts it)
    :param in_use: whether a key's conversation is still indexed (an operation holds it,
        or waits for it): its record stays until a later loss, as the newest
    """

    __slots__ = ("_channel", "_forget", "_in_use", "_limit", "_order")

    def __init__(
        self,
        channel: MetadataChannel,
        limit: int | None,
        forget: Callable[[str], None],
        in_use: Callable[[str], bool],
    ) -> None:
        self._channel = channel
        self._limit = limit
        self._forget = forget
        self._in_use = in_use
        self._order: dict[str, None] = {}
        """The keys of the lost conversations recorded, oldest loss first (with a limit)."""

    def __len__(self) -> int:
        """Lost conversations recorded (counted only with a limit)."""
        return len(self._order)

    def put(self, meta: KVMeta) -> None:
        """Publish ``meta``; a conversation published as lost is recorded, one published
        where it is stored again is not any more."""
        self._channel.put(meta)
        if self._limit is None:
            return
        key = meta.session
        if meta.tier is not None:
            self._order.pop(key, None)
        elif key not in self._order:
            self._order[key] = None
            if len(self._order) > self._limit:
                self._trim(self._limit)

    def remove(self, session: str) -> KVMeta | None:
        """Take ``session``'s metadata off the channel (a drop); what was there, or ``None``."""
        self._order.pop(session, None)
        return self._channel.remove(session)

    def _trim(self, limit: int) -> None:
        """Forget the oldest records until ``limit`` are left, or only records in use."""
        order = self._order
        for _ in range(len(order)):
            if len(order) <= limit:
                return
            key = next(iter(order))
            del order[key]
            meta = self._channel.get(key)
            if meta is None or meta.tier is not None:  # (not a lost record any more)
                continue
            if self._in_use(key):
                order[key] = None  # kept for now, as the newest
                continue
            self._channel.remove(key)
            self._forget(key)
