"""Per-decision cost of the policies at 1k, 10k and 100k sessions.

Run: ``.venv/bin/python benchmarks/bench_policies.py`` (about a minute and a half).

The Bidaw paper reports 0.62 ms per scheduling decision, 0.35 ms per eviction decision and
2.86 ms per ghost-cache update; the goal here is at least 10x faster at 100k sessions
(medians <= 62 us, <= 35 us, <= 286 us), and for the tail: ``victims()`` p99 <= 100 us and
median <= 20 us, the disk-HRRN decision median <= 20 us. Every figure printed is measured
in this run, and each Bidaw row is also given as a ratio to LRU's ``victims()`` measured in
the same run (median / median, p99 / p99):

- *eviction*: one :meth:`victims` call (choose enough victims for one admission) on a tier
  holding N sessions, inside a replay-like loop (access, choose, remove, admit) over an
  interactive access stream (each session comes back after a think gap that grows with
  its answer length, and each turn brings a new input spread over the default's classes
  of new input, so that its residents are grouped as a live tier's are); LRU is
  measured the same way as an in-run baseline. The whole admission (access + choose +
  remove + admit) is printed too.
- *scheduling*: one disk-HRRN load choice (:meth:`start_loads`), and the same plus one
  ready-queue pop, with N requests queued (half on SSD), the queue kept at N by a new
  submission per step;
  ``max_wait=None``, so every decision compares ratios (an overdue load is a heap pop).
- *ghost update*: one :meth:`GhostCache.record` (which replays about one older access under
  Belady), median, p99 and mean, so the amortized cost shows.
"""

from __future__ import annotations

import gc
import heapq
import statistics
import time
from collections.abc import Callable

import numpy as np

from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies import (
    LRU,
    AdaptiveBidaw,
    BidawEviction,
    BidawScheduler,
    Eviction,
    GhostCache,
    Request,
)

PAPER_US = {"schedule": 620.0, "evict": 350.0, "ghost": 2860.0}
SIZES = (1_000, 10_000, 100_000)
BYTES_PER_TOKEN = 819_200


def stats(samples_ns: list[int]) -> tuple[float, float, float]:
    """Median, p99 and mean in microseconds."""
    us = sorted(s / 1e3 for s in samples_ns)
    return statistics.median(us), us[int(0.99 * (len(us) - 1))], statistics.fmean(us)


