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

    __slots__ = ("cancelled", "key", "load", "request")

    def __init__(self, request: Request, seq: int) -> None:
        self.request = request
        # Heap key: arrival first, submission order breaks ties (and keeps keys unique, so
        # entries themselves are never compared).
        self.key = (request.arrival, seq)
        self.load: Load | None = None
        self.cancelled = False  # withdrawn: a copy left in a heap is stale


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
        self._entries: dict[str, Entry] = {}  # request id -> entry, submitted, not handed out
        self._stale = 0  # cancelled entries still in the served queue's heap
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
            if entry.cancelled:
                heapq.heappop(queue)
                self._stale -= 1
                continue
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
        del self._entries[request.id]
        self._uncount_ready(request.session)

    def _uncount_ready(self, session: str) -> None:
        left = self._ready_count[session] - 1
        if left:
            self._ready_count[session] = left
        else:
            del self._ready_count[session]

    def _new_entry(self, request: Request) -> Entry:
        if request.id in self._entries:
            raise ValueError(f"request id {request.id!r} is already queued: ids must be unique")
        self._seq += 1
        entry = self._entries[request.id] = Entry(request, self._seq)
        return entry

    def cancel(self, request_id: str, now: float) -> bool:
        """Withdraw a queued request (its client went away): it is never handed out, and
        its session's load, if no other request waits for it and it has not started, never
        starts. A load in flight stays in flight until :meth:`load_finished` (the other
        requests that wait for it are released then, as always). Returns whether the
        request was queued (an unknown or handed-out id is ignored)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        entry.cancelled = True
        load = entry.load
        if load is None:
            self._uncount_ready(entry.request.session)
        else:
            load.entries.remove(entry)
            entry.load = None
            if not load.entries and not load.started:
                del self._loads[load.session]
                load.done = True  # its copies in the load heaps are now stale
        self._withdrawn(entry, waited=load is not None)
        return True

    def _withdrawn(self, entry: Entry, *, waited: bool) -> None:
        """Subclass bookkeeping for a cancelled entry (``waited``: it waited for a load)."""
        self._stale += 1

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
