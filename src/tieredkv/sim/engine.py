"""The serving simulator: a discrete-event model of one GPU serving multi-turn chat over a
host-memory + SSD KV cache, driving the library's own policy objects under a virtual clock.

**What happens to one turn.** It *arrives* (at its trace time, but never before the same
user's previous turn has finished: a user cannot send a query before reading the answer)
and is submitted to the :class:`~tieredkv.policies.Scheduler`, which reads from the
:class:`~tieredkv.meta.MetadataChannel` where the conversation's history KV is. KV on SSD
needs a *load*: the scheduler says when to start it (``start_loads``), the SSD serves it
(one transfer at a time, reads and writes alike, at the SSD's bandwidth), and on landing
the KV needs room in host memory, which the :class:`~tieredkv.policies.Eviction` policy
makes (victims are written to SSD, or just dropped when an inclusive copy is there). The
engine then takes requests from the scheduler (``next_batch`` under a token budget) and
runs a *prefill* iteration (copying the history host -> GPU, or recomputing it when it is
stored nowhere), then *decode* iterations until the answer is complete. The new KV
(history + query + answer, capped at ``history_cap`` tokens) is *appended* to host memory.

**Speed.** Between two events (an arrival, a load landing, a request finishing) the
running batch is fixed, and a decode iteration's time grows linearly with the tokens held,
so a whole stretch of iterations is advanced in closed form (one event, not one per
token). An event that may let a new request run interrupts the stretch at the end of the
iteration in progress. Work per turn is a few heap operations plus the policies' own cost.

**The policies see exactly the live cache's protocol**: ``on_access`` at every load (the
prefill reading the history) and append, ``on_admit`` when a KV becomes resident or
grows, ``victims`` with the scheduler's ready sessions and the running ones protected (and
``view.waiting`` published when read), ``on_remove`` when a KV leaves host memory; Belady's
``next_access`` is filled in at each append from the trace.

``docs/explanation/simulator.md`` documents the model and every parameter.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Set
from typing import Literal

import numpy as np

from ..meta import MetadataChannel, TierInfo
from ..policies.base import Eviction, Foresight
from ..policies.registry import make_eviction
from ..policies.scheduling import Request, Scheduler
from .config import SimConfig, SimResult, measure
from .gpu import GPU
from .host import HOST, SSD, UNBOUNDED, DecisionView, HostMemory, Protected, Session
from .predict import Predictor
from .ssd import SSDQueue
from .systems import SystemSpec, build_scheduler
from .trace import Turns
from .writepath import write_path

__all__ = ["SimConfig", "SimResult", "Simulator", "simulate"]

_ARRIVAL, _LOAD, _GPU, _PREFETCH = 0, 1, 2, 3


class Simulator:
    """One simulation of ``system`` serving ``turns``; call :meth:`run` once.

    The event loop: turns arrive (their trace time, but never before the same user's
    previous turn has finished), SSD loads land, the GPU finishes a step, a predictive read
    lands. The models it drives: :class:`~tieredkv.sim.host.HostMemory` (residency and
    eviction), :class:`~tieredkv.sim.ssd.SSDQueue` (the device and its write buffer, with
    the system's :class:`~tieredkv.sim.writepath.WritePath`) and
    :class:`~tieredkv.sim.gpu.GPU` (batching and step times); the scheduler is the
    library's own, built through the policy registry.

    After :meth:`run`, per-turn arrays (indexed like ``turns``) are available:
    :attr:`arrival`, :attr:`start` (prefill start), :attr:`first_token`, :attr:`finish`,
    and :attr:`hit` (1 host hit, 0 miss, -1 no history or no cache; a turn whose KV was
    evicted while it queued and read back from SSD is a miss).

    :param turns: the workload (sorted by time)
    :param system: the serving system
    :param config: hardware and engine settings
    :param scheduler: a scheduler object to use instead of ``system.scheduler``
    :param eviction: an eviction object to use instead of ``system.eviction``
    :param progress: called with the fraction of turns finished, now and then
    """

    def __init__(
        self,
        turns: Turns,
        system: SystemSpec,
        config: SimConfig | None = None,
        *,
        scheduler: Scheduler | None = None,
        eviction: Eviction | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self.turns = turns
        self.system = system
        self.config = config = config if config is not None else SimConfig()
        self.cost = config.cost_model()
        model = self.cost.model
        codec: Literal["kv", "act"] = "act" if system.storage_efficient and model.mha else "kv"
        self.codec = codec
        self.bytes_per_token = model.stored_bytes_per_token(codec)
        self._reproject = model.reproject_flops_per_token  # a property: computed once
        if scheduler is None:
            scheduler = build_scheduler(
                system, ssd_latency=config.ssd_latency, ssd_bandwidth=config.ssd_gbps * 1e9
            )
        self.scheduler = scheduler
        self.eviction = (
            eviction
            if eviction is not None
            else make_eviction(system.eviction, **system.eviction_kwargs)
        )
        host_cap = UNBOUNDED if system.cache == "host-only" else int(config.host_gb * 1e9)
        self.host_capacity = host_cap
        self.channel = MetadataChannel()
        tiers = [TierInfo(name=HOST, level=0, capacity=host_cap)]
        if system.cache == "two-tier":
            tiers.append(TierInfo(name=SSD, level=1, capacity=UNBOUNDED))
        self.channel.set_tiers(tiers)
        self._progress = progress
        n = len(turns)
        self.arrival = np.full(n, np.nan)
        self.start = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.hit = np.full(n, -1, dtype=np.int8)
        self._ran = False

    # -- the run ------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Simulate every turn to completion and return the metrics.

        :raises RuntimeError: if called twice
        """
        if self._ran:
            raise RuntimeError("a Simulator runs once; make a new one")
        self._ran = True
        self._setup()
        events = self._events
        pop = heapq.heappop
        handlers = (self._on_arrival, self._on_load, self._gpu.step_done, self._on_prefetch)
        total = len(self.turns)
        tick = max(1, total // 100)
        next_tick = tick
        while events:
            now, _, kind, arg = pop(events)
            handlers[kind](arg, now)
            if self._progress is not None and self._done >= next_tick:
                self._progress(self._done / total)
                next_tick += tick
        if self._progress is not None:
            self._progress(1.0)
        return self._result()

    # -- setup --------------------------------------------------------------------------
    def _setup(self) -> None:
        t = self.turns
        cfg = self.config
        system = self.system
        cap = cfg.history_cap
        self._query = t.query.tolist()
        self._answer = np.maximum(t.answer, 1).tolist()
        after = t.context_after()
        before = after - t.query - t.answer
        self._hist_before = np.minimum(before, cap).tolist()
        self._hist_after = np.minimum(after, cap).tolist()
        self._time = t.time.tolist()
        self._next = t.next_index().tolist()
        uniq, user_idx = np.unique(t.user, return_inverse=True)
        self._user = user_idx.tolist()
        self._sess = [Session(f"u{u}") for u in uniq.tolist()]
        self._by_name = {s.name: i for i, s in enumerate(self._sess)}
        self._events: list[tuple[float, int, int, int]] = []
        self._seq = itertools.count()
        # the first turn of every user (later turns are pushed as the previous one ends)
        by_round = np.lexsort((t.time, t.round_index, t.user))
        users = t.user[by_round]
        starts = by_round[np.r_[True, users[1:] != users[:-1]]] if len(t) else by_round
        for row in sorted(starts.tolist()):
            self._push(self._time[row], _ARRIVAL, row)
        self._counted = [
            cfg.warmup <= tt and (cfg.until is None or tt <= cfg.until) for tt in self._time
        ]
        self._cached = system.cache != "none"
        self._pinned: dict[str, int] = {}
        ready: Set[str] = self.scheduler.ready_sessions() if system.protect_ready else set()
        self._protected = Protected(ready, self._pinned.keys())
        self._view = DecisionView(self.channel, self.scheduler, cfg.queue_window)
        self._ssd = SSDQueue(
            cfg.ssd_gbps * 1e9,
            cfg.ssd_latency,
            background=system.background_writes,
            buffer_bytes=cfg.write_buffer_gb * 1e9,
            cleaned=self._cleaned,
        )
        self._host = HostMemory(
            self.host_capacity,
            self.eviction,
            self.channel,
            codec=self.codec,
            bytes_per_token=self.bytes_per_token,
            write_path=write_path(
                inclusive=system.inclusive,
                keep_ssd_copy=system.keep_ssd_copy,
                clean_ahead=system.clean_ahead,
            ),
            ssd=self._ssd if system.cache == "two-tier" else None,
            view=self._view,
            protected=self._protected,
        )
        self._host.sessions.update((s.name, s) for s in self._sess)
        self._gpu = GPU(
            self,
            self.cost,
            need=[
                h + q + a
                for h, q, a in zip(self._hist_before, self._query, self._answer, strict=True)
            ],
            context=[h + q for h, q in zip(self._hist_before, self._query, strict=True)],
            answer=self._answer,
            first_token=self.first_token,
            push=self._push_gpu,
            token_budget=cfg.token_budget,
            max_seqs=cfg.max_seqs,
            layerwise_overlap=system.layerwise_overlap,
            blocking_loads=system.blocking_loads,
        )
        self._recomputed = 0
        self._direct_loads = 0
        self._fetching: set[int] = set()  # users whose KV the engine itself is loading
        self._loads = 0  # SSD loads in flight
        self._predictor: Predictor | None = None
        if system.predictive_prefetch and isinstance(self.eviction, Foresight):
            self._predictor = Predictor(
                self.eviction,
                self.eviction.foresee,
                self.scheduler,
                self._host,
                self._ssd,
                self._sess,
                self._by_name,
                self._pinned,
                self._view,
                self._protected,
                self._read_ahead,
            )
        self._done = 0
        self._accesses = 0
        self._hits = 0
        self._load_times: list[float] = []
        self._first_arrival = self._time[0] if self._time else 0.0
        self._last_finish = self._first_arrival

    def _push(self, when: float, kind: int, arg: int) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, arg))

    def _push_gpu(self, when: float, gen: int) -> None:
        heapq.heappush(self._events, (when, next(self._seq), _GPU, gen))

    def _cleaned(self, s: Session, when: float) -> None:
        self._host.cleaned(s, when)

    # -- events -------------------------------------------------------------------------
    def _on_arrival(self, row: int, now: float) -> None:
        self.arrival[row] = now
        s = self._sess[self._user[row]]
        hist = self._hist_before[row]
        tokens = self._query[row]
        if not self._cached:
            tokens += hist
        elif hist > 0:
            if self._counted[row]:
                self._accesses += 1
                if s.in_host:
                    self._hits += 1
            self.hit[row] = 1 if s.in_host else 0
            if not s.in_host and not s.on_ssd:
                tokens += hist
        request = Request(id=str(row), session=s.name, arrival=now, tokens=tokens)
        self.scheduler.submit(request, now, self.channel)
        if self._predictor is not None:
            self._predictor.arrived(self._user[row])
        self._start_loads(now)
        self._gpu.poke(now)
        self._predict(now)

    def _start_loads(self, now: float) -> None:
        for request in self.scheduler.start_loads(now):
            user = self._by_name[request.session]
            s = self._sess[user]
            self._loads += 1
            if s.in_host:  # brought up by a predictive prefetch meanwhile: nothing to read
                self._push(now, _LOAD, user)
                continue
            self._push(self._ssd.read(now, s.nbytes), _LOAD, user)

    def _predict(self, now: float) -> None:
        if self._predictor is not None:
            self._predictor.consider(now, self._loads)

    def _read_ahead(self, user: int, now: float) -> None:
        """A predictive read of ``user``'s KV starts at ``now`` (the SSD is idle)."""
        self._push(self._ssd.read(now, self._sess[user].nbytes), _PREFETCH, user)

    def _on_prefetch(self, user: int, now: float) -> None:
        assert self._predictor is not None
        self._predictor.landed(user, now)
        self._start_loads(now)
        self._gpu.poke(now)
        self._predict(now)

    def _on_load(self, user: int, now: float) -> None:
        s = self._sess[user]
        fetched = user in self._fetching  # a handed-out request waits for this load
        self._fetching.discard(user)
        self._loads -= 1
        if s.on_ssd and not s.in_host and self._host.reserve(s.nbytes, now):
            self._host.loaded(s, now)
        elif not s.in_host:
            # No room in host memory (it is full of KV that queued or running requests
            # need): the KV streams from SSD to the GPU through a staging buffer instead.
            s.staged = True
            self._direct_loads += 1
        self.scheduler.load_finished(s.name, now, ok=True)
        self._start_loads(now)
        if fetched:
            self._gpu.fetched(now)  # the request it waited for may run at the next iteration
        self._gpu.poke(now)
        self._predict(now)

    # -- what the GPU asks (gpu.Engine) ---------------------------------------------------
    def hand_out(self, now: float, free: int) -> list[int]:
        """Rows the scheduler hands out now (pinned while they run); an on-demand
        scheduler asks for its head's KV now."""
        rows: list[int] = []
        pinned = self._pinned
        for request in self.scheduler.next_batch(now, self.config.token_budget, free):
            rows.append(int(request.id))
            name = request.session
            pinned[name] = pinned.get(name, 0) + 1
        self._start_loads(now)
        return rows

    def admit(self, row: int, now: float) -> int | None:
        """Tokens ``row``'s prefill computes, or ``None`` while its KV is fetched."""
        hist: int = self._hist_before[row]
        new: int = self._query[row]
        sess = self._sess[self._user[row]]
        cached = self._cached
        if cached and hist > 0 and not (sess.in_host or sess.staged) and sess.on_ssd:
            # Handed out, but its KV was evicted since it queued (nothing protected it):
            # the engine loads it from SSD on the spot, and the row waits for it.
            self._fetch(sess, row, now)
            return None
        if not (cached and (sess.in_host or sess.staged)):
            new += hist
        return new

    def prefill(self, row: int, now: float) -> tuple[int, int, int, float]:
        """``row``'s prefill starts: its history is copied from host memory (an access), or
        recomputed."""
        self.start[row] = now
        s = self._sess[self._user[row]]
        hist = self._hist_before[row]
        new = self._query[row]
        cached = copied = 0
        extra = 0.0
        if hist > 0:
            if self._cached and (s.in_host or s.staged):
                s.staged = False
                cached = hist
                copied = s.nbytes
                if self.codec == "act":
                    extra = hist * self._reproject
                self._host.read(s, now)
                if self.hit[row] >= 0 and self._counted[row]:
                    self._record_load_time(s.nbytes, bool(self.hit[row]))
            else:
                new += hist
                self._recomputed += hist
        return new, cached, copied, extra

    def complete(self, row: int, now: float) -> None:
        """A turn ends: its KV is appended, its user's next turn may arrive."""
        self.finish[row] = now
        self._last_finish = now
        self._done += 1
        s = self._sess[self._user[row]]
        if self._cached:
            nxt = self._next[row]
            next_access = None
            if nxt >= 0:
                t = self._time[nxt]
                next_access = t if t > now else now
            self._host.append(
                s,
                self._hist_after[row],
                self._query[row] + self._answer[row],
                self._answer[row],
                next_access,
                now,
            )
        left = self._pinned[s.name] - 1
        if left:
            self._pinned[s.name] = left
        else:
            del self._pinned[s.name]
        nxt = self._next[row]
        if nxt >= 0:
            t = self._time[nxt]
            self._push(t if t > now else now, _ARRIVAL, nxt)

    def queued(self) -> bool:
        """Requests wait in the scheduler."""
        return len(self.scheduler) > 0

    def _fetch(self, s: Session, row: int, now: float) -> None:
        """Load ``s``'s KV from SSD for the handed-out request ``row`` (once; it lands as
        any load). The turn found its KV in host memory when it arrived, but reads it
        from SSD: it counts as a miss."""
        user = self._by_name[s.name]
        if user in self._fetching:
            return
        if self.hit[row] == 1:
            self.hit[row] = 0
            if self._counted[row]:
                self._hits -= 1
        self._fetching.add(user)
        self._loads += 1
        self._push(self._ssd.read(now, s.nbytes), _LOAD, user)

    def _record_load_time(self, nbytes: int, hit: bool) -> None:
        t = self.cost.link_time(nbytes)
        if not hit:
            t += self.config.ssd_latency + nbytes / (self.config.ssd_gbps * 1e9)
        self._load_times.append(t)

    # -- results ------------------------------------------------------------------------
    def _result(self) -> SimResult:
        return measure(
            self.system.name,
            np.asarray(self._counted, dtype=bool),
            arrival=self.arrival,
            start=self.start,
            first_token=self.first_token,
            finish=self.finish,
            load_times=self._load_times,
            span=(self._first_arrival, self._last_finish),
            users=len(self._sess),
            accesses=self._accesses,
            host_hits=self._hits,
            ssd_read_bytes=self._ssd.read_bytes,
            ssd_write_bytes=self._ssd.written_bytes,
            recomputed_tokens=self._recomputed,
            gpu_seconds=self._gpu.busy,
            evictions=self._host.evictions,
            direct_loads=self._direct_loads,
            predicted=self._predictor.predicted if self._predictor is not None else 0,
        )


def simulate(
    turns: Turns,
    system: SystemSpec,
    config: SimConfig | None = None,
    *,
    progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Run one simulation: ``Simulator(turns, system, config).run()``."""
    return Simulator(turns, system, config, progress=progress).run()
