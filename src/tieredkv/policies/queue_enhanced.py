"""Queue-enhanced LRU: the CachedAttention-style baseline."""

from __future__ import annotations

from collections.abc import Set

from ..meta import MetadataView
from .lru import LRU

__all__ = ["QueueEnhanced"]


class QueueEnhanced(LRU):
    """LRU that never evicts the sessions of the next ``window`` requests in the scheduler's
    queue.

    CachedAttention (ATC'24) looks ahead into the job queue: a conversation that is about to
    run keeps its KV in host memory, whatever its recency. The queue comes from the metadata
    channel (``view.waiting``, published by the engine in run order); its first ``window``
    sessions join ``protected``. When the rest cannot free enough, the answer is ``None``:
    queued sessions are never given up. State and costs are LRU's, plus O(window) per
    :meth:`victims`.

    :param window: how many upcoming requests to protect (30 in the Bidaw paper's setup)
    """

    name = "queue-enhanced"

    def __init__(self, window: int = 30) -> None:
        if window < 0:
            raise ValueError(f"window must be >= 0 requests (got {window})")
        super().__init__()
        self.window = window

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        upcoming = view.waiting[: self.window]
        if upcoming:
            protected = protected | frozenset(upcoming)
        return super().victims(need, now, view, protected)
