"""First come, first served: the I/O-oblivious baseline scheduler."""

from __future__ import annotations

import heapq

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
    queued, so a queued request's load overlaps the running one; the head still blocks the
    line if its load is late. With a look-ahead ``window`` (CachedAttention's
    scheduler-aware fetching, :class:`~tieredkv.policies.LookAheadFCFS`) only the loads of
    the next ``window`` queued requests may start, in queue order: a request's place in the
    queue is the number of requests submitted before it and not yet handed out, so requests
    must be submitted in arrival order (a request submitted out of order makes the window
    approximate, never unsafe).

    :param max_loads: loads in flight at most
    :param prefetch: start the loads of queued requests ahead of time (else on demand)
    :param window: with ``prefetch``, queued requests (from the head) whose loads may
        start (``None``: every queued request's)
    :raises ValueError: for a window below 1, or a window without ``prefetch``
    """

    name = "fcfs"

    def __init__(
        self, max_loads: int = 1, *, prefetch: bool = True, window: int | None = None
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 queued requests (got {window})")
        if window is not None and not prefetch:
            raise ValueError("a look-ahead window bounds prefetching: it needs prefetch=True")
        super().__init__(max_loads)
        self.prefetch = prefetch
        self.window = window
        self._handed = 0  # requests handed out so far (the head's place in the queue)
        self._wanted: Load | None = None  # on demand: the head's load, once asked for
        self._queue: list[tuple[tuple[float, int], Entry]] = []
        self._load_queue: list[tuple[tuple[float, int], Load]] = []

    def submit(self, request: Request, now: float, view: MetadataView) -> None:
        entry = self._new_entry(request)
        meta = view.get(request.session)
        if kv_needs_load(meta, view):
            assert meta is not None
            load = self._join_load(entry, meta)
            if load is not None and self.prefetch:
                heapq.heappush(self._load_queue, ((request.arrival, self._seq), load))
        else:
            self._ready_count[request.session] += 1
        heapq.heappush(self._queue, (entry.key, entry))

    def _next_load(self, now: float) -> Load | None:
        if not self.prefetch:
            load, self._wanted = self._wanted, None
            return load if load is not None and not load.done and not load.started else None
        queue = self._load_queue
        while queue:
            load = queue[0][1]
            if load.done:  # finished before we started it (reported early)
                heapq.heappop(queue)
                continue
            # entries are numbered 1, 2, ... at submission: the head's number is handed + 1
            if self.window is not None and load.entries[0].key[1] - 1 - self._handed >= (
                self.window
            ):
                return None
            heapq.heappop(queue)
            return load
        return None

    def _hand_out(self, request: Request) -> None:
        super()._hand_out(request)
        self._handed += 1

    def load_finished(self, session: str, now: float, *, ok: bool = True) -> list[Request]:
        load = self._finish_load(session)
        if load is None:
            return []
        self._ready_count[session] += len(load.entries)
        return [entry.request for entry in load.entries]

    def _runnable(self, entry: Entry) -> bool:
        if entry.load is None:
            return True
        if not self.prefetch:
            self._wanted = entry.load  # the engine asks for work: fetch the head's KV now
        return False

    def next_batch(
        self, now: float, token_budget: int, max_requests: int | None = None
    ) -> list[Request]:
        return self._take_batch(self._queue, token_budget, max_requests)

    def waiting(self, limit: int | None = None) -> list[str]:
        n = len(self) if limit is None else limit
        queued = heapq.nsmallest(n + self._stale, self._queue)
        return [entry.request.session for _, entry in queued if not entry.cancelled][:n]

    def __len__(self) -> int:
        return len(self._queue) - self._stale

    def _withdrawn(self, entry: Entry, *, waited: bool) -> None:
        super()._withdrawn(entry, waited=waited)  # every entry is in the one queue
        self._handed += 1  # the requests behind it move up (the look-ahead window)
