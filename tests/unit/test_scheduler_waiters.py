"""Every request that waits for a load is released exactly once: when the load lands,
fails, or when the requests it was for are withdrawn (a client that went away).

Both load-aware schedulers share this bookkeeping (``policies/_loads.py``); each test runs
them both.
"""

from __future__ import annotations

import pytest

from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies import FCFS, BidawScheduler, Request
from tieredkv.policies.scheduling import Scheduler

POLICIES = [pytest.param(FCFS, id="fcfs"), pytest.param(BidawScheduler, id="bidaw")]


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


def drain(sched: Scheduler, now: float) -> list[str]:
    out = []
    while (r := sched.pop_ready(now)) is not None:
        out.append(r.id)
    return out


@pytest.mark.parametrize("cls", POLICIES)
@pytest.mark.parametrize("ok", [True, False])
def test_a_request_that_joins_a_load_in_flight_is_released_with_it(
    cls: type[FCFS] | type[BidawScheduler], ok: bool
) -> None:
    view = channel(a=("ssd", 10**6))
    sched = cls()
    sched.submit(Request(id="r1", session="a", arrival=1.0), 1.0, view)
    assert [r.id for r in sched.start_loads(1.0)] == ["r1"]
    sched.submit(Request(id="r2", session="a", arrival=2.0), 2.0, view)  # joins it
    assert sched.start_loads(2.0) == []  # one load per session
    assert [r.id for r in sched.load_finished("a", 3.0, ok=ok)] == ["r1", "r2"]
    assert drain(sched, 3.0) == ["r1", "r2"]
    assert len(sched) == 0
    assert sched.waiting() == []


@pytest.mark.parametrize("cls", POLICIES)
def test_a_withdrawn_request_is_never_handed_out(cls: type[FCFS] | type[BidawScheduler]) -> None:
    view = channel(a=("ssd", 10**6), h=("host", 1))
    sched = cls()
    sched.submit(Request(id="r1", session="h", arrival=1.0), 1.0, view)
    sched.submit(Request(id="r2", session="h", arrival=2.0), 2.0, view)
    sched.submit(Request(id="r3", session="a", arrival=3.0), 3.0, view)
    assert sched.cancel("r1", 3.0)  # ready
    assert not sched.cancel("r1", 3.0)  # once
    assert not sched.cancel("nobody", 3.0)
    assert len(sched) == 2
    assert sched.waiting() == ["h", "a"]
    assert sched.ready_sessions() == {"h"}
    assert drain(sched, 3.0) == ["r2"]
    assert sched.ready_sessions() == set()
    assert [r.id for r in sched.start_loads(3.0)] == ["r3"]
    sched.submit(Request(id="r4", session="a", arrival=4.0), 4.0, view)  # joins r3's load
    assert sched.cancel("r3", 4.0)  # waiting for a load in flight
    assert len(sched) == 1
    assert [r.id for r in sched.load_finished("a", 5.0)] == ["r4"]  # the other is released
    assert drain(sched, 5.0) == ["r4"]
    assert len(sched) == 0
    assert sched.waiting() == []
    # the id may be used again once withdrawn
    sched.submit(Request(id="r1", session="h", arrival=6.0), 6.0, view)
    assert drain(sched, 6.0) == ["r1"]


@pytest.mark.parametrize("cls", POLICIES)
def test_a_queued_load_nobody_waits_for_never_starts(
    cls: type[FCFS] | type[BidawScheduler],
) -> None:
    view = channel(a=("ssd", 10**6), b=("ssd", 10**6))
    sched = cls()  # one load at a time
    sched.submit(Request(id="r1", session="a", arrival=1.0), 1.0, view)
    sched.submit(Request(id="r2", session="b", arrival=2.0), 2.0, view)
    sched.submit(Request(id="r3", session="b", arrival=3.0), 3.0, view)
    assert [r.id for r in sched.start_loads(3.0)] == ["r1"]
    assert sched.cancel("r2", 3.0)
    assert sched.cancel("r3", 3.0)  # nobody waits for b's load any more
    sched.load_finished("a", 4.0)
    assert sched.start_loads(4.0) == []  # b's load is gone, not started
    assert sched.load_finished("b", 4.0) == []  # and unknown
    assert drain(sched, 4.0) == ["r1"]
    assert len(sched) == 0
    # a new request for b queues a new load
    sched.submit(Request(id="r5", session="b", arrival=5.0), 5.0, view)
    assert [r.id for r in sched.start_loads(5.0)] == ["r5"]
    assert [r.id for r in sched.load_finished("b", 6.0, ok=False)] == ["r5"]
    assert drain(sched, 6.0) == ["r5"]


@pytest.mark.parametrize("cls", POLICIES)
def test_a_load_whose_requests_left_while_it_ran_still_frees_its_slot(
    cls: type[FCFS] | type[BidawScheduler],
) -> None:
    view = channel(a=("ssd", 10**6), b=("ssd", 10**6))
    sched = cls()
    sched.submit(Request(id="r1", session="a", arrival=1.0), 1.0, view)
    sched.submit(Request(id="r2", session="b", arrival=2.0), 2.0, view)
    assert [r.id for r in sched.start_loads(2.0)] == ["r1"]
    assert sched.cancel("r1", 2.0)
    assert sched.start_loads(2.0) == []  # a's load is still in flight
    assert sched.load_finished("a", 3.0) == []
    assert [r.id for r in sched.start_loads(3.0)] == ["r2"]
