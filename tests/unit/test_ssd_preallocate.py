"""An O_DIRECT segment file's blocks are reserved whole before its first write
(``posix_fallocate``; see :mod:`tieredkv.backends.ssd.writer`).

Without it ext4 allocated a filled write's blocks in the order its parts were written, the
header's part last: 5 of 16 segments of 8 MiB came out in two to four extents. A
filesystem without ``fallocate`` writes as before; a full disk or an I/O error there fails
the write like any other of its calls, leaving no trace.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import struct
import types
from pathlib import Path
from typing import Any

import pytest

from tests.faults import FaultInjector
from tests.segments import SegmentFactory, read_back, store
from tests.unit.test_ssd_streaming import aligned, cuts_for, planned
from tieredkv import SSDTier
from tieredkv.backends.ssd import segment_file_name, writer
from tieredkv.backends.ssd.layout import pwrite_full
from tieredkv.errors import TierIOError
from tieredkv.payload import ALIGN, PartWriter

CAPACITY = 256 << 20

_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_FLAG_SYNC = 0x1
_FIEMAP = struct.Struct("=QQLLLL")  # start, length, flags, mapped extents, extent count, -


def extents(path: Path) -> int | None:
    """How many extents the filesystem gives ``path`` (``FS_IOC_FIEMAP``), or ``None``
    where it does not say."""
    buf = array.array("B", _FIEMAP.pack(0, 2**64 - 1, _FIEMAP_FLAG_SYNC, 0, 0, 0))
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, _FS_IOC_FIEMAP, buf)
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(_FIEMAP.unpack(buf.tobytes())[3])


class _Recording(types.ModuleType):
    """The writer's ``os``, recording its ``posix_fallocate`` and ``pwrite`` calls in order
    (``(name, fd, offset, length)``)."""

    def __init__(self) -> None:
        super().__init__("os")
        self.calls: list[tuple[str, int, int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def posix_fallocate(self, fd: int, offset: int, length: int) -> None:
        self.calls.append(("posix_fallocate", fd, offset, length))
        os.posix_fallocate(fd, offset, length)


def _record_pwrites(monkeypatch: pytest.MonkeyPatch, rec: _Recording) -> None:
    """The writer's ``pwrite_full`` records each part it writes."""
    real = pwrite_full

    def recorded(fd: int, view: memoryview, at: int) -> None:
        rec.calls.append(("pwrite", fd, at, len(view)))
        real(fd, view, at)

    monkeypatch.setattr(writer, "pwrite_full", recorded)


async def test_a_filled_direct_write_reserves_the_whole_file_before_its_first_part(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment written part by part, header last, gets its whole length reserved in one
    call before any part is written, comes out in one extent, and holds exactly the bytes
    serialized."""
    plan = planned(4)
    cuts = cuts_for(plan, ALIGN)
    assert len(cuts) > 4
    whole = aligned(plan.length)
    plan.write_into(memoryview(whole))
    rec = _Recording()
    monkeypatch.setattr(writer, "os", rec)
    _record_pwrites(monkeypatch, rec)
    key = ("w", 0)
    async with SSDTier(ssd_dir, CAPACITY, direct_io=True) as tier:
        buf = aligned(plan.length)
        view = memoryview(buf)
        assert tier.reserve(key, plan.length)
        await tier.write_filled(key, view, cuts, PartWriter(plan, view, cuts))
        tier.release(key)
    assert rec.calls[0][0] == "posix_fallocate"
    assert rec.calls[0][2:] == (0, plan.length)
    fd = rec.calls[0][1]
    parts = [c for c in rec.calls if c[0] == "pwrite"]
    assert len(parts) == len(cuts) - 1
    assert all(c[1] == fd for c in parts)
    assert sorted(c[2] for c in parts)[0] == 0  # the header's part too (written last)
    assert sum(c[3] for c in parts) == plan.length
    path = ssd_dir / "segments" / segment_file_name(key)
    assert path.read_bytes() == bytes(whole)
    assert path.stat().st_size == plan.length
    got = extents(path)
    if got is not None:
        assert got == 1, f"{got} extents"


async def test_a_buffered_tier_does_not_preallocate(
    ssd_dir: Path, seg: SegmentFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without O_DIRECT the page cache allocates at writeback: no ``posix_fallocate``."""
    rec = _Recording()
    monkeypatch.setattr(writer, "os", rec)
    s = seg(session="b", seq=0, tokens=3000, seed=3)
    async with SSDTier(ssd_dir, CAPACITY, direct_io=False) as tier:
        await store(tier, s)
        assert await read_back(tier, s) == s.data
    assert [c for c in rec.calls if c[0] == "posix_fallocate"] == []


@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.EINVAL])
async def test_a_filesystem_without_fallocate_writes_as_before(
    ssd_dir: Path, seg: SegmentFactory, err: int
) -> None:
    """``posix_fallocate`` refused (no support): the write goes on, byte for byte, and the
    tier does not ask again."""
    a = seg(session="a", seq=0, tokens=3000, seed=1)
    b = seg(session="a", seq=1, tokens=500, seed=2)
    with FaultInjector() as faults:
        async with SSDTier(ssd_dir, CAPACITY, direct_io=True) as tier:
            faults.fail_always("posix_fallocate", err)
            await store(tier, a)
            await store(tier, b)
            assert faults.calls["posix_fallocate"] == 1
            assert await read_back(tier, a) == a.data
            assert await read_back(tier, b) == b.data
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert await read_back(tier, a) == a.data
        assert await read_back(tier, b) == b.data


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
async def test_a_failed_reservation_fails_the_write_and_leaves_no_trace(
    ssd_dir: Path, seg: SegmentFactory, err: int
) -> None:
    """A full disk (or EIO) at ``posix_fallocate``: the write fails with a
    :class:`TierIOError` (naming the full filesystem for ENOSPC), no file is left, an
    earlier segment reads back exactly, and the next write reserves again and succeeds."""
    old = seg(session="s", seq=0, tokens=2000, seed=6)
    s = seg(session="s", seq=1, tokens=2000, seed=7)
    with FaultInjector() as faults:
        async with SSDTier(ssd_dir, CAPACITY, direct_io=True) as tier:
            await store(tier, old)
            faults.fail_nth("posix_fallocate", faults.calls["posix_fallocate"] + 1, err)
            assert tier.reserve(s.key, s.length)
            with pytest.raises(TierIOError) as failed:
                await tier.write(s.key, s.view)
            assert faults.injected == {"posix_fallocate": 1}
            if err == errno.ENOSPC:
                assert "is full" in str(failed.value)
            assert not tier.contains(s.key)
            assert list((ssd_dir / "tmp").iterdir()) == []
            assert not (ssd_dir / "segments" / segment_file_name(s.key)).exists()
            assert await read_back(tier, old) == old.data
            await tier.write(s.key, s.view)  # reserved still; reserved again on disk
            tier.release(s.key)
            assert faults.calls["posix_fallocate"] == 3
            assert await read_back(tier, s) == s.data
    assert (ssd_dir / "segments" / segment_file_name(s.key)).stat().st_size == s.length
