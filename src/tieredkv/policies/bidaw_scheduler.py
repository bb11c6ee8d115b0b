"""Bidaw's I/O-aware scheduler: a ready queue, a preparing queue, loads in disk-HRRN order."""

from __future__ import annotations

import heapq
import math

import numpy as np

from ..meta import MetadataView
from ._loads import Entry, Load, LoadQueue
from .scheduling import Request, kv_needs_load

__all__ = ["BidawScheduler"]


class BidawScheduler(LoadQueue):
    """Dual-queue scheduling: only requests whose KV is in host memory run.

    State and flow:

    - **Ready queue**: requests whose KV is in the top tier, or that have none (first turn,
      or lost: recompute), ordered by original arrival time. :meth:`pop_ready` and
      :meth:`next_batch` serve only this queue, so a request waiting for the SSD never
      blocks the engine.
    - **Preparing queue**: one pending load per session whose KV is on a lower tier. At most
      ``max_loads`` are in flight; the next one to start is the one with the highest
      *disk-HRRN* response ratio ``1 + waiting_time / cost``, where ``waiting_time`` runs
      from the arrival of the earliest request waiting for it and ``cost`` is its KV size in
      bytes, or its estimated load time ``latency + bytes / bandwidth`` when ``bandwidth``
      is given. Small KVs go first; a large one's ratio grows with its wait, but only as
      fast as its cost allows: under a steady stream of small loads a history twenty
      times larger waits twenty times longer, and while the backlog of small loads grows
      the large one is never started. So a load whose earliest request has waited
      ``max_wait`` seconds is *overdue* and starts next, before any ratio is compared
      (overdue loads in arrival order): a load starts at most ``max_wait`` after its first
      request arrived plus the time the loads in flight and the overdue loads ahead of it
      take. (Order cannot shorten a backlog the lower tier cannot serve; giving up a late
      load for recompute was tried and is worse, see ``docs/explanation/scheduling.md``.)
    - When a load lands (or fails: the history is then recomputed) its requests join the
      ready queue at their original arrival position, not at the tail.

    Choosing the next load must stay cheap with thousands of loads queued, so sizes are
    bucketed into ``classes_per_octave`` geometric classes and the ratio uses the class's
    lower edge: within a class the oldest load has the highest ratio, so a decision compares
    only the heads of the non-empty classes (O(classes), independent of queue length). With
    the default 16 classes per octave, sizes are rounded down by at most 4.3%;
    :meth:`response_ratio` reports the ratio the scheduler actually uses.

    :param max_loads: loads in flight at most
    :param bandwidth: bytes per second of the lower tier; ``None`` ranks by bytes alone
    :param latency: fixed seconds per load (only with ``bandwidth``)
    :param classes_per_octave: size classes per doubling of KV size
    :param max_wait: seconds after which a queued load is overdue and starts ahead of
        every ratio (``None``: pure disk-HRRN)
    """

    name = "bidaw"

    def __init__(
        self,
        max_loads: int = 1,
        *,
        bandwidth: float | None = None,
        latency: float = 0.0,
        classes_per_octave: int = 16,
        max_wait: float | None = 20.0,
    ) -> None:
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"bandwidth must be positive bytes/s or None (got {bandwidth})")
        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds (got {latency})")
        if classes_per_octave < 1:
            raise ValueError(f"classes_per_octave must be >= 1 (got {classes_per_octave})")
        if max_wait is not None and not max_wait > 0:
            raise ValueError(f"max_wait must be positive seconds or None (got {max_wait})")
        super().__init__(max_loads)
        self.bandwidth = bandwidth
        self.latency = latency
        self.classes_per_octave = classes_per_octave
        self.max_wait = max_wait
        self._ready: list[tuple[tuple[float, int], Entry]] = []
        # size class -> heap of queued (not started) loads by (arrival, seq)
        self._classes: dict[int, list[tuple[tuple[float, int], Load]]] = {}
        self._cost: dict[int, float] = {}
        # Per class, a slot in two arrays: the arrival of its heap's head (inf: empty) and
        # its cost, so one vectorized pass finds the highest ratio.
        self._slot: dict[int, int] = {}
        self._slot_class: list[int] = []
        self._heads = np.full(16, np.inf)
        self._costs = np.ones(16)
        # every queued load by (arrival, seq), for the deadline; started or done: stale
        self._by_arrival: list[tuple[tuple[float, int], Load]] = []
        self._pending = 0  # requests waiting for a load

    # -- engine interface ---------------------------------------------------------------
    def submit(self, request: Request, now: float, view: MetadataView) -> None:
        entry = self._new_entry(request)
        meta = view.get(request.session)
        if not kv_needs_load(meta, view):
            self._push_ready(entry)
            return
        assert meta is not None
        load = self._join_load(entry, meta)
        if load is not None:
            cls = self._class_of(meta.nbytes)
            key = (load.arrival, load.seq)
            heap = self._classes.get(cls)
            if heap is None:
                heap = self._classes[cls] = []
                self._add_slot(cls)
            heapq.heappush(heap, (key, load))
            self._heads[self._slot[cls]] = heap[0][0][0]
            if self.max_wait is not None:
                heapq.heappush(self._by_arrival, (key, load))
        self._pending += 1

    def _next_load(self, now: float) -> Load | None:
        return self._pop_best(now)

    def load_finished(self, session: str, now: float, *, ok: bool = True) -> list[Request]:
        load = self._finish_load(session)
        if load is None:
            return []
        self._pending -= len(load.entries)
        for entry in load.entries:
            self._push_ready(entry)
        return [entry.request for entry in load.entries]

    def next_batch(
        self, now: float, token_budget: int, max_requests: int | None = None
    ) -> list[Request]:
        return self._take_batch(self._ready, token_budget, max_requests)

    def waiting(self, limit: int | None = None) -> list[str]:
        n = len(self) if limit is None else limit
        ready = heapq.nsmallest(n + self._stale, self._ready)
        sessions = [entry.request.session for _, entry in ready if not entry.cancelled][:n]
        if len(sessions) < n:
            # Then the preparing queue: loads in flight land first, then by arrival.
            pending = sorted(
                (not load.started, entry.key, entry.request.session)
                for load in self._loads.values()
                for entry in load.entries
            )
            sessions.extend(session for _, _, session in pending[: n - len(sessions)])
        return sessions

    def __len__(self) -> int:
        return len(self._ready) - self._stale + self._pending

    def _withdrawn(self, entry: Entry, *, waited: bool) -> None:
        if waited:  # it was in no heap, only counted
            self._pending -= 1
        else:
            super()._withdrawn(entry, waited=waited)

    # -- introspection ------------------------------------------------------------------
    def response_ratio(self, session: str, now: float) -> float | None:
        """The disk-HRRN ratio of ``session``'s queued load, or ``None`` if none is queued."""
        load = self._loads.get(session)
        if load is None or load.started:
            return None
        return 1.0 + (now - load.arrival) / self._cost[self._class_of(load.nbytes)]

    @property
    def loads_in_flight(self) -> int:
        """Loads started and not yet reported finished."""
        return self._in_flight

    # -- internals ----------------------------------------------------------------------
    def _class_of(self, nbytes: int) -> int:
        cls = math.floor(math.log2(max(nbytes, 1)) * self.classes_per_octave)
        if cls not in self._cost:
            size = 2.0 ** (cls / self.classes_per_octave)
            if self.bandwidth is None:
                self._cost[cls] = size
            else:
                self._cost[cls] = self.latency + size / self.bandwidth
            if self._cost[cls] <= 0:  # latency 0 and a tiny size: keep the ratio finite
                self._cost[cls] = 1e-12
        return cls

    def _pop_best(self, now: float) -> Load | None:
        if self.max_wait is not None:
            oldest = self._by_arrival
            while oldest and (oldest[0][1].started or oldest[0][1].done):
                heapq.heappop(oldest)
            if oldest and now - oldest[0][1].arrival >= self.max_wait:
                return heapq.heappop(oldest)[1]  # overdue (its class heap copy goes stale)
        classes = self._classes
        slot_class = self._slot_class
        while True:
            ratios = 1.0 + (now - self._heads) / self._costs  # -inf for an empty class
            i = int(ratios.argmax())
            best = ratios[i]
            if best == -math.inf:
                return None
            # Equal ratios: the earlier arrival wins, so ties never depend on slot order.
            tied = [i] if (ratios == best).sum() == 1 else np.flatnonzero(ratios == best).tolist()
            stale = False
            for slot in tied:
                head = classes[slot_class[slot]][0][1]
                if head.done or head.started:  # finished, or started as overdue
                    self._pop_head(slot)
                    stale = True
            if not stale:
                slot = min(tied, key=lambda s: classes[slot_class[s]][0][0])
                return self._pop_head(slot)

    def _add_slot(self, cls: int) -> None:
        slot = len(self._slot_class)
        if slot == len(self._heads):
            self._heads = np.concatenate([self._heads, np.full(slot, np.inf)])
            self._costs = np.concatenate([self._costs, np.ones(slot)])
        self._slot[cls] = slot
        self._slot_class.append(cls)
        self._costs[slot] = self._cost[cls]

    def _pop_head(self, slot: int) -> Load:
        heap = self._classes[self._slot_class[slot]]
        _, load = heapq.heappop(heap)
        self._heads[slot] = heap[0][0][0] if heap else np.inf
        return load

    def _push_ready(self, entry: Entry) -> None:
        heapq.heappush(self._ready, (entry.key, entry))
        self._ready_count[entry.request.session] += 1
