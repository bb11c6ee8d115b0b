"""The Prometheus exporter, scraped over real HTTP (loopback) and checked against
``cache.stats()``: a host tier that holds two of four conversations and an SSD tier."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import pytest
import torch

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.redis_server import RedisServer, new_prefix, own_redis_server
from tieredkv import HostMemoryTier, RedisTier, SSDTier, TieredKVCache
from tieredkv.backends.ssd import segment_file_name
from tieredkv.metrics import LATENCY_BUCKETS, CacheCollector, MetricsServer, serve
from tieredkv.policies import FCFS, BidawScheduler
from tieredkv.policies.scheduling import Request

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "grafana-dashboard.json"
SEGMENT = 8 * 2 * 64 * 100 * 2  # bytes of one turn's tensor below (fp16)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
REACHABLE = "tieredkv_tier_reachable"

__all__ = ["own_redis_server"]  # a fixture used below


def _turn(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randn(8, 2, 100, 64, generator=g).to(torch.float16)}


async def _scrape(server: MetricsServer) -> Samples:
    """Every sample of the metrics page: (name, sorted labels) -> value."""

    def get() -> str:
        with urllib.request.urlopen(server.url, timeout=30) as response:
            assert response.status == 200
            text: str = response.read().decode()
            return text

    text = await anyio.to_thread.run_sync(get)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _one(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def _workload(cache: TieredKVCache) -> None:
    """Four conversations of two turns; the host tier holds two, so loads miss and promote."""
    for turn in range(2):
        for c in range(4):
            session = f"user-{c}"
            if session in cache:
                await cache.load(session)
            await cache.append(session, _turn(10 * c + turn), answer_tokens=40, token_dim=2)
    await cache.load("user-3")  # just appended: a hit
    await cache.load("user-0")  # on the SSD: a miss, promoted


async def test_scraped_metrics_match_cache_stats(tmp_path: Path) -> None:
    tiers = [HostMemoryTier(2 * SEGMENT + 4 * SEGMENT // 5), SSDTier(tmp_path / "ssd", 64 << 20)]
    scheduler = BidawScheduler()
    async with TieredKVCache(tiers) as cache, serve(cache, 0, scheduler=scheduler) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        await _workload(cache)
        for i, session in enumerate(("user-0", "user-1", "user-1")):
            scheduler.submit(
                Request(id=str(i), session=session, arrival=float(i)), float(i), cache.channel
            )
        scheduler.start_loads(3.0)
        samples = await _scrape(server)
        stats = cache.stats()

    assert min(stats.misses, stats.hits, stats.promotions, stats.demotions) > 0
    for field in ("loads", "hits", "misses", "appends", "prefetches", "promotions",
                  "demotions", "evictions", "lost", "drops", "corrupt", "write_through",
                  "errors", "cancelled", "truncated", "written_down", "unsaved", "refused",
                  "unproven", "outputs_reused", "outputs_collapsed",
                  "output_collapse_failures"):  # fmt: skip
        assert _one(samples, f"tieredkv_{field}_total") == getattr(stats, field), field
    assert _one(samples, "tieredkv_orphans") == stats.orphans
    assert _one(samples, "tieredkv_sessions") == 4
    assert _one(samples, "tieredkv_output_idle_bytes") == stats.output_idle_bytes
    for t in stats.tiers:
        tier = {"tier": t.name, "kind": t.kind}
        assert _one(samples, "tieredkv_tier_used_bytes", **tier) == t.used
        assert _one(samples, "tieredkv_tier_capacity_bytes", **tier) == t.capacity
        assert _one(samples, "tieredkv_tier_segments", **tier) == t.segments
        assert _one(samples, "tieredkv_tier_read_bytes_total", **tier) == t.bytes_read
        assert _one(samples, "tieredkv_tier_written_bytes_total", **tier) == t.bytes_written
        assert _one(samples, "tieredkv_tier_reads_total", **tier) == t.reads
        assert _one(samples, "tieredkv_tier_writes_total", **tier) == t.writes
        assert _one(samples, "tieredkv_tier_corrupt_total", **tier) == t.corrupt
    assert min(stats.tiers[1].bytes_read, stats.tiers[1].bytes_written) > 0

    # per-tier hits and misses: host hits are the cache's hits, SSD hits its misses
    assert _one(samples, "tieredkv_tier_hits_total", tier="host") == stats.hits
    assert _one(samples, "tieredkv_tier_misses_total", tier="host") == stats.misses
    assert _one(samples, "tieredkv_tier_hits_total", tier="ssd") == stats.misses
    assert _one(samples, "tieredkv_tier_misses_total", tier="ssd") == 0

    # histograms: one observation per load (by source tier), append and promotion
    def count(what: str, tier: str) -> float:
        return _one(samples, f"tieredkv_{what}_seconds_count", tier=tier)

    assert count("load", "host") == stats.hits
    assert count("load", "ssd") == stats.misses
    assert count("append", "host") + count("append", "ssd") == stats.appends
    assert count("promote", "ssd") == stats.promotions
    assert count("promote", "host") == 0
    for what in ("load", "append", "promote"):
        bounds = [_one(samples, f"tieredkv_{what}_seconds_bucket", tier="ssd", le=str(b))
                  for b in LATENCY_BUCKETS]  # fmt: skip
        assert bounds == sorted(bounds)  # cumulative
        assert _one(samples, f"tieredkv_{what}_seconds_bucket", tier="ssd", le="+Inf") == count(
            what, "ssd"
        )
    assert _one(samples, "tieredkv_load_seconds_sum", tier="ssd") > 0

    # the scheduler: three requests queued, user-0's (on the SSD) load started
    assert _one(samples, "tieredkv_scheduler_queued_requests") == 3
    assert _one(samples, "tieredkv_scheduler_ready_sessions") == len(scheduler.ready_sessions())
    assert _one(samples, "tieredkv_scheduler_loads_in_flight") == scheduler.loads_in_flight == 1


async def test_a_truncating_open_and_a_close_that_writes_down_are_scraped(tmp_path: Path) -> None:
    """Issue 22 (I7): what an open truncated and a close wrote down reach the metrics too."""
    # a close in exclusive mode writes the host-only conversations down to the SSD
    async with TieredKVCache([HostMemoryTier(64 << 20), SSDTier(tmp_path / "ssd", 64 << 20)]) as c:
        for session in ("a", "b"):
            for t in range(2):
                await c.append(session, _turn(t), answer_tokens=4, token_dim=2)
        collector = CacheCollector(c)
        registry = CollectorRegistry()
        registry.register(collector)
    assert c.stats().written_down == 2
    assert registry.get_sample_value("tieredkv_written_down_total") == 2
    assert registry.get_sample_value("tieredkv_unsaved_total") == 0
    # damage b's last turn: the next open keeps its first turn and says so
    damaged = tmp_path / "ssd" / "segments" / segment_file_name(("b", 1))
    raw = bytearray(damaged.read_bytes())
    raw[40] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    async with TieredKVCache([SSDTier(tmp_path / "ssd", 64 << 20)]) as cache:
        registry = CollectorRegistry()
        registry.register(CacheCollector(cache))
        assert cache.stats().truncated == 1
        assert registry.get_sample_value("tieredkv_truncated_total") == 1


async def test_what_opens_and_closes_count_adds_up_when_a_cache_is_reopened(
    tmp_path: Path,
) -> None:
    """A cache object opened and closed three times: written_down_total and
    truncated_total are counters, so each scrape is at least the one before. Before, each
    open and close set them to its own figures: they went 1, 0 and 1, 0 (a counter reset,
    which Prometheus's increase() misreads)."""
    ssd = tmp_path / "ssd"
    c = TieredKVCache([HostMemoryTier(64 << 20), SSDTier(ssd, 64 << 20)])
    registry = CollectorRegistry()
    registry.register(CacheCollector(c))
    seen = []
    for i in range(3):
        async with c:
            for t in range(2):
                await c.append(f"s{i}", _turn(t), answer_tokens=4, token_dim=2)
            if i == 1:  # damage s0's last turn for the next open to find
                damaged = ssd / "segments" / segment_file_name(("s0", 1))
                raw = bytearray(damaged.read_bytes())
                raw[40] ^= 0xFF
                damaged.write_bytes(bytes(raw))
        seen.append(
            tuple(
                registry.get_sample_value(f"tieredkv_{name}_total")
                for name in ("written_down", "truncated", "appends")
            )
        )
    assert seen == [(1, 0, 2), (2, 0, 4), (3, 1, 6)]
    assert (c.stats().written_down, c.stats().truncated, c.stats().unsaved) == (3, 1, 0)


async def test_attach_swaps_the_cache_and_close_frees_the_port() -> None:
    server = serve(None, 0)
    try:
        assert await _scrape(server) == {}  # nothing attached: no series
        async with (
            TieredKVCache([HostMemoryTier(4 << 20)]) as first,
            TieredKVCache([HostMemoryTier(4 << 20, name="fresh")]) as second,
        ):
            server.collector.attach(first, scheduler=FCFS())
            await first.append("a", _turn(1), answer_tokens=5, token_dim=2)
            await first.load("a")
            samples = await _scrape(server)
            assert _one(samples, "tieredkv_hits_total") == 1
            assert _one(samples, "tieredkv_load_seconds_count", tier="host") == 1
            assert _one(samples, "tieredkv_scheduler_queued_requests") == 0
            assert ("tieredkv_scheduler_loads_in_flight", ()) not in samples  # FCFS has none

            server.collector.attach(second)
            await second.append("b", _turn(2), answer_tokens=5, token_dim=2)
            await first.append("a", _turn(3), answer_tokens=5, token_dim=2)  # not exported
            samples = await _scrape(server)
            assert _one(samples, "tieredkv_appends_total") == 1
            assert _one(samples, "tieredkv_append_seconds_count", tier="fresh") == 1
            assert ("tieredkv_append_seconds_count", (("tier", "host"),)) not in samples
            assert ("tieredkv_scheduler_queued_requests", ()) not in samples
    finally:
        await server.aclose()
    with pytest.raises(urllib.error.URLError):
        await _scrape(server)


def test_a_bad_port_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match=r"port must be in 0-65535 \(got 70000\)"):
        serve(None, 70000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="in use"):
            serve(None, taken.getsockname()[1])


