"""What an SSD tier knows of its files while open: lengths, prefixes, reservations, the
bytes they use, and (authenticated mode) each session's incarnation.

A read serves a file only if its prefix (which covers the header's CRC and the body's
hash) is the one this tier wrote or found at open, so a file swapped behind the tier's
back, even for a valid older copy of the same segment, is refused: :attr:`SegmentIndex.tags`
holds those prefixes.

In authenticated mode every segment of a session carries the session's incarnation, a
random id shared by every segment of the session while the session has any segment in
the tier (a new one after it has had none): :meth:`SegmentIndex.begin_incarnation` and
:meth:`SegmentIndex.end_incarnation` keep that count.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from ...payload import ALIGN, INCARNATION_BYTES
from ..base import SegmentKey

__all__ = ["SegmentIndex"]


class SegmentIndex:
    """The committed segments and the reservations of one SSD tier (no I/O).

    :param authenticated: whether segments carry incarnations (the tier has a secret)
    """

    def __init__(self, *, authenticated: bool) -> None:
        self.authenticated = authenticated
        self.lengths: dict[SegmentKey, int] = {}
        """Each committed segment's length."""
        self.tags: dict[SegmentKey, bytes] = {}
        """Each committed segment's prefix (magic, header length, CRC, body hash)."""
        self.reserved: dict[SegmentKey, int] = {}
        self.used = 0
        """Bytes of committed segments and reservations."""
        self._incarnations: dict[str, list[Any]] = {}
        """Per session, in authenticated mode: [incarnation, segments committed or being
        written]."""

    def __contains__(self, key: SegmentKey) -> bool:
        return key in self.lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[SegmentKey]:
        return iter(tuple(self.lengths))

    def add(self, key: SegmentKey, length: int, tag: bytes) -> None:
        """Index a segment found at open."""
        self.lengths[key] = length
        self.tags[key] = tag
        self.used += length

    def forget(self, key: SegmentKey) -> int | None:
        """Take a committed segment out (deleted or moved aside); its length, or ``None``
        if it was not indexed."""
        length = self.lengths.pop(key, None)
        if length is None:
            return None
        self.used -= length
        self.tags.pop(key, None)
        self.end_incarnation(key[0])
        return length

    def clear(self) -> None:
        """Forget everything (the tier closed, or its open failed)."""
        self.lengths.clear()
        self.tags.clear()
        self._incarnations.clear()
        self.reserved.clear()
        self.used = 0

    # -- reservations --------------------------------------------------------------------
    def reserve(self, key: SegmentKey, length: int, capacity: int, tier: str) -> bool:
        """Set ``length`` bytes aside for ``key`` if they fit in ``capacity``.

        :raises ValueError: ``key`` is held or reserved already, or ``length`` is not a
            multiple of 4 KiB
        """
        if key in self.reserved or key in self.lengths:
            raise ValueError(f"tier {tier!r} already holds or reserves segment {key[1]}")
        if length % ALIGN:
            raise ValueError(f"segment length {length} is not a multiple of {ALIGN}")
        if self.used + length > capacity:
            return False
        self.reserved[key] = length
        self.used += length
        return True

    def release(self, key: SegmentKey) -> None:
        """Give back a reservation that was not written (no-op otherwise)."""
        length = self.reserved.pop(key, None)
        if length is not None:
            self.used -= length

    def commit(self, key: SegmentKey, tag: bytes) -> None:
        """Turn ``key``'s reservation into a committed segment whose prefix is ``tag``."""
        self.lengths[key] = self.reserved.pop(key)
        self.tags[key] = tag

    # -- incarnations --------------------------------------------------------------------
    def seed_incarnation(self, session: str, incarnation: bytes, segments: int) -> None:
        """Record the incarnation the files of ``session`` found at open share."""
        self._incarnations[session] = [incarnation, segments]

    def begin_incarnation(self, session: str) -> bytes | None:
        """The incarnation to write one more segment of ``session`` with (authenticated
        mode; ``None`` otherwise): the session's current one, or a new one if it has none."""
        if not self.authenticated:
            return None
        entry = self._incarnations.get(session)
        if entry is None:
            entry = self._incarnations[session] = [os.urandom(INCARNATION_BYTES), 0]
        entry[1] += 1
        incarnation: bytes = entry[0]
        return incarnation

    def end_incarnation(self, session: str) -> None:
        """One segment of ``session`` fewer (deleted, quarantined, or its write failed)."""
        entry = self._incarnations.get(session)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._incarnations[session]
