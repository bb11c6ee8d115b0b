"""The os-call fault injector (tests/faults.py) on a real SSD tier and from worker threads."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

import tieredkv.backends.ssd.layout as ssd_module  # one of the SSD modules that call os
from tests.faults import FaultInjector, InjectedFault
from tests.segments import SegmentFactory, read_back, store
from tieredkv.backends import SSDTier
from tieredkv.errors import TierIOError

CAPACITY = 16 << 20


def tier_os() -> Any:
    """What the SSD tier's modules call ``os`` right now."""
    return vars(ssd_module)["os"]


async def test_nth_call_of_a_site_fails_deterministically(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """fail_nth fails exactly that call: the first write's fsync passes, the second write's
    file fsync fails with the given errno, and the counts say so."""
    a, b = seg(seq=0, seed=1), seg(seq=1, seed=2)
    with FaultInjector() as faults:
        async with SSDTier(ssd_dir, CAPACITY) as tier:
            base = faults.calls["fsync"]
            # the file's fsync, segments/'s (its segments/xx is new) and segments/xx's
            await store(tier, a)
            assert faults.calls["fsync"] == base + 3
            # b's segments/xx is a's: its first fsync is its file's
            faults.fail_nth("fsync", base + 4, errno.ENOSPC)
            assert tier.reserve(b.key, b.length)
            with pytest.raises(TierIOError) as info:
                await tier.write(b.key, b.view)
            assert info.value.errno == errno.ENOSPC
            assert isinstance(info.value.__cause__, InjectedFault)
            assert faults.injected == {"fsync": 1}
            assert faults.calls["fsync"] == base + 4
            tier.release(b.key)
            await store(tier, b)  # the rule was used up: the retry succeeds
            assert await read_back(tier, b) == b.data


async def test_always_fails_every_call_until_cleared(ssd_dir: Path, seg: SegmentFactory) -> None:
    """fail_always fails every call of the site; clear() stops it; calls are counted."""
    s = seg(seed=3)
    with FaultInjector() as faults:
        async with SSDTier(ssd_dir, CAPACITY) as tier:
            faults.fail_always("pwrite")
            assert tier.reserve(s.key, s.length)
            for _ in range(3):
                with pytest.raises(TierIOError) as info:
                    await tier.write(s.key, s.view)
                assert info.value.errno == errno.EIO
            assert faults.injected["pwrite"] == 3
            faults.clear()
            await tier.write(s.key, s.view)
            assert faults.calls["pwrite"] >= 4
            assert faults.total_injected == 3


def test_random_faults_are_seeded() -> None:
    """The same seed over the same calls injects the same faults; another seed differs; the
    observed rate is near the requested one."""

    def run(seed: int) -> list[tuple[int, int | None]]:
        failed = []
        with FaultInjector(seed=seed, rate=0.2, errnos=(errno.EIO, errno.ENOSPC)) as faults:
            for i in range(2000):
                try:
                    tier_os().fstat(0)
                except InjectedFault as exc:
                    failed.append((i, exc.errno))
            assert faults.calls["fstat"] == 2000
            assert faults.injected["fstat"] == len(failed)
        return failed

    first = run(7)
    assert first == run(7)
    assert first != run(8)
    assert 300 < len(first) < 500  # 2000 x 0.2 = 400
    assert {e for _, e in first} == {errno.EIO, errno.ENOSPC}


def test_only_the_named_modules_see_faults() -> None:
    """Inside the block, the tier module's os faults and the real os does not; after it,
    the module has the real os back."""
    with FaultInjector() as faults:
        faults.fail_always("fstat")
        assert tier_os() is not os
        with pytest.raises(InjectedFault):
            tier_os().fstat(0)
        os.fstat(0)  # everyone else: untouched
        assert tier_os().O_RDONLY == os.O_RDONLY  # non-site attributes are the real ones
        with faults.paused():
            tier_os().fstat(0)
        assert faults.calls["fstat"] == 2
        assert faults.injected["fstat"] == 1
    assert tier_os() is os


def test_matching_rules_fail_only_calls_naming_that_file(tmp_path: Path) -> None:
    """fail_matching fails the next ``times`` calls whose first argument names the file
    (str or bytes), lets calls on other names and on descriptors pass, and uses up no try
    while paused; clear() removes it."""
    (tmp_path / "wanted.seg").write_bytes(b"x")
    (tmp_path / "other.seg").write_bytes(b"y")
    with FaultInjector() as faults:
        faults.fail_matching("open", "wanted", times=2)
        tier_os().close(tier_os().open(tmp_path / "other.seg", os.O_RDONLY))  # a PathLike
        with faults.paused():
            tier_os().close(tier_os().open(str(tmp_path / "wanted.seg"), os.O_RDONLY))
        for name in (str(tmp_path / "wanted.seg"), os.fsencode(tmp_path / "wanted.seg")):
            with pytest.raises(InjectedFault):
                tier_os().open(name, os.O_RDONLY)
        tier_os().close(tier_os().open(str(tmp_path / "wanted.seg"), os.O_RDONLY))  # used up
        faults.fail_matching("open", "wanted")
        faults.clear()
        tier_os().close(tier_os().open(str(tmp_path / "wanted.seg"), os.O_RDONLY))
        assert faults.injected == {"open": 2}
    with pytest.raises(ValueError, match="at least 1"):
        FaultInjector().fail_matching("open", "x", times=0)


def test_counts_are_exact_across_threads() -> None:
    """Eight threads making 5,000 calls each: every call counted, every fault counted once,
    and an nth rule fires exactly once."""
    errors: list[int] = []
    lock = threading.Lock()
    with FaultInjector(seed=1, rate=0.1, sites={"fstat"}) as faults:
        faults.fail_nth("stat", 12_345)

        def work() -> None:
            mine = 0
            for _ in range(5000):
                try:
                    tier_os().fstat(0)
                except InjectedFault:
                    mine += 1
                try:
                    tier_os().stat("/")
                except InjectedFault:
                    mine += 1
            with lock:
                errors.append(mine)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert faults.calls == {"fstat": 40_000, "stat": 40_000}
        assert faults.injected["stat"] == 1
        assert sum(errors) == faults.total_injected


async def test_faults_from_anyio_worker_threads(ssd_dir: Path, seg: SegmentFactory) -> None:
    """Concurrent writes through anyio worker threads under a 30% pwrite fault rate: every
    write either commits exactly or raises TierIOError; the injector's count matches the
    failures; what committed reads back byte for byte after a restart."""
    segs = [seg(session=f"s{i}", seq=0, tokens=50 + i, seed=i) for i in range(24)]
    committed: list[int] = []
    failed: list[int] = []
    with FaultInjector(seed=5, rate=0.3, sites={"pwrite"}) as faults:
        async with SSDTier(ssd_dir, CAPACITY) as tier:

            async def one(i: int) -> None:
                s = segs[i]
                assert tier.reserve(s.key, s.length)
                try:
                    await tier.write(s.key, s.view)
                except TierIOError:
                    tier.release(s.key)
                    failed.append(i)
                else:
                    committed.append(i)

            async with anyio.create_task_group() as tg:
                for i in range(len(segs)):
                    tg.start_soon(one, i)
        assert faults.injected["pwrite"] == len(failed)
        assert 0 < len(failed) < len(segs)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert sorted(tier.keys()) == sorted((f"s{i}", 0) for i in committed)
        for i in committed:
            assert await read_back(tier, segs[i]) == segs[i].data


def test_bad_rules_are_refused() -> None:
    """Unknown sites, n < 1, a rate outside [0, 1] and re-entry are errors."""
    with pytest.raises(ValueError, match="unknown fault sites"):
        FaultInjector(sites={"pwrite", "write_all"})
    with pytest.raises(ValueError, match="rate"):
        FaultInjector(rate=1.5)
    faults = FaultInjector()
    with pytest.raises(ValueError, match="unknown"):
        faults.fail_always("read_file")
    with pytest.raises(ValueError, match="from 1"):
        faults.fail_nth("open", 0)
    with faults, pytest.raises(RuntimeError, match="already active"):
        faults.__enter__()
