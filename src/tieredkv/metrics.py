"""Prometheus metrics of a :class:`~tieredkv.TieredKVCache` (and optionally a scheduler).

Needs the ``metrics`` extra (``pip install -e '.[metrics]'`` in a checkout, which installs
``prometheus-client``). One call serves them over HTTP::

    server = tieredkv.metrics.serve(cache, 9400, scheduler=scheduler)
    ...  # http://127.0.0.1:9400/metrics
    server.close()

:class:`CacheCollector` is the collector underneath, for an application that already runs
a Prometheus registry (``registry.register(CacheCollector(cache))``).

What is exported (every name starts with ``tieredkv_``):

* the cache's counters, read from :meth:`~tieredkv.TieredKVCache.stats` at each scrape:
  ``loads_total``, ``hits_total``, ``misses_total``, ``appends_total``,
  ``prefetches_total``, ``predicted_total``, ``promotions_total``, ``demotions_total``,
  ``evictions_total``, ``lost_total``, ``lost_records_forgotten_total`` (records of lost
  sessions let go past ``max_lost_records``), ``drops_total``, ``corrupt_total``,
  ``write_through_total``,
  ``errors_total``, ``cancelled_total``, ``truncated_total`` (sessions the open brought back
  shorter than stored), ``written_down_total`` and ``unsaved_total`` (what a close wrote down
  from volatile tiers, and could not), ``refused_total``, ``unproven_total``,
  ``outputs_reused_total``, ``outputs_collapsed_total`` and
  ``output_collapse_failures_total`` (huge pages idle output memory became, and refusals),
  and the gauges ``sessions`` (sessions the metadata channel knows),
  ``orphans`` (segments whose cleanup failed, awaiting deletion) and ``output_idle_bytes``
  (memory of dropped outputs kept for later loads);
* per tier (labels ``tier`` and ``kind``), from each tier's stats: ``tier_used_bytes``,
  ``tier_capacity_bytes``, ``tier_segments``, ``tier_read_bytes_total``,
  ``tier_written_bytes_total``, ``tier_reads_total``, ``tier_writes_total``,
  ``tier_corrupt_total``, and for a tier with a server (Redis) ``tier_reachable`` (1 while
  its last heartbeat came back: alert on 0, the replica then serves only what it may prove
  current);
* per tier (label ``tier``), from the channel's events since the collector was attached:
  ``tier_hits_total`` (loads that found the history in this tier), ``tier_hit_tokens_total``
  (the tokens of those histories) and ``tier_misses_total`` (loads that had to go below
  it); tier 0's hits are the cache's
  ``hits``, and the hits of the lower tiers add up to its ``misses`` minus the loads that
  found the history damaged;
* latency histograms in seconds (label ``tier``), from the same events, on the cache's
  clock: ``load_seconds`` (by the tier the history was found in, a promotion included),
  ``append_seconds`` (by the tier written) and ``promote_seconds`` (by the tier the
  history came from);
* with a scheduler: ``scheduler_queued_requests`` (submitted, not handed out),
  ``scheduler_ready_sessions`` (sessions whose requests may run: their KV is in host
  memory or needs none) and, where the scheduler counts them (``BidawScheduler``),
  ``scheduler_loads_in_flight``.

The HTTP server answers from its own thread: a scrape reads counters and lengths, never
waits for the event loop, and changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Self

import anyio

from .cache import TieredKVCache
from .meta import Event, KVMeta, Loaded, Promoted, Stored
from .policies.scheduling import Scheduler

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ModuleNotFoundError as exc:  # pragma: no cover - the extra is installed in tests
    raise ModuleNotFoundError(
        "tieredkv.metrics needs prometheus-client (the metrics extra: pip install -e "
        "'.[metrics]' in a checkout, or pip install prometheus-client)",
        name=exc.name,
    ) from None

__all__ = ["LATENCY_BUCKETS", "CacheCollector", "MetricsServer", "serve"]

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the latency histograms' buckets: 100 µs (a small host-memory
load) to 10 s (gigabytes from a slow SSD)."""

