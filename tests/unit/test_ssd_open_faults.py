"""I/O errors while :meth:`SSDTier.open` scans the headers: an error is not evidence of damage.

Issue 22, case 12: an ``os.open`` of one turn's file that failed twice at open had that
intact file quarantined, and recovery then deleted every later, readable turn of its
conversation as a gap. Now a file is retried (with backoff); one that still cannot be read
fails ``open()`` with a :class:`TierIOError` naming it, and nothing is moved or deleted.
Only a file whose bytes were read and found wrong is quarantined.
"""

from __future__ import annotations

import errno
from pathlib import Path

import anyio
import pytest
import torch

from tests.faults import FaultInjector
from tests.segments import Segment, SegmentFactory, read_back, store
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv._retry import RETRY_DELAYS
from tieredkv.backends.ssd import segment_file_name
from tieredkv.errors import TierIOError

CAPACITY = 64 << 20


def quarantined(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "quarantine").iterdir())


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``segments/`` and ``quarantine/``, with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for sub in ("segments", "quarantine")
        for p in sorted((root / sub).rglob("*"))
        if p.is_file()
    }


def file_name(s: Segment) -> str:
    return segment_file_name(s.key).split("/")[1]


async def stored(root: Path, seg: SegmentFactory) -> list[Segment]:
    segs = [seg(session=f"s{i}", seq=j, seed=10 * i + j) for i in range(3) for j in range(2)]
    async with SSDTier(root, CAPACITY) as tier:
        for s in segs:
            await store(tier, s)
    return segs


def fail_reads_of(faults: FaultInjector, site: str, s: Segment, times: int) -> None:
    """Make the next ``times`` header reads of ``s``'s file fail at ``site``.

    ``open`` is matched by the file's name; ``fstat`` and ``pread`` take a descriptor, and
    at open only the header scan calls them, in file-name order: ``s`` must be the first
    file scanned, so the first ``times`` calls are its tries.
    """
    if site == "open":
        faults.fail_matching("open", file_name(s), times)
    else:
        for n in range(1, times + 1):
            faults.fail_nth(site, n)


def first_scanned(segs: list[Segment]) -> Segment:
    return min(segs, key=lambda s: segment_file_name(s.key))


@pytest.mark.parametrize("site", ["open", "fstat", "pread"])
async def test_a_transient_eio_on_one_header_is_retried_and_nothing_is_quarantined(
    ssd_dir: Path, seg: SegmentFactory, site: str
) -> None:
    """Three EIOs in a row on the first file's header read (before, the second one had the
    intact file quarantined): open retries it and indexes every file, each reads back byte
    for byte, and quarantine/ stays empty."""
    segs = await stored(ssd_dir, seg)
    with FaultInjector() as faults:
        fail_reads_of(faults, site, first_scanned(segs), 3)
        async with SSDTier(ssd_dir, CAPACITY) as tier:
            assert faults.injected == {site: 3}
            assert sorted(tier.keys()) == sorted(s.key for s in segs)
            for s in segs:
                assert await read_back(tier, s) == s.data
            assert tier.stats().corrupt == 0
    assert quarantined(ssd_dir) == []


@pytest.mark.parametrize("site", ["open", "fstat", "pread"])
async def test_a_header_that_stays_unreadable_fails_open_and_moves_nothing(
    ssd_dir: Path, seg: SegmentFactory, site: str
) -> None:
    """A file whose header read keeps failing fails open() with a TierIOError that names
    the file, says nothing was moved and what to do; every file is left byte for byte
    where it was, and once the fault clears the tier opens with all of them."""
    segs = await stored(ssd_dir, seg)
    before = snapshot(ssd_dir)
    bad = first_scanned(segs)
    with FaultInjector() as faults:
        fail_reads_of(faults, site, bad, 1000)
        tier = SSDTier(ssd_dir, CAPACITY)
        with pytest.raises(TierIOError) as info:
            await tier.open()
        faults.clear()
    message = str(info.value)
    assert info.value.errno == errno.EIO
    assert segment_file_name(bad.key) in message
    assert "nothing was moved or deleted" in message
    assert "open it again" in message
    assert snapshot(ssd_dir) == before
    async with tier:  # the same object opens once the device answers again
        assert sorted(tier.keys()) == sorted(s.key for s in segs)
    assert quarantined(ssd_dir) == []