async def test_a_collector_serves_in_an_application_registry() -> None:
    from prometheus_client import generate_latest

    registry = CollectorRegistry()
    collector = CacheCollector()
    registry.register(collector)
    assert generate_latest(registry) == b""
    async with TieredKVCache([HostMemoryTier(4 << 20)]) as cache:
        collector.attach(cache)
        await cache.append("a", _turn(1), answer_tokens=5, token_dim=2)
        text = generate_latest(registry).decode()
    assert "tieredkv_appends_total 1.0\n" in text
    assert 'tieredkv_tier_written_bytes_total{kind="memory",tier="host"} ' in text


def _as_from_a_terminal() -> None:
    """In the child before it runs the demo: Ctrl-C as a terminal delivers it. A process
    inherits an ignored or blocked SIGINT (a shell's background job does), and the pytest
    process may carry one after in-process engines ran (the demo then, rightly, ignores it:
    seen once in CI after the vLLM and campaign tests)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.slow  # a demo process, scraped until Ctrl-C: CI runs it
def test_demo_serves_its_metrics_until_ctrl_c() -> None:
    parent = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []))
    demo = subprocess.Popen(
        # faulthandler: a demo that does not stop dumps every thread's stack on SIGABRT
        [sys.executable, "-X", "faulthandler", "-m", "tieredkv", "demo", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    try:
        assert demo.stdout is not None
        lines = []
        for line in demo.stdout:
            lines.append(line)
            if line.startswith("serving the metrics at "):
                break
        url = lines[-1].split()[4]
        assert lines[0] == f"Prometheus metrics: {url}\n"
        counters = next(line for line in lines if line.startswith("loads: ")).split()
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if not s.labels
        }
        # "loads: 15  host hits: 9  misses (served from SSD): 6  hit ratio: 60%"
        assert samples["tieredkv_loads_total"] == int(counters[1])
        assert samples["tieredkv_hits_total"] == int(counters[4])
        assert samples["tieredkv_misses_total"] == int(counters[9])
        demo.send_signal(signal.SIGINT)
        try:
            _, err = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            demo.send_signal(signal.SIGABRT)
            _, err = demo.communicate(timeout=30)
            pytest.fail(f"the demo did not stop on SIGINT (this process's: {parent}):\n{err}")
    finally:
        if demo.poll() is None:
            demo.kill()
        demo.communicate()  # reaps it and closes its pipes
    assert demo.returncode == 130
    assert "Traceback" not in err
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


async def test_the_grafana_dashboard_queries_only_exported_metrics(
    tmp_path: Path, own_redis_server: RedisServer
) -> None:
    """Every metric name a panel queries is in a real scrape of a cache with each kind of
    tier the dashboard shows: host memory, an SSD and a shared (Redis) tier, whose
    ``tier_reachable`` gauge only a tier with a server has."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\btieredkv_\w+", expr)}
    shared = RedisTier(own_redis_server.url, 64 << 20, prefix=new_prefix())
    tiers = [HostMemoryTier(2 * SEGMENT), SSDTier(tmp_path / "ssd", 64 << 20), shared]
    async with TieredKVCache(tiers) as cache, serve(cache, 0, scheduler=BidawScheduler()) as s:
        exported = {name for name, _ in await _scrape(s)}
    assert len(used) >= 20
    assert REACHABLE in used
    assert used - exported == set()


