"""The memory of tensors ``load`` returned is reused by later loads only once the caller
has dropped every tensor and view of it, and reuse never changes a byte that is loaded;
the staging buffers of appends are reused even when one is larger than their cap.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import queue
import resource
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tests.forked import wait_child
from tests.hugepages import collapse_works
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv._cache.gather import Staging
from tieredkv._cache.outputs import POOLED_MIN_BYTES, OutputPool
from tieredkv.backends._hugepages import huge_page_size
from tieredkv.errors import InvalidArgumentError, InvalidTypeError

TOKENS = 512  # 512 x 1024 fp16 = 1 MiB per tensor per turn: pooled


def turn(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(TOKENS, 1024, generator=g).half(),
        "v": torch.randn(TOKENS, 1024, generator=g).half(),
        "small": torch.randint(0, 255, (TOKENS, 3), generator=g, dtype=torch.uint8),
    }


def joined(*turns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([t[k] for t in turns]) for k in turns[0]}


def assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype
        assert got[k].shape == v.shape
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


async def idle_reaches(pool: OutputPool, nbytes: int, seconds: float = 5) -> int:
    """The pool's idle bytes once they reach ``nbytes`` (or after ``seconds``): a worker
    thread that copied into an output may drop its last reference a moment after the load
    returned."""
    deadline = time.monotonic() + seconds
    gc.collect()
    for _ in range(100_000):  # a polled condition: the finalizer runs in another thread
        if pool.idle_bytes >= nbytes or time.monotonic() >= deadline:
            break
        await anyio.sleep(0.01)
    return pool.idle_bytes


def tiers(tmp_path: Path, where: str) -> list[HostMemoryTier | SSDTier]:
    ssd = SSDTier(tmp_path / "ssd", 64 << 20)
    return [ssd] if where == "ssd" else [HostMemoryTier(64 << 20), ssd]


@pytest.mark.parametrize("where", ["ssd", "host"])
async def test_a_dropped_output_is_reused_and_every_load_is_exact(
    tmp_path: Path, where: str
) -> None:
    a, b = turn(1), turn(2)
    async with TieredKVCache(tiers(tmp_path, where)) as cache:
        await cache.append("a", a, answer_tokens=1)
        await cache.append("b", b, answer_tokens=1)
        first = await cache.load("a")
        assert_exact(first, a)
        pool = cache._core.outputs
        assert pool.reused == 0
        del first
        assert await idle_reaches(pool, 2 << 20) == 2 << 20  # "k" and "v"; "small" is not pooled
        # the same memory now holds b's bytes, exactly
        second = await cache.load("b")
        stats = cache.stats()
        assert stats.outputs_reused == 2
        assert stats.output_idle_bytes == 0
        assert pool.reused == 2
        assert pool.idle_bytes == 0
        assert_exact(second, b)
        # every tensor has a storage of its own, of its own size
        for t in second.values():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
            assert t.is_contiguous()


async def test_memory_is_not_reused_while_a_view_of_it_lives(tmp_path: Path) -> None:
    a, b = turn(1), turn(2)
    async with TieredKVCache([SSDTier(tmp_path, 64 << 20)]) as cache:
        await cache.append("a", a, answer_tokens=1)
        await cache.append("b", b, answer_tokens=1)
        out = await cache.load("a")
        kept = out["k"][100:200]  # a view keeps the whole tensor's memory
        want = a["k"][100:200].clone()
        del out
        assert await idle_reaches(cache._core.outputs, 1 << 20) == 1 << 20  # "v" alone
        again = await cache.load("b")
        assert_exact(again, b)
        assert torch.equal(kept, want)  # b's load did not write into a's live view
        assert kept.data_ptr() not in {t.data_ptr() for t in again.values()}


async def test_idle_memory_is_capped_and_zero_turns_reuse_off(tmp_path: Path) -> None:
    a = turn(1)
    async with TieredKVCache([SSDTier(tmp_path, 64 << 20)], output_reuse_bytes=1 << 20) as cache:
        await cache.append("a", a, answer_tokens=1)
        out = await cache.load("a")
        del out
        assert await idle_reaches(cache._core.outputs, 1 << 20) == 1 << 20  # one of two
        assert_exact(await cache.load("a"), a)
    async with TieredKVCache([SSDTier(tmp_path, 64 << 20)], output_reuse_bytes=0) as cache:
        for _ in range(2):
            out = await cache.load("a")
            assert_exact(out, a)
            del out
            assert await idle_reaches(cache._core.outputs, 1, seconds=0.3) == 0
        assert cache._core.outputs.reused == 0


async def test_close_frees_idle_memory_and_a_reopened_cache_reuses_again(
    tmp_path: Path,
) -> None:
    a = turn(1)
    cache = TieredKVCache([SSDTier(tmp_path, 64 << 20)])
    async with cache:
        await cache.append("a", a, answer_tokens=1)
        held = await cache.load("a")
    pool = cache._core.outputs
    assert pool.idle_bytes == 0
    del held  # dropped after close: unmapped, not kept
    assert await idle_reaches(pool, 1, seconds=0.3) == 0
    async with cache:
        out = await cache.load("a")
        del out
        assert await idle_reaches(pool, 2 << 20) == 2 << 20
        assert_exact(await cache.load("a"), a)
        assert pool.reused == 2


def test_pool_shapes_dtypes_and_small_tensors() -> None:
    pool = OutputPool(8 << 20)
    t = pool.empty((4, POOLED_MIN_BYTES // 8), torch.float16)
    assert t.shape == (4, POOLED_MIN_BYTES // 8)
    assert t.dtype == torch.float16
    assert t.data_ptr() % 4096 == 0
    t.fill_(1.5)
    assert bool((t == 1.5).all())
    with pytest.raises(RuntimeError, match="not resizable"):  # as load's doc says
        t.resize_(8, POOLED_MIN_BYTES // 8)
    small = pool.empty((3, 5), torch.float32)
    assert small.shape == (3, 5)
    del t, small
    gc.collect()
    assert pool.idle_bytes == POOLED_MIN_BYTES
    u = pool.empty((POOLED_MIN_BYTES // 2,), torch.bfloat16)
    assert pool.reused == 1
    assert u.numel() == POOLED_MIN_BYTES // 2
    pool.close()


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, InvalidArgumentError), (1.5, InvalidTypeError), (True, InvalidTypeError)],
)
def test_a_bad_output_reuse_bytes_is_refused(
    tmp_path: Path, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="output_reuse_bytes"):
        TieredKVCache([SSDTier(tmp_path, 64 << 20)], output_reuse_bytes=value)  # type: ignore[arg-type]


def test_staging_keeps_its_newest_buffer_even_above_the_cap() -> None:
    """A cache whose segments are larger than the staging cap still reuses one buffer
    (mapping and faulting in 256 MiB per append would halve the append's speed)."""
    staging = Staging(keep_bytes=1 << 20)
    with staging.buffer(4 << 20) as view:
        first = ctypes.addressof(ctypes.c_char.from_buffer(view))
        view[:4] = b"abcd"
    with staging.buffer(4 << 20) as view:
        assert ctypes.addressof(ctypes.c_char.from_buffer(view)) == first
    with staging.buffer(8 << 20), staging.buffer(12 << 20):
        pass  # both come back (the 12 MiB one first); only the last returned stays
    assert [b.size for b in staging._free] == [8 << 20]
    staging.close()


def thp_mode() -> str:
    """The system's transparent huge page mode (``always``, ``madvise``, ``never``)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0] if "[" in text else "never"


@pytest.mark.parametrize("huge_pages", [True, False])
def test_a_staging_buffer_of_a_huge_page_or_more_is_on_huge_pages(huge_pages: bool) -> None:
    """Appends to an SSD tier are written from staging buffers with O_DIRECT: on huge pages
    a write is cut into fewer device requests (8 MiB: 3.99 against 5.60 ms on the 2-core
    VM), and the buffer faults in 2 MiB at a time. ``huge_pages=False`` keeps 4 KiB ones."""
    if not collapse_works():
        pytest.skip("this kernel gives no transparent huge pages to private memory")
    huge = huge_page_size()
    staging = Staging(huge_pages=huge_pages)
    length = 4 * huge + 4096  # an 8 MiB turn and its header's page
    with staging.buffer(length) as view:
        view[:] = bytes(range(256)) * (length // 256)
        at = ctypes.addressof(ctypes.c_char.from_buffer(view))
        under = huge_bytes_at(at)
        assert bytes(view[-256:]) == bytes(range(256))
    if huge_pages:
        assert at % huge == 0
        assert under >= huge  # (the kernel may fall back for a page it has none free for)
    elif thp_mode() == "madvise":
        assert under == 0
    with staging.buffer(length) as again:  # the same memory, the same bytes
        assert ctypes.addressof(ctypes.c_char.from_buffer(again)) == at
        assert bytes(again[:256]) == bytes(range(256))
    staging.close()


async def test_concurrent_loads_and_drops_from_other_threads_stay_exact(tmp_path: Path) -> None:
    """Loads running side by side while earlier outputs are dropped in worker threads (the
    finalizer then runs there): every load returns exactly its own history, and memory is
    reused along the way."""
    turns = {f"s{i}": turn(10 + i) for i in range(4)}
    kept: list[dict[str, torch.Tensor]] = []
    async with TieredKVCache(
        [HostMemoryTier(8 << 20), SSDTier(tmp_path, 64 << 20)], output_reuse_bytes=16 << 20
    ) as cache:
        for name, t in turns.items():
            await cache.append(name, t, answer_tokens=1)

        async def load_and_check(name: str) -> None:
            out = await cache.load(name)
            assert_exact(out, turns[name])
            kept.append(out)

        for _ in range(5):
            async with anyio.create_task_group() as tg:
                for name in turns:
                    tg.start_soon(load_and_check, name)
            dropped, kept[:] = list(kept), []
            await anyio.to_thread.run_sync(dropped.clear)  # last references go there
        assert cache.stats().outputs_reused > 0


def test_an_output_freed_inside_the_pools_own_critical_section_does_not_deadlock() -> None:
    """The cyclic collector frees garbage at whatever allocation triggers it, one the pool
    makes while it holds its lock included (``close`` lists its idle mappings there): an
    output freed then gives its memory back from the thread that holds the lock, which
    must not wait for itself (before: that thread hung for good)."""
    pool = OutputPool(64 << 20)
    out: torch.Tensor | None = pool.empty((POOLED_MIN_BYTES,), torch.uint8)
    done = threading.Event()

    def drop_inside() -> None:
        nonlocal out
        with pool._lock:
            out = None  # the last reference: its memory goes back here, lock held
        done.set()

    worker = threading.Thread(target=drop_inside, daemon=True)
    worker.start()
    worker.join(10)
    assert done.is_set(), "giving memory back inside the pool's lock deadlocked"
    assert pool.idle_bytes == POOLED_MIN_BYTES  # and it was kept for reuse
    again = pool.empty((POOLED_MIN_BYTES,), torch.uint8)
    assert pool.reused == 1
    assert again.numel() == POOLED_MIN_BYTES


# -- huge pages: idle memory collapsed in the background ----------------------------------


def huge_bytes_under(t: torch.Tensor) -> int:
    """Bytes of huge pages in the mapping that holds ``t`` (``AnonHugePages`` of its
    entry in ``/proc/self/smaps``)."""
    return huge_bytes_at(t.data_ptr())


def huge_bytes_at(at: int) -> int:
    """Bytes of huge pages in the mapping that holds address ``at``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= at < hi:
                for field in lines[i + 1 :]:
                    if field.startswith("AnonHugePages:"):
                        return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {at:#x}")


async def collapsed_reaches(pool: OutputPool, n: int, seconds: float = 30) -> int:
    deadline = time.monotonic() + seconds
    for _ in range(1_000_000):  # a polled condition: the pool's thread collapses
        if pool.collapsed >= n or time.monotonic() >= deadline:
            break
        await anyio.sleep(0.01)
    return pool.collapsed


def big_turn(seed: int, mib: int = 4) -> dict[str, torch.Tensor]:
    """Two fp16 tensors of ``mib`` MiB each: each spans whole huge pages."""
    g = torch.Generator().manual_seed(seed)
    rows = mib * 512
    return {n: torch.randn(rows, 1024, generator=g).half() for n in ("k", "v")}


async def test_idle_outputs_become_huge_pages_and_later_loads_stay_exact(
    tmp_path: Path,
) -> None:
    """A dropped output's memory is collapsed into huge pages in the background, where the
    kernel can (else the pool stops asking, and nothing else changes); the loads that reuse
    it return exact bytes, in memory on huge pages."""
    a, b = big_turn(1), big_turn(2)
    async with TieredKVCache([SSDTier(tmp_path, 64 << 20)]) as cache:
        await cache.append("a", a, answer_tokens=1)
        await cache.append("b", b, answer_tokens=1)
        pool = cache._core.outputs
        first = await cache.load("a")
        assert_exact(first, a)
        where = {n: t.data_ptr() for n, t in first.items()}
        assert all(at % huge_page_size() == 0 for at in where.values()) or not pool.collapsing
        del first
        assert await idle_reaches(pool, 8 << 20) == 8 << 20
        if collapse_works():
            ranges = 2 * (4 << 20) // huge_page_size()
            assert await collapsed_reaches(pool, ranges) == ranges
            assert pool.collapse_failures == 0
        else:
            await collapsed_reaches(pool, 1, seconds=2)
            assert not pool.collapsing
            assert pool.collapsed == 0
        for name, want in (("b", b), ("a", a), ("b", b)):
            got = await cache.load(name)
            assert_exact(got, want)
            assert {t.data_ptr() for t in got.values()} == set(where.values())  # same memory
            huge = collapse_works()
            assert all(huge_bytes_under(t) >= (t.nbytes if huge else 0) for t in got.values())
            del got
            assert await idle_reaches(pool, 8 << 20) == 8 << 20
        stats = cache.stats()
        assert stats.outputs_collapsed == pool.collapsed
        assert stats.output_collapse_failures == 0


@pytest.mark.parametrize("flag", [True, False])
async def test_staging_huge_pages_reaches_the_caches_staging(tmp_path: Path, flag: bool) -> None:
    a = big_turn(1)
    async with TieredKVCache([SSDTier(tmp_path, 64 << 20)], staging_huge_pages=flag) as cache:
        await cache.append("a", a, answer_tokens=1)
        assert (cache._core.staging._huge > 0) == (flag and huge_page_size() > 0)
        assert_exact(await cache.load("a"), a)


async def test_output_huge_pages_false_keeps_4k_pages(tmp_path: Path) -> None:
    a = big_turn(1)
    async with TieredKVCache([SSDTier(tmp_path, 64 << 20)], output_huge_pages=False) as cache:
        await cache.append("a", a, answer_tokens=1)
        pool = cache._core.outputs
        assert not pool.collapsing
        for _ in range(2):
            got = await cache.load("a")
            assert_exact(got, a)
            del got
            assert await idle_reaches(pool, 8 << 20) == 8 << 20
        await anyio.sleep(0.2)
        assert pool.collapsed == 0
        assert pool._collapser._worker is None
        assert cache.stats().outputs_reused == 2


@pytest.mark.parametrize("flag", ["output_huge_pages", "staging_huge_pages"])
def test_a_bad_huge_pages_flag_is_refused(tmp_path: Path, flag: str) -> None:
    kwargs: dict[str, Any] = {flag: 1}
    with pytest.raises(InvalidTypeError, match=f"{flag} must be a bool, not int"):
        TieredKVCache([SSDTier(tmp_path, 64 << 20)], **kwargs)


def failing_madvise(err: int, calls: list[int]) -> Any:
    def madvise(at: int, length: int, advice: int) -> int:
        calls.append(at)
        ctypes.set_errno(err)
        return -1

    return madvise


def wait_for(cond: Any, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    for _ in range(1_000_000):  # a polled condition: the pool's thread
        if cond() or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    return bool(cond())


@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOSYS, errno.EPERM])
def test_a_kernel_that_cannot_collapse_turns_it_off(err: int) -> None:
    huge = 2 << 20
    calls: list[int] = []
    pool = OutputPool(64 << 20)
    pool._collapser.huge = huge
    pool._collapser._madvise = failing_madvise(err, calls)
    outs = [pool.empty((2 * huge,), torch.uint8).fill_(1) for _ in range(2)]
    outs.clear()
    gc.collect()
    assert wait_for(lambda: not pool.collapsing)
    assert wait_for(lambda: pool._collapser._worker is None)
    assert len(calls) == 1  # asked once, then never again
    assert pool.collapse_failures == 0
    again = pool.empty((2 * huge,), torch.uint8)  # reuse goes on
    assert pool.reused == 1
    del again
    gc.collect()
    assert len(calls) == 1
    pool.close()


def test_memory_never_written_is_left_alone_and_collapsing_stays_on() -> None:
    """Outputs dropped before anything was written into them (a load that failed or was
    cancelled before its bytes landed) have no page in memory: the kernel refuses to
    collapse such a range with ``EINVAL``, the error an older kernel gives for the advice
    itself. Before 5 December 2026 that turned collapsing off for good; now such a range is
    not asked for, and the memory is collapsed once a later output has written it."""
    if not collapse_works():
        pytest.skip("this kernel does not collapse memory into huge pages (MADV_COLLAPSE)")
    huge = huge_page_size()
    pool = OutputPool(64 << 20)
    outs = [pool.empty((2 * huge,), torch.uint8) for _ in range(2)]  # never written
    outs.clear()
    gc.collect()
    assert wait_for(lambda: pool._collapser._worker is None)
    assert pool.collapsing
    assert (pool.collapsed, pool.collapse_failures) == (0, 0)
    again = [pool.empty((2 * huge,), torch.uint8) for _ in range(2)]
    assert pool.reused == 2
    again[0].fill_(1)
    again[1].fill_(2)
    again.clear()
    gc.collect()
    assert wait_for(lambda: pool.collapsed == 4)
    assert pool.collapsing
    back = [pool.empty((2 * huge,), torch.uint8) for _ in range(2)]  # the same bytes
    assert sorted(int(t[0]) for t in back) == [1, 2]
    assert all(bool((t == t[0]).all()) for t in back)
    pool.close()


def test_a_buffer_queued_as_collapsing_is_turned_off_is_left_alone() -> None:
    """A buffer queued by a drop that raced with collapsing being turned off (a kernel that
    refused the advice) is skipped, not collapsed with a huge page size of 0: that raised
    ``ZeroDivisionError`` in the collapsing thread before 5 December 2026."""
    huge = 2 << 20
    calls: list[int] = []
    pool = OutputPool(64 << 20)
    collapser = pool._collapser
    collapser.huge = huge
    collapser._madvise = failing_madvise(errno.EINVAL, calls)
    t = pool.empty((2 * huge,), torch.uint8).fill_(1)
    del t
    gc.collect()
    assert wait_for(lambda: not pool.collapsing)
    assert wait_for(lambda: collapser._worker is None)
    (idle,) = [b for bs in pool._free.values() for b in bs]
    collapser._collapse(idle)  # what the thread does with a buffer queued meanwhile
    assert len(calls) == 1
    assert not idle.huge
    pool.close()


def test_a_refused_collapse_is_counted_and_tried_again_up_to_three_times() -> None:
    huge = 2 << 20
    calls: list[int] = []
    pool = OutputPool(64 << 20)
    pool._collapser.huge = huge
    pool._collapser._madvise = failing_madvise(errno.EAGAIN, calls)
    for round_ in range(1, 6):
        t = pool.empty((2 * huge,), torch.uint8).fill_(1)
        assert t.data_ptr() % huge == 0
        del t
        gc.collect()
        tries = min(round_, 3)
        assert wait_for(lambda tries=tries: pool.collapse_failures >= tries)
        assert wait_for(lambda: pool._collapser._worker is None)
        # one refusal per try (the block's other range is not asked: no huge page now)
        assert pool.collapse_failures == tries
    assert pool.collapsing  # a transient refusal does not turn it off
    assert pool.collapsed == 0
    pool.close()


def test_memory_handed_out_again_is_not_collapsed_until_dropped_again() -> None:
    """The thread collapses a block only while it is idle: one a new output took meanwhile
    is left alone (and queued again when that output is dropped)."""
    huge = 2 << 20
    pool = OutputPool(64 << 20)
    pool._collapser.huge = huge
    started, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def madvise(at: int, length: int, advice: int) -> int:
        seen.append(at)
        started.set()
        release.wait(10)
        return 0

    pool._collapser._madvise = madvise
    a = pool.empty((2 * huge,), torch.uint8).fill_(1)
    b = pool.empty((2 * huge,), torch.uint8).fill_(2)
    first = a.data_ptr()
    del a
    gc.collect()
    del b
    gc.collect()
    assert started.wait(10)  # collapsing a's first range (or b's)
    taken = pool.empty((2 * huge,), torch.uint8)  # the other one, or this one: idle no more
    taken.fill_(3)
    release.set()
    assert wait_for(lambda: pool._collapser._worker is None)
    # the block handed out again had at most the range in progress collapsed
    at = taken.data_ptr()
    assert sum(lo in (at, at + huge) for lo in seen) <= 1
    assert bool((taken == 3).all())
    assert first in (at, *seen)
    pool.close()


def test_a_collapse_cut_short_by_reuse_resumes_at_the_next_idle_period() -> None:
    """A block handed out again while the thread collapses it (a busy server reuses
    memory within milliseconds) was not refused: its next idle period goes on with the huge
    pages not collapsed yet, and asks for none twice. Before 6 December 2026 each such
    period counted as one of the three tries, so a block reused that quickly stayed on
    4 KiB pages after its third, and a pass that began again counted the huge pages made
    before once more."""
    huge, ranges = 2 << 20, 5
    pool = OutputPool(64 << 20)
    pool._collapser.huge = huge
    asked: queue.Queue[int] = queue.Queue()
    go = threading.Semaphore(0)

    def madvise(at: int, length: int, advice: int) -> int:
        asked.put(at)
        assert go.acquire(timeout=10)
        return 0

    pool._collapser._madvise = madvise
    t = pool.empty((ranges * huge,), torch.uint8).fill_(1)
    first = t.data_ptr()
    seen: list[int] = []
    for _ in range(ranges):
        del t
        gc.collect()  # idle: the thread starts on the next range
        seen.append(asked.get(timeout=10))
        t = pool.empty((ranges * huge,), torch.uint8)  # handed out again meanwhile
        go.release()
        assert wait_for(lambda: pool._collapser._worker is None)
    assert t.data_ptr() == first  # (the same block every time)
    assert seen == [first + i * huge for i in range(ranges)]
    assert (pool.collapsed, pool.collapse_failures) == (ranges, 0)
    del t
    gc.collect()
    assert wait_for(lambda: pool._collapser._worker is None)
    assert asked.empty()  # every huge page of it is made: nothing left to ask
    assert pool.collapsed == ranges
    pool.close()


def test_close_during_collapsing_unmaps_idle_memory_and_ends_the_thread() -> None:
    huge = 2 << 20
    pool = OutputPool(64 << 20)
    pool._collapser.huge = huge
    started, release = threading.Event(), threading.Event()

    def madvise(at: int, length: int, advice: int) -> int:
        started.set()
        release.wait(0.2)
        return 0

    pool._collapser._madvise = madvise
    outs = [pool.empty((2 * huge,), torch.uint8).fill_(1) for _ in range(4)]
    outs.clear()
    gc.collect()
    assert started.wait(10)
    worker = pool._collapser._worker
    assert worker is not None
    held = [b for bs in pool._free.values() for b in bs]
    pool.close()
    assert not worker.is_alive()
    assert all(b.mm.closed for b in held)
    assert pool.idle_bytes == 0
    assert pool.collapsed <= 8


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_collapse_holds_the_locks_drops_reuses_and_closes() -> None:
    """A fork copies the collapser's locks as held by its thread mid-collapse (and the
    pool's, by whichever thread held it): the child, which has no such thread, still drops,
    reuses and closes the memory it inherited, with nothing deadlocked."""
    huge = 2 << 20
    pool = OutputPool(64 << 20)
    pool._collapser.huge = huge
    parent = os.getpid()
    started, release = threading.Event(), threading.Event()

    def madvise(at: int, length: int, advice: int) -> int:
        if os.getpid() == parent:  # the parent's collapse: held until released
            started.set()
            release.wait(10)
        return 0

    pool._collapser._madvise = madvise
    kept = pool.empty((2 * huge,), torch.uint8)
    kept.fill_(7)
    outs = [pool.empty((2 * huge,), torch.uint8).fill_(1) for _ in range(2)]
    outs.clear()
    gc.collect()
    assert started.wait(10)  # the parent's thread holds ``unmapping`` now
    holding, let_go = threading.Event(), threading.Event()

    def hold() -> None:  # and another thread holds the pool's
        with pool._lock:
            holding.set()
            let_go.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert holding.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: exits 0 once all of it worked (numpy, not torch: a forked
        code = 1  # child may not use torch's own threads)
        try:
            assert bool((kept.numpy() == 7).all())
            del kept
            gc.collect()
            again = pool.empty((2 * huge,), torch.uint8)  # the memory it inherited, reused
            again.numpy()[:] = 9
            assert bool((again.numpy() == 9).all())
            assert pool.reused >= 1
            del again
            gc.collect()
            pool.close()
            code = 0
        finally:
            os._exit(code)
    try:
        why = "the forked child deadlocked on a lock a parent's thread held"
        assert wait_child(pid, why) == 0
    finally:
        release.set()
        let_go.set()
    holder.join(10)
    assert wait_for(lambda: pool._collapser._worker is None)
    assert bool((kept == 7).all())
    pool.close()


async def test_a_new_caches_first_append_faults_its_staging_buffer_in_off_the_event_loop(
    tmp_path: Path,
) -> None:
    """The staging buffer of a new cache's first append to SSD is faulted in by the worker
    thread that fills it, part by part while earlier parts are written, not on the event
    loop's thread: populating 32 MiB there took 8,192 faults at once (22-32 ms for a 64 MiB
    turn), a stall of every other request the server was running."""
    big = {f"t{i}": torch.full((1024, 1024), float(i), dtype=torch.float16) for i in range(16)}
    async with TieredKVCache([SSDTier(tmp_path, 256 << 20)]) as cache:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        await cache.append("s", big, answer_tokens=1)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert faults < 2048, f"the event loop's thread took {faults} page faults"
        assert_exact(await cache.load("s"), big)
