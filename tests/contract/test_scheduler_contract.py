"""The scheduler contract, one generic suite that every registered scheduler plugs into.

Requests whose KV is in host memory (or nowhere) are ready; requests whose KV is on SSD
wait for a load that the scheduler asks for and the engine reports; nothing is lost.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies import Request, Scheduler, make_scheduler, scheduler_names


@pytest.fixture(params=scheduler_names())
def make(request: pytest.FixtureRequest) -> Callable[..., Scheduler]:
    name: str = request.param
    return lambda **kw: make_scheduler(name, **kw)


@pytest.fixture
def view() -> MetadataChannel:
    channel = MetadataChannel(
        [
            TierInfo(name="host", level=0, capacity=10**9),
            TierInfo(name="ssd", level=1, capacity=10**12),
        ]
    )
    channel.put(KVMeta(session="hot", tier="host", copies=("host",), nbytes=1_000))
    channel.put(KVMeta(session="cold", tier="ssd", copies=("ssd",), nbytes=5_000))
    channel.put(KVMeta(session="cold2", tier="ssd", copies=("ssd",), nbytes=7_000))
    channel.put(KVMeta(session="both", tier="ssd", copies=("ssd", "host"), nbytes=2_000))
    channel.put(KVMeta(session="lost", tier=None, nbytes=0))
    return channel


def req(i: int, session: str, arrival: float | None = None, tokens: int = 10) -> Request:
    return Request(
        id=f"r{i}", session=session, arrival=float(i) if arrival is None else arrival, tokens=tokens
    )


def drain(s: Scheduler, now: float = 100.0) -> list[Request]:
    out = []
    while (r := s.pop_ready(now)) is not None:
        out.append(r)
    return out


def test_satisfies_protocol(make: Callable[..., Scheduler]) -> None:
    s = make()
    assert isinstance(s, Scheduler)
    assert s.name in scheduler_names()
    assert len(s) == 0
    assert s.pop_ready(0.0) is None
    assert s.next_batch(0.0, 100) == []
    assert s.start_loads(0.0) == []
    assert s.waiting() == []


def test_duplicate_id_is_refused(make: Callable[..., Scheduler], view: MetadataChannel) -> None:
    s = make()
    s.submit(req(1, "hot"), 1.0, view)
    with pytest.raises(ValueError, match="already queued"):
        s.submit(req(1, "new"), 1.0, view)
    assert len(s) == 1


@pytest.mark.parametrize("session", ["hot", "both", "lost", "first-turn"])
def test_request_without_kv_on_ssd_is_ready(
    make: Callable[..., Scheduler], view: MetadataChannel, session: str
) -> None:
    s = make()
    s.submit(req(1, session), 1.0, view)
    assert s.start_loads(1.0) == []
    assert session in s.ready_sessions()
    assert s.pop_ready(1.0) == req(1, session)
    assert len(s) == 0
    assert session not in s.ready_sessions()


def test_request_with_kv_on_ssd_waits_for_its_load(
    make: Callable[..., Scheduler], view: MetadataChannel
) -> None:
    s = make()
    s.submit(req(1, "cold"), 1.0, view)
    assert s.pop_ready(1.0) is None
    assert "cold" not in s.ready_sessions()
    assert [r.session for r in s.start_loads(1.0)] == ["cold"]
    assert s.start_loads(1.5) == []  # already in flight
    assert s.pop_ready(2.0) is None
    assert s.load_finished("cold", 3.0) == [req(1, "cold")]
    assert s.pop_ready(3.0) == req(1, "cold")


def test_failed_load_makes_request_ready_for_recompute(
    make: Callable[..., Scheduler], view: MetadataChannel
) -> None:
    s = make()
    s.submit(req(1, "cold"), 1.0, view)
    s.start_loads(1.0)
    assert s.load_finished("cold", 2.0, ok=False) == [req(1, "cold")]
    assert s.pop_ready(2.0) == req(1, "cold")


def test_one_load_serves_every_request_of_a_session(
    make: Callable[..., Scheduler], view: MetadataChannel
) -> None:
    s = make(max_loads=4)
    s.submit(req(1, "cold"), 1.0, view)
    s.submit(req(2, "cold"), 2.0, view)
    assert [r.session for r in s.start_loads(2.0)] == ["cold"]
    assert s.load_finished("cold", 3.0) == [req(1, "cold"), req(2, "cold")]
    assert drain(s) == [req(1, "cold"), req(2, "cold")]


def test_loads_in_flight_never_exceed_max_loads(
    make: Callable[..., Scheduler], view: MetadataChannel
) -> None:
    s = make(max_loads=1)
    s.submit(req(1, "cold"), 1.0, view)
    s.submit(req(2, "cold2"), 2.0, view)
    first = s.start_loads(2.0)
    assert len(first) == 1
    assert s.start_loads(3.0) == []
    s.load_finished(first[0].session, 4.0)
    second = s.start_loads(4.0)
    assert len(second) == 1
    assert {first[0].session, second[0].session} == {"cold", "cold2"}


def test_unknown_load_report_is_ignored(
    make: Callable[..., Scheduler], view: MetadataChannel
) -> None:
    s = make()
    s.submit(req(1, "hot"), 1.0, view)
    assert s.load_finished("cold", 2.0) == []
    assert len(s) == 1


def test_load_reported_before_it_was_started(
    make: Callable[..., Scheduler], view: MetadataChannel
) -> None:
    s = make()
    s.submit(req(1, "cold"), 1.0, view)
    assert s.load_finished("cold", 1.5) == [req(1, "cold")]  # KV arrived another way
    assert s.start_loads(2.0) == []
    assert s.pop_ready(2.0) == req(1, "cold")


def test_batch_respects_token_budget_and_never_starves_a_big_request(
    make: Callable[..., Scheduler], view: MetadataChannel
) -> None:
    s = make()
    s.submit(req(1, "hot", tokens=60), 1.0, view)
    s.submit(req(2, "lost", tokens=30), 2.0, view)
    s.submit(req(3, "a", tokens=30), 3.0, view)
    assert [r.id for r in s.next_batch(3.0, 100)] == ["r1", "r2"]
    s.submit(req(4, "b", tokens=500), 4.0, view)
    assert [r.id for r in s.next_batch(4.0, 100)] == ["r3"]
    assert [r.id for r in s.next_batch(4.0, 100)] == ["r4"]  # alone, over budget
    s.submit(req(5, "c"), 5.0, view)
    s.submit(req(6, "d"), 6.0, view)
    assert [r.id for r in s.next_batch(6.0, 1000, max_requests=1)] == ["r5"]
    assert len(s) == 1


def test_waiting_lists_every_queued_session(
    make: Callable[..., Scheduler], view: MetadataChannel
) -> None:
    s = make()
    for i, session in enumerate(["hot", "cold", "lost", "cold2"], 1):
        s.submit(req(i, session), float(i), view)
    assert sorted(s.waiting()) == sorted(["hot", "cold", "lost", "cold2"])
    assert len(s.waiting(limit=2)) == 2
    assert s.waiting()[0] == "hot"
    assert len(s) == 4


def test_every_request_is_handed_out_exactly_once(
    make: Callable[..., Scheduler], view: MetadataChannel
) -> None:
    s = make(max_loads=2)
    sessions = ["hot", "cold", "lost", "cold2", "both", "cold", "new"]
    for i, session in enumerate(sessions):
        s.submit(req(i, session), float(i), view)
    out: list[Request] = []
    now = 10.0
    while len(s):
        for load in s.start_loads(now):
            s.load_finished(load.session, now + 1)
        out.extend(drain(s, now))
        now += 1
        assert now < 100
    assert sorted(r.id for r in out) == sorted(f"r{i}" for i in range(len(sessions)))