async def test_a_shared_tier_out_of_reach_is_a_zero_on_its_reachable_gauge(
    own_redis_server: RedisServer,
) -> None:
    """``tieredkv_tier_reachable`` is 1 while a Redis tier's heartbeat comes back and 0 once
    one has failed (the server stalled: SIGSTOP), then 1 again; tiers without a server do
    not have it."""
    shared = RedisTier(
        own_redis_server.url, 64 << 20, prefix=new_prefix(), liveness=0.6, timeout=0.3
    )
    labels = {"tier": shared.name, "kind": shared.kind}

    async def reachable(server: MetricsServer, want: float) -> bool:
        for _ in range(100):  # polled: the heartbeat runs in its own task
            if _one(await _scrape(server), REACHABLE, **labels) == want:
                return True
            await anyio.sleep(0.05)
        return False

    tiers = [HostMemoryTier(8 << 20), shared]
    async with TieredKVCache(tiers, mode="inclusive") as cache, serve(cache, 0) as server:
        samples = await _scrape(server)
        gauged = [dict(found)["tier"] for name, found in samples if name == REACHABLE]
        assert gauged == [shared.name]  # (not the host tier: it has no server)
        assert await reachable(server, 1.0)
        own_redis_server.pause()
        try:
            assert await reachable(server, 0.0)
        finally:
            own_redis_server.resume()
        assert await reachable(server, 1.0)
