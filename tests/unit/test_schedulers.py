"""Scenarios from the Bidaw paper: FCFS blocks behind a load, the dual queue does not."""

from __future__ import annotations

import math

import pytest

from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies import FCFS, BidawScheduler, Request


def channel(**where: tuple[str, int]) -> MetadataChannel:
    ch = MetadataChannel(
        [
            TierInfo(name="host", level=0, capacity=10**9),
            TierInfo(name="ssd", level=1, capacity=10**12),
        ]
    )
    for session, (tier, nbytes) in where.items():
        ch.put(KVMeta(session=session, tier=tier, copies=(tier,), nbytes=nbytes))
    return ch


def submit_all(sched: FCFS | BidawScheduler, view: MetadataChannel, sessions: str) -> None:
    for i, s in enumerate(sessions, 1):
        sched.submit(Request(id=f"r{i}", session=s, arrival=float(i)), float(i), view)


def test_fcfs_head_of_line_blocks_behind_a_load() -> None:
    """req1 and req2 wait on SSD, req3..req5 are in memory: FCFS runs nothing until req1's
    KV lands, then exactly req1."""
    view = channel(a=("ssd", 10**8), b=("ssd", 10**6), c=("host", 1), d=("host", 1), e=("host", 1))
    sched = FCFS()
    submit_all(sched, view, "abcde")
    assert [r.session for r in sched.start_loads(5.0)] == ["a"]  # arrival order
    assert sched.pop_ready(5.0) is None
    assert sched.next_batch(5.0, 10**6) == []
    sched.load_finished("a", 6.0)
    assert sched.pop_ready(6.0) == Request(id="r1", session="a", arrival=1.0)
    assert sched.pop_ready(6.0) is None  # b still blocks the rest
    assert sched.waiting() == ["b", "c", "d", "e"]


def test_fcfs_without_prefetch_fetches_only_the_head_when_asked() -> None:
    """I/O-oblivious: nothing loads ahead; when the engine asks for work and the head's KV
    is on SSD, exactly that load starts (and the next only once b is at the head)."""
    view = channel(a=("ssd", 10**8), b=("ssd", 10**6), c=("host", 1))
    sched = FCFS(prefetch=False)
    submit_all(sched, view, "abc")
    assert sched.start_loads(3.0) == []  # queued, but no one asked
    assert sched.pop_ready(3.0) is None
    assert [r.session for r in sched.start_loads(3.0)] == ["a"]
    assert sched.start_loads(3.5) == []  # one on-demand load at a time
    sched.load_finished("a", 4.0)
    assert sched.start_loads(4.0) == []  # b is not at the head yet: a is ready to run
    assert sched.pop_ready(4.0) == Request(id="r1", session="a", arrival=1.0)
    assert sched.start_loads(4.0) == []  # a runs; b's load waits until asked
    assert sched.next_batch(5.0, 10**6) == []  # asked again: b heads the line
    assert [r.session for r in sched.start_loads(5.0)] == ["b"]
    sched.load_finished("b", 6.0)
    assert [r.session for r in sched.next_batch(6.0, 10**6)] == ["b", "c"]


def test_bidaw_runs_memory_requests_while_ssd_loads_proceed() -> None:
    view = channel(a=("ssd", 10**8), b=("ssd", 10**6), c=("host", 1), d=("host", 1), e=("host", 1))
    sched = BidawScheduler()
    submit_all(sched, view, "abcde")
    assert [r.session for r in sched.start_loads(5.0)] == ["b"]  # small KV first
    assert [r.session for r in sched.next_batch(5.0, 10**6)] == ["c", "d", "e"]
    assert sched.waiting() == ["b", "a"]  # the load in flight lands first
    assert sched.loads_in_flight == 1


def test_bidaw_promoted_request_rejoins_at_its_arrival_position() -> None:
    view = channel(a=("ssd", 10**6), c=("host", 1), d=("host", 1))
    sched = BidawScheduler()
    submit_all(sched, view, "acd")  # a arrived first
    sched.start_loads(3.0)
    assert sched.pop_ready(3.0) == Request(id="r2", session="c", arrival=2.0)
    sched.load_finished("a", 4.0)
    assert sched.ready_sessions() == {"a", "d"}
    first, second = sched.pop_ready(4.0), sched.pop_ready(4.0)
    assert first is not None
    assert second is not None
    assert [first.session, second.session] == ["a", "d"]


def edge(nbytes: int) -> float:
    """The size the scheduler ranks by: rounded down to its 1/16-octave class."""
    return float(2 ** (math.floor(math.log2(nbytes) * 16) / 16))