async def test_a_damaged_file_is_still_quarantined_at_open(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """What is proven damaged (a header read in full whose CRC fails) is still moved to
    quarantine/, and the open goes on with the rest: the retry is for I/O errors only."""
    segs = await stored(ssd_dir, seg)
    bad = first_scanned(segs)
    path = ssd_dir / "segments" / segment_file_name(bad.key)
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0xFF  # inside the msgpack header: the CRC fails
    path.write_bytes(bytes(raw))
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert sorted(tier.keys()) == sorted(s.key for s in segs if s is not bad)
        assert tier.stats().corrupt == 1
    (aside,) = (ssd_dir / "quarantine").iterdir()
    assert aside.name.startswith(file_name(bad))
    assert aside.read_bytes() == bytes(raw)


def turn(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (16, 1024), dtype=torch.uint8, generator=g)}


@pytest.mark.parametrize("times", [2, 1000])
async def test_an_unreadable_early_turn_never_costs_the_later_turns(
    tmp_path: Path, times: int
) -> None:
    """Turn 1 of a 4-turn conversation cannot be opened at the cache's open, 2 times (the
    case of issue 22: before, it was quarantined and turns 2 and 3 deleted as a gap) or
    every time (open fails, moving and deleting nothing). Then, with the fault gone, the
    whole conversation loads back exactly, and nothing is in quarantine/."""
    root = tmp_path / "ssd"
    turns = [turn(i) for i in range(4)]

    def cache() -> TieredKVCache:
        return TieredKVCache([HostMemoryTier(1 << 20), SSDTier(root, CAPACITY)], mode="inclusive")

    async with cache() as c:
        for t in turns:
            await c.append("conversation", t, answer_tokens=3)
    second = segment_file_name(("conversation", 1)).split("/")[1]
    with FaultInjector() as faults:
        faults.fail_matching("open", second, times)
        c = cache()
        if times > 10:
            with pytest.raises(TierIOError, match="nothing was moved or deleted"):
                await c.open()
        else:
            await c.open()
            await c.aclose()
        assert faults.injected["open"] == min(times, len(RETRY_DELAYS) + 1)
    async with cache() as c:
        history = await c.load("conversation")
        assert torch.equal(history["kv"], torch.cat([t["kv"] for t in turns]))
    assert quarantined(root) == []


async def test_open_retries_in_a_worker_thread(ssd_dir: Path, seg: SegmentFactory) -> None:
    """The backoff between tries sleeps in the open's worker thread: the event loop keeps
    running (a ticker task advances meanwhile)."""
    segs = await stored(ssd_dir, seg)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.005)

    with FaultInjector() as faults:
        fail_reads_of(faults, "pread", first_scanned(segs), 4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async with SSDTier(ssd_dir, CAPACITY) as tier:
                assert len(list(tier.keys())) == len(segs)
            tg.cancel_scope.cancel()
    assert ticks > 2


async def test_set_aside_names_what_the_last_open_quarantined(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """set_aside(session) lists the turns of that session whose files the last open found
    damaged (matched by file name, the header being garbage), and only the last open's;
    quarantine(key, why) moves one committed file aside byte for byte and forgets it, and
    refuses a key the tier does not hold."""
    segs = await stored(ssd_dir, seg)
    s01 = next(s for s in segs if s.key == ("s0", 1))
    path = ssd_dir / "segments" / segment_file_name(s01.key)
    path.write_bytes(b"\0" * 4096)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert tier.set_aside("s0") == (1,)
        assert tier.set_aside("s1") == ()
        s10 = next(s for s in segs if s.key == ("s1", 0))
        await tier.quarantine(s10.key, "a test moved it")
        assert not tier.contains(s10.key)
        with pytest.raises(KeyError):
            await tier.quarantine(s10.key, "again")
    moved = sorted(p.read_bytes() for p in (ssd_dir / "quarantine").iterdir())
    assert moved == sorted([b"\0" * 4096, s10.data])
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert tier.set_aside("s0") == ()
        assert len(list(tier.keys())) == len(segs) - 2
