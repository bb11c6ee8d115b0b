"""Bookkeeping shared by the schedulers: queued requests and per-session KV loads."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Set

from ..meta import KVMeta
from .scheduling import Request

__all__ = ["Entry", "Load", "LoadQueue"]


class Entry:
    """A queued request; ``load`` is the pending load it waits for (``None``: ready)."""

    __slots__ = ("key", "load", "request")

    def __init__(self, request: Request, seq: int) -> None:
        self.request = request
        # Heap key: arrival first, submission order breaks ties (and keeps keys unique, so
        # entries themselves are never compared).
        self.key = (request.arrival, seq)
        self.load: Load | None = None


class Load:
    """One session's KV load, shared by every queued request of that session."""

    __slots__ = ("arrival", "done", "entries", "nbytes", "seq", "session", "started")

    def __init__(self, session: str, nbytes: int, arrival: float, seq: int) -> None:
        self.session = session
        self.nbytes = nbytes
        self.arrival = arrival  # of the earliest request waiting for it
        self.seq = seq
        self.entries: list[Entry] = []
        self.started = False
        self.done = False


def check_max_loads(max_loads: int) -> int:
    if max_loads < 1:
        raise ValueError(
            f"max_loads must be at least 1 (got {max_loads}): it bounds loads in flight"
        )
    return max_loads


class LoadQueue:
    """What both schedulers share: unique request ids, per-session pending loads, at most
    ``max_loads`` of them in flight, the count of ready requests per session, and handing
    out requests from the head of a queue. Subclasses choose which queued load starts next
    (:meth:`_next_load`), where requests go once their load lands, and which queue
    :meth:`next_batch` serves (through :meth:`_take_batch`)."""

    def __init__(self, max_loads: int) -> None:
        self.max_loads = check_max_loads(max_loads)
        self._loads: dict[str, Load] = {}  # session -> pending load (queued or in flight)
        self._ids: set[str] = set()
        self._in_flight = 0
        self._seq = 0
        self._ready_count: Counter[str] = Counter()  # session -> ready, not handed out

    def next_batch(
        self, now: float, token_budget: int, max_requests: int | None = None
    ) -> list[Request]:  # pragma: no cover - abstract
        raise NotImplementedError

    def pop_ready(self, now: float) -> Request | None:
        """The next request to run: a batch of one (the first is taken whatever its size)."""
        batch = self.next_batch(now, 0, 1)
        return batch[0] if batch else None

    def ready_sessions(self) -> Set[str]:
        return self._ready_count.keys()

    def _runnable(self, entry: Entry) -> bool:
        """May the head of the served queue be handed out now?"""
        return True

    def _take_batch(
        self,
        queue: list[tuple[tuple[float, int], Entry]],
        token_budget: int,
        max_requests: int | None,
    ) -> list[Request]:
        """Pop requests from the head of ``queue`` (a heap by arrival) while they are
        :meth:`_runnable` and their ``tokens`` fit ``token_budget``; the first one is taken
        even if it alone exceeds the budget (it would starve otherwise)."""
        batch: list[Request] = []
        used = 0
        while queue and (max_requests is None or len(batch) < max_requests):
            entry = queue[0][1]
            if not self._runnable(entry):
                break
            if batch and used + entry.request.tokens > token_budget:
                break
            heapq.heappop(queue)
            self._hand_out(entry.request)
            batch.append(entry.request)
            used += entry.request.tokens
        return batch

    def _hand_out(self, request: Request) -> None:
        self._ids.discard(request.id)
        left = self._ready_count[request.session] - 1
        if left:
            self._ready_count[request.session] = left
        else:
            del self._ready_count[request.session]

    def _new_entry(self, request: Request) -> Entry:
        if request.id in self._ids:
            raise ValueError(f"request id {request.id!r} is already queued: ids must be unique")
        self._ids.add(request.id)
        self._seq += 1
        return Entry(request, self._seq)

    def _join_load(self, entry: Entry, meta: KVMeta) -> Load | None:
        """Attach ``entry`` to its session's pending load; return the load if it is new."""
        session = entry.request.session
        load = self._loads.get(session)
        created = load is None
        if load is None:
            load = Load(session, meta.nbytes, entry.request.arrival, self._seq)
            self._loads[session] = load
        load.entries.append(entry)
        entry.load = load
        return load if created else None

    def _next_load(self, now: float) -> Load | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def start_loads(self, now: float) -> list[Request]:
        started: list[Request] = []
        while self._in_flight < self.max_loads:
            load = self._next_load(now)
            if load is None:
                break
            load.started = True
            self._in_flight += 1
            started.append(load.entries[0].request)
        return started

    def _finish_load(self, session: str) -> Load | None:
        """Retire ``session``'s load; its requests may run (without KV they recompute)."""
        load = self._loads.pop(session, None)
        if load is None:
            return None
        if load.started:
            self._in_flight -= 1
        load.done = True  # a queued copy in a heap is now stale
        for entry in load.entries:
            entry.load = None
        return load
