"""What distinguishes each baseline eviction policy: the order it gives sessions up."""

from __future__ import annotations

from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies import FIFO, LFU, LRU, Belady, Eviction, QueueEnhanced


def m(session: str, nbytes: int = 10, nxt: float | None = None) -> KVMeta:
    return KVMeta(session=session, tier="host", nbytes=nbytes, next_access=nxt)


def admit_all(policy: Eviction, view: MetadataChannel, sessions: str) -> None:
    for t, s in enumerate(sessions):
        view.put(m(s))
        policy.on_access(s, m(s), float(t))
        policy.on_admit(s, m(s), float(t))


def order(policy: Eviction, view: MetadataChannel) -> list[str]:
    chosen = policy.victims(policy.resident_bytes(), 100.0, view)
    assert chosen is not None
    return chosen


def view() -> MetadataChannel:
    return MetadataChannel([TierInfo(name="host", level=0, capacity=100)])


def test_fifo_ignores_accesses_and_resizes() -> None:
    v = view()
    p = FIFO()
    admit_all(p, v, "abc")
    p.on_access("a", m("a"), 5.0)
    p.on_admit("a", m("a", 20), 5.0)  # grows in place, keeps its turn
    assert order(p, v) == ["a", "b", "c"]


def test_lru_access_refreshes() -> None:
    v = view()
    p = LRU()
    admit_all(p, v, "abc")
    p.on_access("a", m("a"), 5.0)
    assert order(p, v) == ["b", "c", "a"]


def test_lfu_evicts_least_frequent_then_least_recent() -> None:
    v = view()
    p = LFU()
    admit_all(p, v, "abcd")
    for s in "ccb":
        p.on_access(s, m(s), 5.0)
    p.on_access("a", m("a"), 6.0)
    assert order(p, v) == ["d", "b", "a", "c"]  # d:1; b, a: 2 (b older); c: 3
    p.on_remove("c")
    p.on_admit("c", m("c"), 7.0)  # a re-admission starts over
    assert order(p, v)[0] == "d"
    assert order(p, v)[1] == "c"


def test_queue_enhanced_spares_the_next_window_of_queued_sessions() -> None:
    v = view()
    p = QueueEnhanced(window=2)
    admit_all(p, v, "abcd")
    v.publish_waiting(["a", "b", "c"])  # c is beyond the window
    assert p.victims(30, 10.0, v) is None  # only c and d (20 bytes) may go
    assert p.victims(20, 10.0, v) == ["c", "d"]
    v.publish_waiting([])
    assert order(p, v) == ["a", "b", "c", "d"]


def test_belady_evicts_furthest_next_access_and_never_first() -> None:
    v = view()
    p = Belady()
    for t, (s, nxt) in enumerate([("a", 50.0), ("b", None), ("c", 20.0), ("d", 90.0)]):
        meta = m(s, nxt=nxt)
        v.put(meta)
        p.on_access(s, meta, float(t))
        p.on_admit(s, meta, float(t))
    assert order(p, v) == ["b", "d", "a", "c"]


def test_belady_follows_a_late_hint_from_the_channel() -> None:
    v = view()
    p = Belady()
    for t, (s, nxt) in enumerate([("a", 50.0), ("b", 60.0)]):
        v.put(m(s, nxt=nxt))
        p.on_admit(s, m(s, nxt=nxt), float(t))
    v.hint_next_access("b", 5.0)  # after its last notification
    assert p.victims(10, 1.0, v) == ["a"]