_CACHE_COUNTERS = (
    ("loads", "Loads served (hits and misses)."),
    ("hits", "Loads served from the performance tier (tier 0)."),
    ("misses", "Loads served from a lower tier, or that found the history damaged."),
    ("appends", "Segments stored (one per appended turn)."),
    ("prefetches", "Prefetches that moved a history up to tier 0."),
    ("predicted", "Predictive prefetches (sessions brought up before their user returned)."),
    ("promotions", "Histories moved up to tier 0."),
    ("demotions", "Histories moved down a tier."),
    ("evictions", "Copies removed from a tier to make room."),
    ("lost", "Sessions whose last copy was evicted (their KV must be recomputed)."),
    ("lost_records_forgotten", "Records of lost sessions let go past max_lost_records."),
    ("drops", "Sessions dropped by the application."),
    ("corrupt", "Segments that failed verification (never served)."),
    ("write_through", "Segments copied down in the background (inclusive mode)."),
    ("errors", "I/O errors while moving data (the data stayed where it was)."),
    ("cancelled", "Operations cancelled by their caller (each rolled back)."),
    ("truncated", "Sessions the cache's open brought back shorter than stored, or not at all."),
    ("written_down", "Conversations only volatile tiers held that the close wrote down."),
    ("unsaved", "Conversations only volatile tiers held that the close could not write down."),
    ("refused", "Acknowledged turns a shared tier refused (another replica took over first)."),
    ("unproven", "Loads missed: the current history could not be proven (shared tier away)."),
    ("outputs_reused", "Tensors load() returned in memory a dropped output left."),
    ("outputs_collapsed", "Huge pages idle output memory was collapsed into (background)."),
    ("output_collapse_failures", "Collapses of idle output memory the kernel refused for now."),
)
_TIER_GAUGES = (
    ("used", "tier_used_bytes", "Bytes held by the tier, reservations included."),
    ("capacity", "tier_capacity_bytes", "Bytes the tier may hold."),
    ("segments", "tier_segments", "Committed segments in the tier."),
)
_TIER_COUNTERS = (
    ("bytes_read", "tier_read_bytes", "Bytes read out of the tier."),
    ("bytes_written", "tier_written_bytes", "Bytes written into the tier."),
    ("reads", "tier_reads", "Segment reads from the tier."),
    ("writes", "tier_writes", "Segment writes into the tier."),
    ("corrupt", "tier_corrupt", "Segments of the tier found damaged."),
)


