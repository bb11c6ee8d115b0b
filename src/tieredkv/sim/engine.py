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
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Set
from typing import Literal, TypeVar

import msgspec
import numpy as np

from ..meta import KVMeta, MetadataChannel, TierInfo, advance_meta
from ..policies.base import Eviction, Foresight
from ..policies.prefetch import pick
from ..policies.registry import make_eviction, make_scheduler
from ..policies.scheduling import Request, Scheduler
from .costmodel import CostModel, get_gpu, get_model
from .systems import LookAheadFCFS, SystemSpec
from .trace import Turns

__all__ = ["SimConfig", "SimResult", "Simulator", "simulate"]

_S = TypeVar("_S")
_HOST = "host"
_SSD = "ssd"
_UNBOUNDED = 1 << 62
_ARRIVAL, _LOAD, _GPU, _PREFETCH = 0, 1, 2, 3
_PREDICT_SCAN = 256
"""Most recently active users a predictive prefetch considers."""
_IDLE, _PREFILL, _DECODE = 0, 1, 2


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Hardware, model and engine settings of a simulation.

    :param model: model preset (:data:`~tieredkv.sim.costmodel.MODELS`)
    :param gpu: GPU preset (:data:`~tieredkv.sim.costmodel.GPUS`)
    :param host_gb: host memory for history KV, 10^9 bytes
    :param ssd_gbps: SSD bandwidth, 10^9 bytes/s (reads and writes share it)
    :param ssd_latency: fixed seconds per SSD transfer
    :param history_cap: history tokens kept per conversation at most (the paper: 2048)
    :param token_budget: tokens one prefill iteration computes at most
    :param max_seqs: requests in the running batch at most
    :param mfu: fraction of the GPU's tensor peak a prefill reaches (0.35: fitted, with
        ``hbm_efficiency``, to the paper's supported rates; :mod:`tieredkv.sim.calibration`)
    :param hbm_efficiency: fraction of HBM bandwidth a decode iteration reaches (0.65: fitted)
    :param link_efficiency: fraction of the PCIe spec a host -> GPU copy reaches
    :param gpu_memory_utilization: fraction of GPU memory for weights and K/V
    :param iteration_overhead: fixed seconds per engine iteration
    :param queue_window: scheduler queue length published on the channel (``view.waiting``)
    :param write_buffer_gb: host memory buffering asynchronous SSD writes, 10^9 bytes
        (systems with ``background_writes``): writes beyond it wait in line with the loads
    :param warmup: turns whose trace time is earlier are run but not counted
    :param until: turns whose trace time is later are run but not counted (``None``: all)
    """

    model: str = "opt-13b"
    gpu: str = "a800"
    host_gb: float = 200.0
    ssd_gbps: float = 1.5
    ssd_latency: float = 0.0
    history_cap: int = 2048
    token_budget: int = 8192
    max_seqs: int = 256
    mfu: float = 0.35
    hbm_efficiency: float = 0.65
    link_efficiency: float = 0.8
    gpu_memory_utilization: float = 0.9
    iteration_overhead: float = 0.002
    queue_window: int = 30
    write_buffer_gb: float = 4.0
    warmup: float = 0.0
    until: float | None = None

    def __post_init__(self) -> None:
        if self.host_gb <= 0 or self.ssd_gbps <= 0 or self.ssd_latency < 0:
            raise ValueError("host_gb and ssd_gbps must be positive, ssd_latency >= 0")
        if self.write_buffer_gb < 0:
            raise ValueError(f"write_buffer_gb must be >= 0 (got {self.write_buffer_gb})")
        if self.history_cap < 1 or self.token_budget < 1 or self.max_seqs < 1:
            raise ValueError("history_cap, token_budget and max_seqs must be >= 1")

    def cost_model(self) -> CostModel:
        """The :class:`~tieredkv.sim.costmodel.CostModel` these settings describe."""
        return CostModel(
            get_model(self.model),
            get_gpu(self.gpu),
            mfu=self.mfu,
            hbm_efficiency=self.hbm_efficiency,
            link_efficiency=self.link_efficiency,
            gpu_memory_utilization=self.gpu_memory_utilization,
            iteration_overhead=self.iteration_overhead,
        )


class SimResult(msgspec.Struct, frozen=True, kw_only=True):
    """Metrics of one simulation (times in seconds; counted turns only).

    :param system: the system's name
    :param turns: turns counted
    :param users: distinct users simulated
    :param latency_mean: response latency (arrival to last token), mean
    :param latency_p50: its median
    :param latency_p90: its 90th percentile
    :param latency_p95: its 95th percentile
    :param latency_p99: its 99th percentile
    :param queueing_mean: arrival to the start of the turn's prefill, mean
    :param queueing_p90: its 90th percentile
    :param ttft_mean: time to first token, mean
    :param ttft_p99: its 99th percentile
    :param accesses: counted turns with history (each reads its history KV)
    :param host_hits: of those, the ones whose KV was in host memory at arrival and was
        read from there (a KV evicted while its turn queued, and read back from SSD when
        the turn ran, is a miss)
    :param ssd_read_bytes: bytes loaded from SSD (whole run)
    :param ssd_write_bytes: bytes written to SSD (whole run)
    :param recomputed_tokens: history tokens recomputed instead of loaded (whole run)
    :param gpu_busy: fraction of the run (first arrival to last token) the GPU computed
    :param makespan: first arrival to last token
    :param load_time_cv: coefficient of variation of the KV load time of the accesses
        (host hit: PCIe; miss: SSD then PCIe)
    :param evictions: sessions moved out of host memory to make room
    :param direct_loads: SSD loads that found no room in host memory (the KV went from SSD
        to the GPU through a staging buffer, and was not admitted to host memory)
    :param predicted: sessions brought into host memory by predictive prefetch
    """

    system: str
    turns: int
    users: int
    latency_mean: float
    latency_p50: float
    latency_p90: float
    latency_p95: float
    latency_p99: float
    queueing_mean: float
    queueing_p90: float
    ttft_mean: float
    ttft_p99: float
    accesses: int
    host_hits: int
    ssd_read_bytes: int
    ssd_write_bytes: int
    recomputed_tokens: int
    gpu_busy: float
    makespan: float
    load_time_cv: float
    evictions: int
    direct_loads: int
    predicted: int = 0

    @property
    def host_hit_ratio(self) -> float:
        """Host hits over accesses (0 when no access was counted)."""
        return self.host_hits / self.accesses if self.accesses else 0.0


class _Sess:
    __slots__ = (
        "dirty",
        "gen",
        "in_host",
        "name",
        "nbytes",
        "on_ssd",
        "staged",
        "tokens",
        "turns",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.in_host = False
        self.staged = False  # read from SSD without room in host: goes straight to the GPU
        self.on_ssd = False  # a complete copy is on SSD
        self.dirty = 0  # bytes a move to SSD must write (all of them if no copy is there)
        self.gen = 0  # advances whenever the SSD copy becomes complete
        self.nbytes = 0
        self.tokens = 0
        self.turns = 0


class _Protected(Set[str]):
    """The scheduler's ready sessions plus the engine's running ones, without copying."""

    __slots__ = ("_a", "_b")

    def __init__(self, a: Set[str], b: Set[str]) -> None:
        self._a = a
        self._b = b

    def __contains__(self, item: object) -> bool:
        return item in self._a or item in self._b

    def __iter__(self) -> Iterator[str]:
        yield from self._a
        for s in self._b:
            if s not in self._a:
                yield s

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _from_iterable(cls, it: Iterable[_S]) -> frozenset[_S]:
        # set operators (``protected | more``) build a plain frozenset
        return frozenset(it)


class _DecisionView:
    """The channel as one ``victims`` call sees it, with the scheduler's queue published
    on first read: computing it costs O(queue), and only queue-aware policies read it."""

    __slots__ = ("_channel", "_scheduler", "_window")

    def __init__(self, channel: MetadataChannel, scheduler: Scheduler, window: int) -> None:
        self._channel = channel
        self._scheduler = scheduler
        self._window = window

    def get(self, session: str) -> KVMeta | None:
        return self._channel.get(session)

    @property
    def tiers(self) -> tuple[TierInfo, ...]:
        return self._channel.tiers

    @property
    def waiting(self) -> tuple[str, ...]:
        self._channel.publish_waiting(self._scheduler.waiting(self._window))
        return self._channel.waiting


class Simulator:
    """One simulation of ``system`` serving ``turns``; call :meth:`run` once.

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
        ssd_bw = config.ssd_gbps * 1e9
        if scheduler is None and system.prefetch_window is not None:
            if system.scheduler.strip().lower() != "fcfs":
                raise ValueError(
                    f"prefetch_window applies to the fcfs scheduler (got {system.scheduler!r})"
                )
            scheduler = LookAheadFCFS(system.max_loads, window=system.prefetch_window)
        if scheduler is None:
            kwargs: dict[str, object] = {"max_loads": system.max_loads}
            if system.scheduler.strip().lower() == "fcfs" and not system.prefetch:
                kwargs["prefetch"] = False
            if system.scheduler.strip().lower() == "bidaw":
                kwargs["latency"] = config.ssd_latency
                if system.hrrn_by_time:
                    kwargs["bandwidth"] = ssd_bw
            scheduler = make_scheduler(system.scheduler, **kwargs)
        self.scheduler = scheduler
        self.eviction = (
            eviction
            if eviction is not None
            else make_eviction(system.eviction, **system.eviction_kwargs)
        )
        host_cap = _UNBOUNDED if system.cache == "host-only" else int(config.host_gb * 1e9)
        self.host_capacity = host_cap
        self.channel = MetadataChannel()
        tiers = [TierInfo(name=_HOST, level=0, capacity=host_cap)]
        if system.cache == "two-tier":
            tiers.append(TierInfo(name=_SSD, level=1, capacity=_UNBOUNDED))
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
        handlers = (self._on_arrival, self._on_load, self._on_gpu, self._on_prefetch)
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
        cap = self.config.history_cap
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
        self._sess = [_Sess(f"u{u}") for u in uniq.tolist()]
        self._by_name = {s.name: i for i, s in enumerate(self._sess)}
        self._events: list[tuple[float, int, int, int]] = []
        self._seq = itertools.count()
        # the first turn of every user (later turns are pushed as the previous one ends)
        by_round = np.lexsort((t.time, t.round_index, t.user))
        users = t.user[by_round]
        starts = by_round[np.r_[True, users[1:] != users[:-1]]] if len(t) else by_round
        for row in sorted(starts.tolist()):
            self._push(self._time[row], _ARRIVAL, row)
        cfg = self.config
        self._counted = [
            cfg.warmup <= tt and (cfg.until is None or tt <= cfg.until) for tt in self._time
        ]
        self._pinned: dict[str, int] = {}
        ready: Set[str] = self.scheduler.ready_sessions() if self.system.protect_ready else set()
        self._protected = _Protected(ready, self._pinned.keys())
        self._view = _DecisionView(self.channel, self.scheduler, self.config.queue_window)
        self._host_used = 0
        self._ssd_free = 0.0  # when the SSD finishes the transfers queued in line
        self._ssd_bps = cfg.ssd_gbps * 1e9
        self._background = self.system.background_writes
        self._write_buffer = cfg.write_buffer_gb * 1e9
        self._backlog = 0.0  # bytes of asynchronous writes not yet on SSD
        self._backlog_clock = 0.0  # backlog drained up to this time
        # clean_ahead: (user, gen, bytes) of new segments to write while the SSD idles
        self._ahead: deque[tuple[int, int, float]] = deque()
        self._ssd_read = 0
        self._ssd_written = 0
        self._recomputed = 0
        self._evictions = 0
        self._direct_loads = 0
        self._fetching: set[int] = set()  # users whose KV the engine itself is loading
        self._loads = 0  # SSD loads in flight
        self._predictive = self.system.predictive_prefetch and isinstance(self.eviction, Foresight)
        self._recent: OrderedDict[int, None] = OrderedDict()  # users, least recent first
        self._predicting = False  # a predictive read in flight
        self._predicted = 0
        self._done = 0
        self._accesses = 0
        self._hits = 0
        self._load_times: list[float] = []
        # GPU state
        self._phase = _IDLE
        self._gen = 0
        self._busy = 0.0
        self._admit: list[int] = []  # rows handed out, waiting for GPU memory
        self._admit_head = 0
        self._gpu_tokens = 0
        self._prefill_rows: list[int] = []
        self._phase_start = 0.0
        # running batch: heap of (end_iteration, row); iteration counter G; sum A
        self._running: list[tuple[int, int]] = []
        self._ctx0: dict[int, int] = {}  # row -> (context at admission - G at admission)
        self._iter = 0
        self._a = 0
        self._seg_m = 0
        self._seg_interrupted = False
        self._first_arrival = self._time[0] if self._time else 0.0
        self._last_finish = self._first_arrival

    def _push(self, when: float, kind: int, arg: int) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, arg))

    # -- events -------------------------------------------------------------------------
    def _on_arrival(self, row: int, now: float) -> None:
        self.arrival[row] = now
        s = self._sess[self._user[row]]
        hist = self._hist_before[row]
        cache = self.system.cache
        tokens = self._query[row]
        if cache == "none":
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
        if self._predictive:
            user = self._user[row]
            self._recent[user] = None
            self._recent.move_to_end(user)
        self._start_loads(now)
        self._poke(now)
        self._predict(now)

    def _start_loads(self, now: float) -> None:
        for request in self.scheduler.start_loads(now):
            s = self._sess[self._by_name[request.session]]
            self._loads += 1
            if s.in_host:  # brought up by a predictive prefetch meanwhile: nothing to read
                self._push(now, _LOAD, self._by_name[request.session])
                continue
            end = self._ssd_in_line(now, s.nbytes)
            self._ssd_read += s.nbytes
            self._push(end, _LOAD, self._by_name[request.session])

    def _predict(self, now: float) -> None:
        """Predictive prefetch: while the SSD idles, read up the SSD-resident session the
        eviction policy gives the best chance of a hit (of equal chances, the one whose user
        has been gone longest: the one due first), if that chance beats what the residents
        it would displace are worth (one read at a time)."""
        if not self._predictive or self._predicting or self._loads or self._ssd_free > now:
            return
        if self.scheduler.waiting(1):
            return  # requests are queued: an arriving one's load must not wait behind a guess
        if self._background:
            self._drain(now)
            if self._backlog > 0 or self._ahead:
                return  # the idle SSD is writing back first
        policy = self.eviction
        assert isinstance(policy, Foresight)
        recent = [
            (
                s.name,
                s.nbytes,
                s.nbytes > 0 and not s.in_host and s.on_ssd and s.name not in self._pinned,
            )
            for user in itertools.islice(reversed(self._recent), _PREDICT_SCAN)
            for s in [self._sess[user]]
        ]
        chosen = pick(
            policy,
            policy.foresee,
            recent,
            self.host_capacity - self._host_used,
            now,
            self._view,
            self._protected,
            _PREDICT_SCAN,
        )
        if chosen is not None:
            user = self._by_name[chosen[0]]
            s = self._sess[user]
            self._predicting = True
            self._ssd_read += s.nbytes
            self._push(self._ssd_in_line(now, s.nbytes), _PREFETCH, user)

    def _on_prefetch(self, user: int, now: float) -> None:
        self._predicting = False
        s = self._sess[user]
        if s.on_ssd and not s.in_host and self._reserve(s.nbytes, now):
            self._admit_from_ssd(s, now)
            self._predicted += 1
        self._start_loads(now)
        self._poke(now)
        self._predict(now)

    def _admit_from_ssd(self, s: _Sess, now: float) -> None:
        """``s`` was read into host memory (room already taken): it is resident there."""
        s.in_host = True
        if not (self.system.inclusive or self.system.keep_ssd_copy):
            s.on_ssd = False  # exclusive: the SSD copy is deleted
            s.dirty = s.nbytes
        meta = self._publish(s, now)
        self.eviction.on_admit(s.name, meta, now)

    def _ssd_in_line(self, now: float, nbytes: float) -> float:
        """Queue a transfer behind the SSD's previous ones; returns when it ends."""
        if self._background:
            self._drain(now)
        start = now if now > self._ssd_free else self._ssd_free
        end = start + self.config.ssd_latency + nbytes / self._ssd_bps
        self._ssd_free = end
        return end

    def _drain(self, now: float) -> None:
        """Write the asynchronous backlog during the SSD's idle time up to ``now``; with
        ``clean_ahead``, the idle time left writes queued new segments (oldest first)."""
        idle_from = max(self._backlog_clock, self._ssd_free)
        self._backlog_clock = now
        if now <= idle_from:
            return
        idle = (now - idle_from) * self._ssd_bps  # bytes the idle SSD could write
        used = min(idle, self._backlog)
        self._backlog -= used
        idle -= used
        ahead = self._ahead
        while ahead and idle > 0:
            user, gen, left = ahead[0]
            s = self._sess[user]
            if gen != s.gen or s.dirty <= 0:
                ahead.popleft()  # written by an eviction meanwhile
                continue
            done = min(left, idle, s.dirty)
            idle -= done
            self._ssd_written += int(done)
            s.dirty -= int(done)
            if s.dirty <= 0 or done >= left:
                ahead.popleft()
            else:
                ahead[0] = (user, gen, left - done)
            if s.dirty <= 0:
                s.dirty = 0
                s.on_ssd = True
                s.gen += 1
                if s.in_host:
                    self._publish(s, self._backlog_clock)

    def _ssd_write(self, now: float, nbytes: int) -> None:
        """Write ``nbytes`` to SSD: in line with the loads, or (``background_writes``)
        through the write buffer, in line only for what overflows it."""
        self._ssd_written += nbytes
        if not self._background:
            self._ssd_in_line(now, nbytes)
            return
        self._drain(now)
        self._backlog += nbytes
        over = self._backlog - self._write_buffer
        if over > 0:
            self._backlog = self._write_buffer
            self._ssd_in_line(now, over)

    def _on_load(self, user: int, now: float) -> None:
        s = self._sess[user]
        fetched = user in self._fetching  # a handed-out request waits for this load
        self._fetching.discard(user)
        self._loads -= 1
        ok = s.on_ssd and not s.in_host and self._reserve(s.nbytes, now)
        if ok:
            self._admit_from_ssd(s, now)
        elif not s.in_host:
            # No room in host memory (it is full of KV that queued or running requests
            # need): the KV streams from SSD to the GPU through a staging buffer instead.
            s.staged = True
            self._direct_loads += 1
        self.scheduler.load_finished(s.name, now, ok=True)
        self._start_loads(now)
        if fetched and self._phase == _DECODE and not self._seg_interrupted:
            self._interrupt(now)  # the request it waited for may run at the next iteration
        self._poke(now)
        self._predict(now)

    def _on_gpu(self, gen: int, now: float) -> None:
        if gen != self._gen:
            return  # superseded by an interruption
        self._busy += now - self._phase_start
        if self._phase == _PREFILL:
            it = self._iter
            for row in self._prefill_rows:
                self.first_token[row] = now
                answer = self._answer[row]
                if answer <= 1:
                    self._complete(row, now)
                    continue
                ctx = self._hist_before[row] + self._query[row] + 1
                heapq.heappush(self._running, (it + answer - 1, row))
                self._ctx0[row] = ctx - it
                self._a += ctx - it
            self._prefill_rows = []
        elif self._phase == _DECODE:
            self._iter += self._seg_m
            running = self._running
            while running and running[0][0] <= self._iter:
                _, row = heapq.heappop(running)
                self._a -= self._ctx0.pop(row)
                self._complete(row, now)
        self._phase = _IDLE
        self._schedule(now)

    # -- the GPU ------------------------------------------------------------------------
    def _poke(self, now: float) -> None:
        """Something may have become ready: let the GPU pick it up at the next boundary."""
        if self._phase == _IDLE:
            self._schedule(now)
        elif (
            self._phase == _DECODE
            and not self._seg_interrupted
            and self._admit_head >= len(self._admit)
            and len(self._running) < self.config.max_seqs
        ):
            self._interrupt(now)

    def _schedule(self, now: float) -> None:
        cfg = self.config
        if self._admit_head >= len(self._admit):
            self._admit = []
            self._admit_head = 0
            free = cfg.max_seqs - len(self._running)
            if free > 0:
                for request in self.scheduler.next_batch(now, cfg.token_budget, free):
                    row = int(request.id)
                    self._admit.append(row)
                    name = request.session
                    self._pinned[name] = self._pinned.get(name, 0) + 1
                self._start_loads(now)  # an on-demand scheduler asks for its head's KV now
        batch: list[int] = []
        tokens = 0
        fetching = False
        capacity = self.cost.gpu_kv_tokens
        cached = self.system.cache != "none"
        while self._admit_head < len(self._admit):
            row = self._admit[self._admit_head]
            hist = self._hist_before[row]
            need = hist + self._query[row] + self._answer[row]
            new = self._query[row]
            sess = self._sess[self._user[row]]
            if cached and hist > 0 and not (sess.in_host or sess.staged) and sess.on_ssd:
                # Handed out, but its KV was evicted since it queued (nothing protected it):
                # the engine loads it from SSD on the spot, and the row waits for it.
                self._fetch(sess, row, now)
                fetching = True
                break
            if not (cached and (sess.in_host or sess.staged)):
                new += hist
            fits = self._gpu_tokens + need <= capacity or (not self._running and not batch)
            if not fits or (batch and tokens + new > cfg.token_budget):
                break
            self._admit_head += 1
            self._gpu_tokens += need
            tokens += new
            batch.append(row)
        if batch:
            self._prefill(batch, now)
        elif self._running and not (self.system.blocking_loads and self._stalled(fetching)):
            self._decode(now)

    def _stalled(self, fetching: bool) -> bool:
        """Whether the request to run next waits for a load although the batch has room:
        the engine is fetching a handed-out request's KV, or the scheduler holds its head
        back for a load. An engine with ``blocking_loads`` then waits, GPU idle."""
        return fetching or (
            self._admit_head >= len(self._admit)
            and len(self._running) < self.config.max_seqs
            and len(self.scheduler) > 0
        )

    def _fetch(self, s: _Sess, row: int, now: float) -> None:
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
        self._ssd_read += s.nbytes
        self._push(self._ssd_in_line(now, s.nbytes), _LOAD, user)

    def _prefill(self, rows: list[int], now: float) -> None:
        cost = self.cost
        cache = self.system.cache
        flops = 0.0
        link_bytes = 0
        reproject = self.codec == "act"
        for row in rows:
            self.start[row] = now
            s = self._sess[self._user[row]]
            hist = self._hist_before[row]
            new = self._query[row]
            cached = 0
            if hist > 0:
                if cache != "none" and (s.in_host or s.staged):
                    s.staged = False
                    cached = hist
                    link_bytes += s.nbytes
                    if reproject:
                        flops += hist * self._reproject
                    self.eviction.on_access(s.name, self._publish(s, now, access=True), now)
                    if self.hit[row] >= 0 and self._counted[row]:
                        self._record_load_time(s.nbytes, bool(self.hit[row]))
                else:
                    new += hist
                    self._recomputed += hist
            flops += cost.prefill_flops(new, cached)
        compute = cost.compute_time(flops)
        link = cost.link_time(link_bytes)
        duration = max(compute, link) if self.system.layerwise_overlap else compute + link
        duration += cost.iteration_overhead
        self._prefill_rows = rows
        self._begin(_PREFILL, now, now + duration)

    def _record_load_time(self, nbytes: int, hit: bool) -> None:
        t = self.cost.link_time(nbytes)
        if not hit:
            t += self.config.ssd_latency + nbytes / (self.config.ssd_gbps * 1e9)
        self._load_times.append(t)

    def _begin(self, phase: int, now: float, end: float) -> None:
        self._phase = phase
        self._phase_start = now
        self._gen += 1
        self._push(end, _GPU, self._gen)

    def _seg_time(self, m: int) -> float:
        """Seconds for the next ``m`` decode iterations of the current batch."""
        if m <= 0:
            return 0.0
        cost = self.cost
        n = len(self._running)
        k = cost.kv_token_s
        mem0 = cost.weights_s + k * (self._a + n * self._iter)
        step = k * n
        comp = cost.decode_compute_s(n)
        total = m * cost.iteration_overhead
        j = 0
        if comp > mem0:  # the first iterations are compute-bound
            j = min(m, int(-(-(comp - mem0) // step)) if step > 0 else m)
            total += j * comp
        if j < m:
            cnt = m - j
            first = mem0 + step * j
            total += cnt * first + step * cnt * (cnt - 1) / 2
        return total

    def _decode(self, now: float) -> None:
        m = self._running[0][0] - self._iter
        self._seg_m = m
        self._seg_interrupted = False
        self._begin(_DECODE, now, now + self._seg_time(m))

    def _interrupt(self, now: float) -> None:
        elapsed = now - self._phase_start
        lo, hi = 0, self._seg_m  # largest m with seg_time(m) <= elapsed
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._seg_time(mid) <= elapsed:
                lo = mid
            else:
                hi = mid - 1
        m = lo + 1
        self._seg_interrupted = True
        if m >= self._seg_m:
            return
        self._seg_m = m
        self._gen += 1
        self._push(self._phase_start + self._seg_time(m), _GPU, self._gen)

    # -- a turn ends: append its KV -----------------------------------------------------
    def _complete(self, row: int, now: float) -> None:
        self.finish[row] = now
        self._last_finish = now
        self._done += 1
        s = self._sess[self._user[row]]
        self._gpu_tokens -= self._hist_before[row] + self._query[row] + self._answer[row]
        cache = self.system.cache
        if cache != "none":
            self._append(s, row, now)
        left = self._pinned[s.name] - 1
        if left:
            self._pinned[s.name] = left
        else:
            del self._pinned[s.name]
        nxt = self._next[row]
        if nxt >= 0:
            t = self._time[nxt]
            self._push(t if t > now else now, _ARRIVAL, nxt)

    def _append(self, s: _Sess, row: int, now: float) -> None:
        tokens = self._hist_after[row]
        nbytes = tokens * self.bytes_per_token
        old = s.nbytes if s.in_host else 0
        if self.system.cache == "host-only":
            self._host_used += nbytes - old
            s.in_host = True
        else:
            segment = min((self._query[row] + self._answer[row]) * self.bytes_per_token, nbytes)
            if self.system.inclusive:
                self._ssd_write(now, segment)
                s.on_ssd = True
            else:
                # The SSD copy (if any) is now incomplete. Exclusive: rewritten whole when
                # the KV moves down; keep_ssd_copy: its segments stay, only new ones go.
                s.on_ssd = False
                s.dirty = min(s.dirty + segment, nbytes) if self.system.keep_ssd_copy else nbytes
                if self.system.clean_ahead:
                    self._ahead.append((self._user[row], s.gen, float(s.dirty)))
            if self._reserve(nbytes - old, now):
                s.in_host = True
            else:
                if s.in_host:
                    s.in_host = False
                    self._host_used -= old
                    self.eviction.on_remove(s.name)
                if not self.system.inclusive:
                    self._ssd_write(now, s.dirty)
                    s.dirty = 0
                    s.gen += 1
                    s.on_ssd = True
        s.nbytes = nbytes
        s.tokens = tokens
        s.turns += 1
        nxt = self._next[row]
        next_access = None
        if nxt >= 0:
            t = self._time[nxt]
            next_access = t if t > now else now
        meta = self._publish(s, now, access=True, answer=self._answer[row], next_access=next_access)
        self.eviction.on_access(s.name, meta, now)
        if s.in_host:
            self.eviction.on_admit(s.name, meta, now)

    def _reserve(self, need: int, now: float) -> bool:
        """Make ``need`` bytes of host memory available (evicting) and take them."""
        free = self.host_capacity - self._host_used
        if need <= free:
            self._host_used += need
            return True
        if self._ahead:
            self._drain(now)  # segments written while the SSD idled need no write now
        victims = self.eviction.victims(need - free, now, self._view, self._protected)
        if victims is None:
            return False
        for name in victims:
            v = self._sess[self._by_name[name]]
            if not v.in_host:
                continue
            v.in_host = False
            self._host_used -= v.nbytes
            if not v.on_ssd:
                self._ssd_write(now, v.dirty)
                v.dirty = 0
                v.gen += 1
                v.on_ssd = True
            self.eviction.on_remove(name)
            self._publish(v, now)
            self._evictions += 1
        if need > self.host_capacity - self._host_used:
            return False
        self._host_used += need
        return True

    def _publish(
        self,
        s: _Sess,
        now: float,
        *,
        access: bool = False,
        answer: int | None = None,
        next_access: float | None = None,
    ) -> KVMeta:
        if s.in_host:
            tier: str | None = _HOST
            copies: tuple[str, ...] = (_HOST, _SSD) if s.on_ssd else (_HOST,)
        elif s.on_ssd:
            tier, copies = _SSD, (_SSD,)
        else:
            tier, copies = None, ()
        meta = advance_meta(
            self.channel.get(s.name),
            session=s.name,
            tier=tier,
            copies=copies,
            nbytes=s.nbytes,
            tokens=s.tokens,
            turns=s.turns,
            now=now,
            access=access,
            answer=answer,
            codec=self.codec,
            next_access=next_access if answer is not None else ...,
        )
        self.channel.put(meta)
        return meta

    # -- results ------------------------------------------------------------------------
    def _result(self) -> SimResult:
        counted = np.asarray(self._counted, dtype=bool)
        latency = (self.finish - self.arrival)[counted]
        queueing = (self.start - self.arrival)[counted]
        ttft = (self.first_token - self.arrival)[counted]

        def pct(a: np.ndarray[tuple[int], np.dtype[np.float64]], q: float) -> float:
            return float(np.percentile(a, q)) if len(a) else 0.0

        def mean(a: np.ndarray[tuple[int], np.dtype[np.float64]]) -> float:
            return float(a.mean()) if len(a) else 0.0

        loads = np.asarray(self._load_times)
        cv = float(loads.std() / loads.mean()) if len(loads) and loads.mean() > 0 else 0.0
        makespan = self._last_finish - self._first_arrival
        return SimResult(
            system=self.system.name,
            turns=int(counted.sum()),
            users=len(self._sess),
            latency_mean=mean(latency),
            latency_p50=pct(latency, 50),
            latency_p90=pct(latency, 90),
            latency_p95=pct(latency, 95),
            latency_p99=pct(latency, 99),
            queueing_mean=mean(queueing),
            queueing_p90=pct(queueing, 90),
            ttft_mean=mean(ttft),
            ttft_p99=pct(ttft, 99),
            accesses=self._accesses,
            host_hits=self._hits,
            ssd_read_bytes=self._ssd_read,
            ssd_write_bytes=self._ssd_written,
            recomputed_tokens=self._recomputed,
            gpu_busy=self._busy / makespan if makespan > 0 else 0.0,
            makespan=makespan,
            load_time_cv=cv,
            evictions=self._evictions,
            direct_loads=self._direct_loads,
            predicted=self._predicted,
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