def stream(n: int, accesses: int, seed: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """An interactive access stream over n sessions: (session, bytes, answer tokens, new
    input tokens of the turn)."""
    rng = np.random.default_rng(seed)
    answers = np.clip(rng.lognormal(np.log(31), 0.85, accesses + n), 1, 424).astype(int)
    # new inputs over every class of ``AdaptiveBidaw.query_edges`` (the policy's groups),
    # drawn apart so that the rest of the stream is what it was without them
    spread = np.random.default_rng((seed, 1)).lognormal(np.log(400), 1.5, accesses)
    queries = np.clip(spread, 1, 32_000).astype(int)
    tokens = rng.integers(50, 2048, size=n)
    restart = rng.random(accesses) < 1 / 22.4  # the conversation ends; a new one takes its slot
    due = [(float(rng.uniform(0, n)), s) for s in range(n)]
    heapq.heapify(due)
    sessions, sizes, answer_of, query_of = [], [], [], []
    for i in range(accesses):
        t, s = heapq.heappop(due)
        a = int(answers[i])
        tokens[s] = 80 if restart[i] else min(2048, tokens[s] + 80)
        sessions.append(s)
        sizes.append(int(tokens[s]) * BYTES_PER_TOKEN)
        answer_of.append(a)
        query_of.append(int(queries[i]))
        # Back after about one round of all sessions, longer after a longer answer.
        gap = n * (0.4 + a / 80) * float(rng.lognormal(0, 0.4))
        heapq.heappush(due, (t + gap, s))
    return sessions, sizes, answer_of, query_of


def bench_eviction(
    make: Callable[[], Eviction], n: int, warm: int, measured: int
) -> tuple[list[int], list[int]]:
    sessions, sizes, answers, queries = stream(n, warm + measured, seed=n)
    capacity = int(0.4 * n * 1100 * BYTES_PER_TOKEN)  # ~40% of the sessions fit
    view = MetadataChannel([TierInfo(name="host", level=0, capacity=capacity)])
    policy = make()
    resident: dict[str, int] = {}
    used = 0
    decide_ns: list[int] = []
    admit_ns: list[int] = []
    turns: dict[str, int] = {}
    names = [f"s{s}" for s in range(n)]
    clock = time.perf_counter_ns
    for i, (s, size, answer, query) in enumerate(
        zip(sessions, sizes, answers, queries, strict=True)
    ):
        session = names[s]
        turns[session] = turns.get(session, 0) + 1
        meta = KVMeta(
            session=session,
            tier="host",
            nbytes=size,
            turns=turns[session],
            prev_answer_tokens=answer,
            turn_tokens=query + answer,
        )
        t0 = clock()
        policy.on_access(session, meta, float(i))
        old = resident.get(session, 0)
        need = used - old + size - capacity
        t1 = t2 = clock()
        if need > 0:
            t1 = clock()
            chosen = policy.victims(need, float(i), view, frozenset((session,)))
            t2 = clock()
            assert chosen is not None
            for victim in chosen:
                used -= resident.pop(victim)
                policy.on_remove(victim)
        resident[session] = size
        used += size - old
        policy.on_admit(session, meta, float(i))
        t3 = clock()
        if i >= warm and need > 0:
            decide_ns.append(t2 - t1)
            admit_ns.append(t3 - t0)
    assert len(policy) >= 0.2 * n, "the tier should hold a good share of the sessions"
    return decide_ns, admit_ns


def bench_scheduler(n: int, measured: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(n)
    view = MetadataChannel(
        [
            TierInfo(name="host", level=0, capacity=10**12),
            TierInfo(name="ssd", level=1, capacity=10**15),
        ]
    )
    sched = BidawScheduler(max_loads=1, bandwidth=1.5e9, max_wait=None)
    sizes = rng.integers(50, 2048, size=n + measured) * BYTES_PER_TOKEN
    now = 0.0

    def submit(k: int) -> None:
        session = f"s{k}"
        on_ssd = k % 2 == 0
        view.put(KVMeta(session=session, tier="ssd" if on_ssd else "host", nbytes=int(sizes[k])))
        sched.submit(Request(id=f"r{k}", session=session, arrival=now), now, view)

    for k in range(n):
        now += 0.001
        submit(k)
    choose: list[int] = []  # the disk-HRRN choice alone
    both: list[int] = []  # the choice and one ready-queue pop
    clock = time.perf_counter_ns
    for k in range(n, n + measured):
        now += 0.001
        t0 = clock()
        started = sched.start_loads(now)
        t1 = clock()
        ready = sched.pop_ready(now)
        t2 = clock()
        choose.append(t1 - t0)
        both.append(t2 - t0)
        assert ready is not None
        for load in started:
            sched.load_finished(load.session, now)
        submit(k)
    return choose, both


def bench_ghost(n: int, warm: int, measured: int) -> list[int]:
    sessions, sizes, _, _ = stream(n, warm + measured, seed=n + 1)
    capacity = int(0.4 * n * 1100 * BYTES_PER_TOKEN)
    ghost = GhostCache(capacity)
    names = [f"s{s}" for s in range(n)]
    samples: list[int] = []
    clock = time.perf_counter_ns
    for i, (s, size) in enumerate(zip(sessions, sizes, strict=True)):
        t0 = clock()
        ghost.record(names[s], size, size * 3)
        t1 = clock()
        if i >= warm:
            samples.append(t1 - t0)
    return samples


def row(label: str, samples: list[int], paper: float | None, base: list[int] | None = None) -> str:
    med, p99, mean = stats(samples)
    text = f"  {label:34} median {med:8.2f} us  p99 {p99:8.2f} us  mean {mean:8.2f} us"
    if paper is not None:
        text += f"  paper/ours {paper / med:7.1f}x"
    if base is not None:
        base_med, base_p99, _ = stats(base)
        text += f"  vs lru victims: {med / base_med:5.1f}x median, {p99 / base_p99:5.1f}x p99"
    return text


def main() -> None:
    gc.disable()  # collections would land on random samples; nothing here makes cycles
    start = time.perf_counter()
    verdicts = []
    for n in SIZES:
        warm, measured = max(3 * n, 20_000), 5_000
        print(f"{n:,} sessions ({warm:,} warm-up accesses, {measured:,} measured)")
        lru_decide, lru_admit = bench_eviction(LRU, n, warm, measured)
        decide, admit = bench_eviction(lambda: AdaptiveBidaw(), n, warm, measured)
        paper_decide, paper_admit = bench_eviction(lambda: BidawEviction(), n, warm, measured)
        dense_decide, dense_admit = bench_eviction(
            lambda: AdaptiveBidaw(ranking="density"), n, warm, measured
        )
        print(row("bidaw eviction: victims()", decide, PAPER_US["evict"], lru_decide))
        print(row("bidaw: access+victims+remove+admit", admit, None, lru_decide))
        print(row("bidaw-paper: victims()", paper_decide, PAPER_US["evict"], lru_decide))
        print(row("bidaw-paper: access+victims+...", paper_admit, None, lru_decide))
        print(row("bidaw, density ranking: victims()", dense_decide, None, lru_decide))
        print(row("bidaw, density: access+victims+...", dense_admit, None, lru_decide))
        print(row("lru eviction: victims() (baseline)", lru_decide, None))
        print(row("lru: access+victims+remove+admit", lru_admit, None))
        sched, sched_pop = bench_scheduler(n, measured)
        print(row("bidaw scheduler: HRRN load choice", sched, PAPER_US["schedule"], lru_decide))
        print(row("bidaw scheduler: HRRN choice + pop", sched_pop, None, lru_decide))
        ghost = bench_ghost(n, warm, measured)
        print(row("ghost cache: record()", ghost, PAPER_US["ghost"]))
        if n == SIZES[-1]:
            for what, samples in (("evict", decide), ("schedule", sched), ("ghost", ghost)):
                ratio = PAPER_US[what] / stats(samples)[0]
                verdict = "ok" if ratio >= 10 else "MISSED the 10x goal"
                verdicts.append(f"{what}: {ratio:.0f}x faster than the paper ({verdict})")
            med, p99, _ = stats(decide)
            tail = "ok" if med <= 20 and p99 <= 100 else "MISSED"
            verdicts.append(f"victims() median {med:.1f} us, p99 {p99:.1f} us (<= 20/100: {tail})")
            hrrn = stats(sched)[0]
            fast = "ok" if hrrn <= 20 else "MISSED"
            verdicts.append(f"HRRN median {hrrn:.1f} us (<= 20: {fast})")
    print("at 100k sessions: " + "; ".join(verdicts))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