@pytest.mark.parametrize(("small_arrival", "first"), [(990.0, "small"), (999.9, "big")])
def test_disk_hrrn_trades_size_against_waiting_time(small_arrival: float, first: str) -> None:
    """At t=1000 the 1 MB load has waited 1000 s (ratio ~1.001); a 1 kB load that waited
    10 s has ratio ~1.01 and goes first, one that waited 0.1 s (~1.0001) does not (the
    ratio alone: no deadline)."""
    view = channel(big=("ssd", 1_000_000), small=("ssd", 1_000))
    sched = BidawScheduler(max_wait=None)
    sched.submit(Request(id="1", session="big", arrival=0.0), 0.0, view)
    sched.submit(Request(id="2", session="small", arrival=small_arrival), small_arrival, view)
    assert sched.response_ratio("big", 1000.0) == pytest.approx(1 + 1000 / edge(1_000_000))
    assert sched.response_ratio("small", 1000.0) == pytest.approx(
        1 + (1000 - small_arrival) / edge(1_000)
    )
    assert [r.session for r in sched.start_loads(1000.0)] == [first]
    assert sched.response_ratio(first, 1000.0) is None  # started: no longer queued


def test_disk_hrrn_with_fixed_latency_favours_the_longer_wait() -> None:
    """When a fixed per-load latency dwarfs transfer time, every load costs about the same
    and the longer wait wins, although by bytes alone the small load would."""
    view = channel(x=("ssd", 1_000), y=("ssd", 2_000_000))
    by_bytes = BidawScheduler()
    by_time = BidawScheduler(bandwidth=1e9, latency=10.0)
    for sched in (by_bytes, by_time):
        sched.submit(Request(id="1", session="y", arrival=0.0), 0.0, view)
        sched.submit(Request(id="2", session="x", arrival=1.0), 1.0, view)
    assert by_time.response_ratio("y", 3.0) == pytest.approx(1 + 3 / (10 + edge(2_000_000) / 1e9))
    assert by_time.response_ratio("x", 3.0) == pytest.approx(1 + 2 / (10 + edge(1_000) / 1e9))
    assert [r.session for r in by_bytes.start_loads(3.0)] == ["x"]
    assert [r.session for r in by_time.start_loads(3.0)] == ["y"]


def test_scheduler_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        BidawScheduler(bandwidth=0)
    with pytest.raises(ValueError, match="latency"):
        BidawScheduler(latency=-1)
    with pytest.raises(ValueError, match="classes_per_octave"):
        BidawScheduler(classes_per_octave=0)
    with pytest.raises(ValueError, match="max_loads"):
        FCFS(max_loads=0)


def test_no_tiers_described_means_everything_is_ready() -> None:
    view = MetadataChannel()
    view.put(KVMeta(session="a", tier="ssd", nbytes=10))
    for sched in (FCFS(), BidawScheduler()):
        sched.submit(Request(id="1", session="a", arrival=0.0), 0.0, view)
        assert sched.start_loads(0.0) == []
        assert sched.pop_ready(0.0) is not None


def starve(sched: BidawScheduler, until: float) -> float | None:
    """A 20 GB history queued at t=0 behind small (100 MB) loads that arrive twice as fast
    as the SSD serves them, one at a time; returns when the large load started."""
    view = channel(big=("ssd", 20 * 10**9), s0=("ssd", 10**8))
    sched.submit(Request(id="r0", session="s0", arrival=0.0), 0.0, view)
    (in_flight,) = sched.start_loads(0.0)
    sched.submit(Request(id="big", session="big", arrival=0.0), 0.0, view)
    k = 0
    t = 0.0
    while t < until:
        for _ in range(2):
            k += 1
            view.put(KVMeta(session=f"s{k}", tier="ssd", copies=("ssd",), nbytes=10**8))
            sched.submit(Request(id=f"r{k}", session=f"s{k}", arrival=t), t, view)
        t = round(t + 0.1, 6)  # the load in flight lands
        sched.load_finished(in_flight.session, t)
        (in_flight,) = sched.start_loads(t)
        if in_flight.session == "big":
            return t
    return None


def test_pure_disk_hrrn_starves_a_large_history_behind_small_ones() -> None:
    """Without a bound the small loads' ratios (1 + wait / 0.1 s) outgrow the large one's
    (1 + wait / 20 s) for as long as the backlog of small loads grows."""
    assert starve(BidawScheduler(bandwidth=10**9, max_wait=None), until=120.0) is None


@pytest.mark.parametrize("max_wait", [0.5, 5.0, 30.0])
def test_no_load_waits_past_max_wait_for_a_free_slot(max_wait: float) -> None:
    """The large history's load starts at the first decision past the bound (the one slot
    frees every 0.1 s), ahead of every small load's higher ratio."""
    sched = BidawScheduler(bandwidth=10**9, max_wait=max_wait)
    started = starve(sched, until=120.0)
    assert started is not None
    assert max_wait <= started < max_wait + 0.1 + 1e-9
    assert sched.response_ratio("big", started) is None  # in flight: no longer queued


def test_max_wait_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_wait"):
        BidawScheduler(max_wait=0.0)
