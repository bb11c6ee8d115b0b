"""First come, first served: the I/O-oblivious baseline scheduler."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Set

from ..meta import MetadataView
from ._loads import Entry, Load, LoadQueue
from .scheduling import Request, kv_needs_load

__all__ = ["FCFS"]


class FCFS(LoadQueue):
    """Run requests strictly in arrival order; a request waiting for its KV blocks the line.

    State: one queue of every request in arrival order (a heap keyed by arrival time, then
    submission order), and one pending load per session whose KV is on a lower tier. Loads
    are issued in arrival order, at most ``max_loads`` at a time. :meth:`pop_ready` hands
    out the head of the queue only once its KV is in host memory: until then nothing runs,
    even if later requests are ready. That head-of-line blocking is what the Bidaw paper
    measures against (the engine idles while one large KV crawls in from SSD).

    With ``prefetch=False`` the scheduler is I/O-oblivious in the strictest sense, as a
    server that fetches a request's KV when it schedules it: no load starts until the
    engine asks for work (:meth:`pop_ready`) and finds the head of the queue waiting for
    its KV; only then does that one load start, and the engine idles until it lands. With
    ``prefetch=True`` (the default) loads start in arrival order as soon as requests are
    queued, so a queued request's load overlaps the running one (CachedAttention's
    scheduler-aware prefetching); the head still blocks the line if its load is late.

    :param max_loads: loads in flight at most
    :param prefetch: start the loads of queued requests ahead of time (else on demand)
    """

    name = "fcfs"

    def __init__(self, max_loads: int = 1, *, prefetch: bool = True) -> None:
        super().__init__(max_loads)
        self.prefetch = prefetch
        self._wanted: Load | None = None  # on demand: the head's load, once asked for
        self._queue: list[tuple[tuple[float, int], Entry]] = []
        self._load_queue: list[tuple[tuple[float, int], Load]] = []
        self._ready: Counter[str] = Counter()

    def submit(self, request: Request, now: float, view: MetadataView) -> None:
        entry = self._new_entry(request)
        meta = view.get(request.session)
        if kv_needs_load(meta, view):
            assert meta is not None
            load = self._join_load(entry, meta)
            if load is not None and self.prefetch:
                heapq.heappush(self._load_queue, ((request.arrival, self._seq), load))
        else:
            self._ready[request.session] += 1
        heapq.heappush(self._queue, (entry.key, entry))

    def _next_load(self, now: float) -> Load | None:
        if not self.prefetch:
            load, self._wanted = self._wanted, None
            return load if load is not None and not load.done and not load.started else None
        while self._load_queue:
            _, load = heapq.heappop(self._load_queue)
            if not load.done:  # else finished before we started it (reported early)
                return load
        return None

    def load_finished(self, session: str, now: float, *, ok: bool = True) -> list[Request]:
        load = self._finish_load(session)
        if load is None:
            return []
        self._ready[session] += len(load.entries)
        return [entry.request for entry in load.entries]

    def pop_ready(self, now: float) -> Request | None:
        if not self._queue:
            return None
        waiting_for = self._queue[0][1].load
        if waiting_for is not None:
            if not self.prefetch:
                self._wanted = waiting_for  # the engine is idle: fetch the head's KV now
            return None
        _, entry = heapq.heappop(self._queue)
        self._hand_out(entry.request)
        return entry.request

    def next_batch(
        self, now: float, token_budget: int, max_requests: int | None = None
    ) -> list[Request]:
        batch: list[Request] = []
        used = 0
        while self._queue and (max_requests is None or len(batch) < max_requests):
            entry = self._queue[0][1]
            if entry.load is not None:
                if not self.prefetch:
                    self._wanted = entry.load  # next in line: fetch its KV now
                break
            if batch and used + entry.request.tokens > token_budget:
                break
            heapq.heappop(self._queue)
            self._hand_out(entry.request)
            batch.append(entry.request)
            used += entry.request.tokens
        return batch

    def waiting(self, limit: int | None = None) -> list[str]:
        n = len(self._queue) if limit is None else limit
        return [entry.request.session for _, entry in heapq.nsmallest(n, self._queue)]

    def ready_sessions(self) -> Set[str]:
        return self._ready.keys()

    def __len__(self) -> int:
        return len(self._queue)

    def _hand_out(self, request: Request) -> None:
        self._ids.discard(request.id)
        left = self._ready[request.session] - 1
        if left:
            self._ready[request.session] = left
        else:
            del self._ready[request.session]