class _EventMetrics:
    """What only the events tell: per-tier hits and misses, and the latency histograms."""

    def __init__(
        self,
        tiers: Sequence[str],
        buckets: Sequence[float],
        meta: Callable[[str], KVMeta | None] = lambda session: None,
    ) -> None:
        self.tiers = list(tiers)
        self._meta = meta  # a session's metadata now (its tokens, when a load is counted)
        self.hits = Counter(
            "tieredkv_tier_hits",
            "Loads that found the history in this tier.",
            ["tier"],
            registry=None,
        )
        self.hit_tokens = Counter(
            "tieredkv_tier_hit_tokens",
            "Tokens of the histories loads found in this tier.",
            ["tier"],
            registry=None,
        )
        self.misses = Counter(
            "tieredkv_tier_misses",
            "Loads that did not find the history in this tier (it was below).",
            ["tier"],
            registry=None,
        )
        self.load = self._histogram(
            "load", "Seconds a load took, by the tier it came from.", buckets
        )
        self.append = self._histogram("append", "Seconds an append took, by tier.", buckets)
        self.promote = self._histogram(
            "promote", "Seconds a promotion took, by the tier it came from.", buckets
        )
        self._metrics: tuple[Counter | Histogram, ...] = (
            self.hits,
            self.hit_tokens,
            self.misses,
            self.load,
            self.append,
            self.promote,
        )
        for name in self.tiers:  # every series exists from the start, at zero
            for metric in self._metrics:
                metric.labels(name)
        self._promoted_from: dict[str, str] = {}  # session -> tier of its latest promotion

    @staticmethod
    def _histogram(what: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(f"tieredkv_{what}_seconds", doc, ["tier"], buckets=buckets, registry=None)

    def __call__(self, event: Event) -> None:
        if isinstance(event, Promoted):
            self._promoted_from[event.session] = event.src
            self.promote.labels(event.src).observe(event.seconds)
        elif isinstance(event, Loaded):
            promoted = self._promoted_from.pop(event.session, None)
            found = event.tier if event.hit or promoted is None else promoted
            self.load.labels(found).observe(event.seconds)
            if found in self.tiers:
                level = self.tiers.index(found)
                self.hits.labels(found).inc()
                meta = self._meta(event.session)
                if meta is not None:
                    self.hit_tokens.labels(found).inc(meta.tokens)
                for above in self.tiers[:level]:
                    self.misses.labels(above).inc()
        elif isinstance(event, Stored):
            self.append.labels(event.tier).observe(event.seconds)
        else:  # Demoted, Evicted, Dropped, ...: a later load's source is no longer a promotion
            self._promoted_from.pop(event.session, None)

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield from metric.collect()


class CacheCollector:
    """A Prometheus collector over a cache and, optionally, a scheduler.

    Counters and gauges are read from the cache at each scrape; per-tier hits and misses
    and the latency histograms come from the cache's metadata channel, to which the
    collector subscribes while attached (from :meth:`attach` on).

    :param cache: the cache to export (``None``: attach one later)
    :param scheduler: the scheduler whose queue lengths to export
    :param buckets: the latency histograms' bucket bounds, seconds
    """

    def __init__(
        self,
        cache: TieredKVCache | None = None,
        *,
        scheduler: Scheduler | None = None,
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        self._buckets = tuple(buckets)
        self._lock = threading.Lock()
        self._cache: TieredKVCache | None = None
        self._scheduler: Scheduler | None = None
        self._events: _EventMetrics | None = None
        self._unsubscribe: list[Callable[[], None]] = []
        if cache is not None:
            self.attach(cache, scheduler=scheduler)

    @property
    def cache(self) -> TieredKVCache | None:
        """The cache exported now."""
        return self._cache

    def attach(self, cache: TieredKVCache, *, scheduler: Scheduler | None = None) -> None:
        """Export ``cache`` (and ``scheduler``) from now on, instead of what was attached.

        The event-based series start again from zero (Prometheus sees a counter reset);
        a benchmark that opens one cache per configuration attaches each in turn.
        """
        events = _EventMetrics([t.name for t in cache.tiers], self._buckets, cache.channel.get)
        with self._lock:
            self._detach_locked()
            self._cache, self._scheduler, self._events = cache, scheduler, events
            self._unsubscribe.append(cache.channel.subscribe(events))

    def detach(self) -> None:
        """Stop exporting (a scrape then returns no tieredkv series)."""
        with self._lock:
            self._detach_locked()

    def _detach_locked(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        self._cache = self._scheduler = self._events = None

    def collect(self) -> Iterator[Metric]:
        """The metrics now (called by the Prometheus registry at each scrape)."""
        with self._lock:
            cache, scheduler, events = self._cache, self._scheduler, self._events
        if cache is None or events is None:
            return
        stats = cache.stats()
        for field, doc in _CACHE_COUNTERS:
            yield CounterMetricFamily(f"tieredkv_{field}", doc, value=getattr(stats, field))
        yield GaugeMetricFamily(
            "tieredkv_sessions", "Sessions the metadata channel knows.", value=len(cache.channel)
        )
        yield GaugeMetricFamily(
            "tieredkv_orphans",
            "Segments whose cleanup failed, awaiting deletion.",
            value=stats.orphans,
        )
        yield GaugeMetricFamily(
            "tieredkv_output_idle_bytes",
            "Memory of dropped load() outputs kept for later loads.",
            value=stats.output_idle_bytes,
        )
        labels = ["tier", "kind"]
        for field, name, doc in _TIER_GAUGES:
            gauge = GaugeMetricFamily(f"tieredkv_{name}", doc, labels=labels)
            for t in stats.tiers:
                gauge.add_metric([t.name, t.kind], getattr(t, field))
            yield gauge
        for field, name, doc in _TIER_COUNTERS:
            counter = CounterMetricFamily(f"tieredkv_{name}", doc, labels=labels)
            for t in stats.tiers:
                counter.add_metric([t.name, t.kind], getattr(t, field))
            yield counter
        served = [t for t in stats.tiers if t.reachable is not None]
        if served:
            gauge = GaugeMetricFamily(
                "tieredkv_tier_reachable",
                "1 while the tier's last heartbeat to its server came back, else 0.",
                labels=labels,
            )
            for t in served:
                gauge.add_metric([t.name, t.kind], 1.0 if t.reachable else 0.0)
            yield gauge
        yield from events.collect()
        if scheduler is not None:
            yield GaugeMetricFamily(
                "tieredkv_scheduler_queued_requests",
                "Requests submitted to the scheduler and not yet handed out.",
                value=len(scheduler),
            )
            yield GaugeMetricFamily(
                "tieredkv_scheduler_ready_sessions",
                "Sessions whose queued requests may run (KV in host memory, or none needed).",
                value=len(scheduler.ready_sessions()),
            )
            in_flight = getattr(scheduler, "loads_in_flight", None)
            if isinstance(in_flight, int):
                yield GaugeMetricFamily(
                    "tieredkv_scheduler_loads_in_flight",
                    "KV loads started and not yet finished.",
                    value=in_flight,
                )


class MetricsServer:
    """An HTTP endpoint serving a :class:`CacheCollector` (see :func:`serve`).

    A context manager (``with`` or ``async with``) that closes the endpoint on exit.
    """

    def __init__(self, collector: CacheCollector, port: int, addr: str) -> None:
        self.collector = collector
        """The collector served; :meth:`CacheCollector.attach` swaps the cache."""
        self.registry = CollectorRegistry()
        """The endpoint's own registry (nothing global is touched)."""
        self.registry.register(collector)
        self._httpd, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.addr = addr
        self.port: int = self._httpd.server_port
        """The port listened on (the one chosen by the system when ``0`` was asked)."""

    @property
    def url(self) -> str:
        """The metrics page, e.g. ``http://127.0.0.1:9400/metrics``."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (waits up to half a second for the server thread)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join()
        self.collector.detach()

    async def aclose(self) -> None:
        """:meth:`close` in a worker thread, so that the event loop does not wait (it
        finishes even when the caller is cancelled)."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def serve(
    cache: TieredKVCache | None,
    port: int,
    *,
    addr: str = "127.0.0.1",
    scheduler: Scheduler | None = None,
    buckets: Sequence[float] = LATENCY_BUCKETS,
) -> MetricsServer:
    """Serve the metrics of ``cache`` (and ``scheduler``) at ``http://addr:port/metrics``.

    :param cache: the cache (``None``: attach one later with ``server.collector.attach``)
    :param port: the TCP port; ``0`` lets the system choose (see :attr:`MetricsServer.port`)
    :param addr: the address listened on: loopback by default; ``"0.0.0.0"`` for a
        Prometheus server on another machine
    :param scheduler: a scheduler whose queue lengths to export too
    :param buckets: the latency histograms' bucket bounds, seconds
    :returns: the running endpoint; close it (or use it as a context manager) when done
    :raises ValueError: for a port outside 0-65535
    :raises OSError: if the port cannot be bound (in use, or not permitted)
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0-65535 (got {port})")
    return MetricsServer(CacheCollector(cache, scheduler=scheduler, buckets=buckets), port, addr)
