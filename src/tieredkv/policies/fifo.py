"""First in, first out eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from ..meta import KVMeta, MetadataView
from .base import shielded

__all__ = ["FIFO"]


class FIFO:
    """Evict the session that became resident earliest.

    State: an insertion-ordered map session -> resident bytes. Accesses change nothing; a
    resize (an append to a resident session) keeps the session's place. :meth:`victims`
    walks from the oldest admission, skipping protected sessions. Every operation is O(1)
    except :meth:`victims`, which is O(victims + skipped).

    A conversation-oblivious baseline of the Bidaw paper.
    """

    name = "fifo"

    def __init__(self) -> None:
        # an OrderedDict, not a dict: walking a dict from the front after many deletions
        # there skips every deleted slot until the next resize
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        pass

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        self._bytes += meta.nbytes - self._sizes.get(session, 0)
        self._sizes[session] = meta.nbytes

    def on_remove(self, session: str) -> None:
        self._bytes -= self._sizes.pop(session, 0)

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        chosen: list[str] = []
        freed = 0
        protected = shielded(protected, view, now)
        for session, size in self._sizes.items():
            if freed >= need:
                break
            if session in protected:
                continue
            chosen.append(session)
            freed += size
        return chosen if freed >= need else None

    def __len__(self) -> int:
        return len(self._sizes)

    def resident_bytes(self) -> int:
        return self._bytes
