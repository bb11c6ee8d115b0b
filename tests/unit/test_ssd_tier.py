"""SSDTier on a real directory: file layout, hostile keys, restart, damage, locking, faults."""

from __future__ import annotations

import errno
import logging
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tests.segments import (
    SegmentFactory,
    aligned_buffer,
    read_back,
    store,
    unaligned_buffer,
)
from tieredkv.backends import SSDTier
from tieredkv.backends.ssd import segment_file_name
from tieredkv.cli import main
from tieredkv.errors import CorruptSegmentError, TierIOError
from tieredkv.fsck import check_directory
from tieredkv.payload import PREFIX

CAPACITY = 64 << 20
NAME = re.compile(r"[0-9a-f]{2}/[0-9a-f]{32}\.\d+\.seg")


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def segment_files(root: Path) -> list[Path]:
    return sorted((root / "segments").glob("*/*.seg"))


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


# -- layout ------------------------------------------------------------------------------


async def test_files_hold_exactly_the_segment_bytes(ssd_dir: Path, seg: SegmentFactory) -> None:
    """Each segment lands in segments/xx/<32hex>.<seq>.seg, byte-identical to the segment."""
    segs = [
        seg(session=f"user-{i % 2}", seq=i // 2, tokens=100 + 900 * i, seed=i) for i in range(4)
    ]
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        for s in segs:
            await store(tier, s)
        for s in segs:
            rel = segment_file_name(s.key)
            assert NAME.fullmatch(rel)
            assert rel.endswith(f".{s.key[1]}.seg")
            path = ssd_dir / "segments" / rel
            assert path.read_bytes() == s.data
        assert len(segment_files(ssd_dir)) == 4
        assert list((ssd_dir / "tmp").iterdir()) == []
        # the two sessions' files differ in name; one session's files share a prefix
        names = {segment_file_name(s.key).split(".")[0] for s in segs}
        assert len(names) == 2


HOSTILE_KEYS = [
    "../../../etc/passwd",
    "/absolute/path",
    "a/b/c",
    "..",
    ".",
    "nul\x00byte",
    "x" * 10_000,
    "ключ-會話-🔑",
    "trailing space ",
    "back\\slash",
    "\n",
]


async def test_hostile_session_keys_never_escape_the_directory(
    tmp_path: Path, seg: SegmentFactory
) -> None:
    """Keys with '/', '..', NUL, 10 kB of text or non-ASCII stay inside, under hex names,
    and each reads back as written (also after a restart)."""
    root = tmp_path / "box" / "ssd"
    segs = [seg(session=k, seq=i % 2, tokens=8, seed=i) for i, k in enumerate(HOSTILE_KEYS)]
    async with SSDTier(root, CAPACITY) as tier:
        for s in segs:
            await store(tier, s)
        for s in segs:
            assert await read_back(tier, s) == s.data
    everything = sorted(p for p in tmp_path.rglob("*"))
    for p in everything:
        assert p.resolve().is_relative_to(root.resolve()) or p == root.parent, p
    segs_on_disk = segment_files(root)
    assert len(segs_on_disk) == len(HOSTILE_KEYS)
    for p in segs_on_disk:
        assert NAME.fullmatch(f"{p.parent.name}/{p.name}"), p
    assert {p.name for p in root.iterdir()} == {"LOCK", "segments", "tmp", "quarantine"}
    tier = SSDTier(root, CAPACITY)
    headers = await tier.open()
    try:
        assert {(h.session, h.seq) for h in headers} == {s.key for s in segs}
        for s in segs:
            assert await read_back(tier, s) == s.data
    finally:
        await tier.aclose()


# -- restart -----------------------------------------------------------------------------


async def test_restart_rebuilds_the_index(ssd_dir: Path, seg: SegmentFactory) -> None:
    """A new SSDTier on the same directory returns every segment's header from open() and
    serves each byte-identically; used and segments match."""
    segs = [seg(session=f"s{i % 3}", seq=i // 3, tokens=50 + 400 * i, seed=i) for i in range(7)]
    first = SSDTier(ssd_dir, CAPACITY)
    await first.open()
    for s in segs:
        await store(first, s)
    await first.delete(segs[0].key)
    await first.aclose()

    second = SSDTier(ssd_dir, CAPACITY)
    headers = await second.open()
    try:
        kept = segs[1:]
        assert sorted((h.session, h.seq) for h in headers) == sorted(s.key for s in kept)
        by_key = {s.key: s for s in kept}
        for h in headers:
            assert h == by_key[(h.session, h.seq)].header
        assert second.used == sum(s.length for s in kept)
        assert second.stats().segments == len(kept)
        assert not second.contains(segs[0].key)
        for s in kept:
            assert second.length(s.key) == s.length
            assert await read_back(second, s) == s.data
    finally:
        await second.aclose()


async def test_leftover_tmp_files_are_removed_at_open(
    ssd_dir: Path, seg: SegmentFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Temp files of writes interrupted by a crash, and direct-I/O probes, are deleted when
    the tier opens; a file there that the tier does not write is left, with a warning
    (before, every file in tmp/ was deleted, silently)."""
    s = seg(tokens=8)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, s)
    (ssd_dir / "tmp" / "abc.0.seg.123.tmp").write_bytes(s.data[:4096])
    (ssd_dir / "tmp" / "other.tmp").write_bytes(b"partial")
    (ssd_dir / "tmp" / "probe-0123").write_bytes(b"probe")
    (ssd_dir / "tmp" / "notes.txt").write_bytes(b"a user's")
    with caplog.at_level(logging.WARNING, logger="tieredkv"):
        async with SSDTier(ssd_dir, CAPACITY) as tier:
            assert [p.name for p in (ssd_dir / "tmp").iterdir()] == ["notes.txt"]
            assert (ssd_dir / "tmp" / "notes.txt").read_bytes() == b"a user's"
            assert await read_back(tier, s) == s.data
    assert "tmp/notes.txt is not a file this tier writes: left as it is" in caplog.text


async def test_a_new_directory_is_made_durable_before_a_file_in_it(
    ssd_dir: Path, seg: SegmentFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every directory the tier makes (its subdirectories at the first open, a
    segments/xx at a session's first write) has its entry fsynced in its parent before a
    file in it is committed: a crash then cannot lose a committed file's directory on a
    file system that does not journal it. Before, segments/ and the tier's directory were
    never fsynced after a mkdir."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert str(ssd_dir) in synced  # segments/, tmp/ and quarantine/ made
        s = seg(tokens=8)
        synced.clear()
        await store(tier, s)
    sub = ssd_dir / "segments" / segment_file_name(s.key).split("/")[0]
    assert synced.index(str(ssd_dir / "segments")) < synced.index(str(sub))


async def test_a_directory_of_another_format_version_is_refused_not_emptied(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """A segment whose header checks but says format version 2 (a newer tieredkv wrote
    it): the tier's open is refused naming the version, and fsck reports the file as
    unreadable, which --repair leaves; nothing is moved. Before, the open took it for
    damage, moved it to quarantine/ and opened empty."""
    s = seg(tokens=8)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, s)
    path = ssd_dir / "segments" / segment_file_name(s.key)
    raw = bytearray(path.read_bytes())
    magic, hlen, _, body_hash = PREFIX.unpack_from(raw, 0)
    header = msgspec.msgpack.decode(bytes(raw[PREFIX.size : PREFIX.size + hlen]))
    header["version"] = 2
    encoded = msgspec.msgpack.encode(header)
    assert len(encoded) == hlen
    crc = zlib.crc32(encoded + body_hash.to_bytes(8, "little"))
    PREFIX.pack_into(raw, 0, magic, hlen, crc, body_hash)
    raw[PREFIX.size : PREFIX.size + hlen] = encoded
    path.write_bytes(bytes(raw))
    with pytest.raises(TierIOError, match="written in format version 2, which this tieredkv"):
        async with SSDTier(ssd_dir, CAPACITY):
            pass
    report = await anyio.to_thread.run_sync(check_directory, ssd_dir)
    assert [d.path for d in report.unreadable] == [f"segments/{segment_file_name(s.key)}"]
    assert report.damaged == []
    assert await anyio.to_thread.run_sync(main, ["fsck", "--repair", str(ssd_dir)]) == 1
    assert path.read_bytes() == bytes(raw)
    assert list((ssd_dir / "quarantine").iterdir()) == []


# -- damage ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "directory"])
async def test_a_fifo_or_directory_named_like_a_segment_is_set_aside_at_open(
    ssd_dir: Path, seg: SegmentFactory, kind: str
) -> None:
    """A FIFO (or a directory) under segments/ with a segment's name: the open sets it
    aside in quarantine/ as damage and serves the rest, and fsck reports it, both without
    waiting. Before, opening the FIFO waited for a writer forever (the tier's open and
    fsck hung), and a directory failed every open as unreadable."""
    good = seg(seq=0, tokens=8)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, good)
    odd = ssd_dir / "segments" / segment_file_name(("intruder", 0))
    odd.parent.mkdir(exist_ok=True)
    if kind == "fifo":
        os.mkfifo(odd)
    else:
        odd.mkdir()
    report = await anyio.to_thread.run_sync(check_directory, ssd_dir)
    assert [d.problem for d in report.damaged] == [
        "not a regular file (a tier writes nothing else under segments/)"
    ]
    with anyio.fail_after(10):
        async with SSDTier(ssd_dir, CAPACITY) as tier:
            assert await read_back(tier, good) == good.data
    assert not odd.exists()
    assert len(list((ssd_dir / "quarantine").iterdir())) == 1


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
async def test_flipped_body_byte_is_detected_and_quarantined(
    ssd_dir: Path, seg: SegmentFactory, direct_io: bool
) -> None:
    """A flipped byte in the body: read raises CorruptSegmentError, the file moves to
    quarantine/, the key is gone, used drops; other segments are unaffected."""
    bad, good = seg(seq=0, tokens=5000, seed=1), seg(seq=1, tokens=5000, seed=2)
    async with SSDTier(ssd_dir, CAPACITY, direct_io=direct_io) as tier:
        await store(tier, bad)
        await store(tier, good)
        path = ssd_dir / "segments" / segment_file_name(bad.key)
        flip_byte(path, bad.header.body_offset + bad.header.body_len - 3)
        with aligned_buffer(bad.length) as out, pytest.raises(CorruptSegmentError, match="body"):
            await tier.read([bad.key], [out])
        assert not tier.contains(bad.key)
        assert tier.used == good.length
        assert tier.stats().corrupt == 1
        assert tier.stats().segments == 1
        assert not path.exists()
        quarantined = list((ssd_dir / "quarantine").iterdir())
        assert len(quarantined) == 1
        assert quarantined[0].name.startswith(path.name)
        with aligned_buffer(bad.length) as out, pytest.raises(KeyError):
            await tier.read([bad.key], [out])
        assert await read_back(tier, good) == good.data
    async with SSDTier(ssd_dir, CAPACITY) as tier:  # nor does it come back after a restart
        assert not tier.contains(bad.key)
        assert tier.contains(good.key)


@pytest.mark.parametrize(
    "where", ["hash field", "header", "gap before body", "body", "tail padding"]
)
@pytest.mark.parametrize("chunk_size", [4096, 8 << 20], ids=["pipelined chunks", "one read"])
async def test_a_flipped_byte_anywhere_is_detected(
    ssd_dir: Path, seg: SegmentFactory, where: str, chunk_size: int
) -> None:
    """Every byte of a segment file is covered: the prefix and header by the CRC, everything
    after the header (padding included) by the xxh3 hash; on both read paths (a segment
    larger than a chunk is read in pipelined chunks, a smaller one in one call)."""
    s = seg(tokens=40, seed=5)  # its body ends well before the last 4 KiB page's end
    assert s.length > 4096
    h = s.header
    offsets = {
        "hash field": 20,
        "header": 30,
        "gap before body": h.body_offset - 1,
        "body": h.body_offset + 1,
        "tail padding": s.length - 1,
    }
    assert h.body_offset + h.body_len < s.length - 1
    async with SSDTier(ssd_dir, CAPACITY, chunk_size=chunk_size) as tier:
        await store(tier, s)
        flip_byte(ssd_dir / "segments" / segment_file_name(s.key), offsets[where])
        with aligned_buffer(s.length) as out, pytest.raises(CorruptSegmentError):
            await tier.read([s.key], [out])
        assert not tier.contains(s.key)


async def test_flipped_body_byte_with_unaligned_buffer(ssd_dir: Path, seg: SegmentFactory) -> None:
    """Damage found while reading through the O_DIRECT bounce buffer is still a clean
    CorruptSegmentError (the bounce buffer is freed, nothing else is raised)."""
    s = seg(tokens=5000, seed=3)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, s)
        flip_byte(ssd_dir / "segments" / segment_file_name(s.key), s.header.body_offset + 10)
        with unaligned_buffer(s.length) as out, pytest.raises(CorruptSegmentError):
            await tier.read([s.key], [out])
        assert not tier.contains(s.key)


@pytest.mark.parametrize("chunk_size", [4096, 8 << 20])
async def test_truncated_file_while_open_is_corrupt(
    ssd_dir: Path, seg: SegmentFactory, chunk_size: int
) -> None:
    """A file truncated behind the tier's back is reported corrupt (not served, not an I/O
    error) and quarantined, whatever the read chunking."""
    s = seg(tokens=5000, seed=4)
    async with SSDTier(ssd_dir, CAPACITY, chunk_size=chunk_size) as tier:
        await store(tier, s)
        os.truncate(ssd_dir / "segments" / segment_file_name(s.key), s.length - 8192)
        with aligned_buffer(s.length) as out, pytest.raises(CorruptSegmentError, match="trunc"):
            await tier.read([s.key], [out])
        assert not tier.contains(s.key)
        assert tier.used == 0


@pytest.mark.parametrize(
    "damage",
    ["header-byte", "magic", "truncated", "empty", "extended"],
)
async def test_damaged_files_are_not_recovered_at_open(
    ssd_dir: Path, seg: SegmentFactory, damage: str
) -> None:
    """A flipped header byte, a bad magic, or a file of the wrong size is quarantined at
    open, not returned; intact neighbours are."""
    bad, good = seg(seq=0, tokens=3000, seed=5), seg(seq=1, tokens=300, seed=6)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, bad)
        await store(tier, good)
    path = ssd_dir / "segments" / segment_file_name(bad.key)
    if damage == "header-byte":
        flip_byte(path, 30)
    elif damage == "magic":
        flip_byte(path, 0)
    elif damage == "truncated":
        os.truncate(path, bad.length - 4096)
    elif damage == "empty":
        os.truncate(path, 0)
    else:
        os.truncate(path, bad.length + 4096)
    tier = SSDTier(ssd_dir, CAPACITY)
    headers = await tier.open()
    try:
        assert [(h.session, h.seq) for h in headers] == [good.key]
        assert not tier.contains(bad.key)
        assert tier.used == good.length
        assert not path.exists()
        assert len(list((ssd_dir / "quarantine").iterdir())) == 1
        assert await read_back(tier, good) == good.data
    finally:
        await tier.aclose()


async def test_file_renamed_to_another_key_is_not_served(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """A segment file put under another key's name is never served as that key: rejected
    on read while open, and quarantined at the next open."""
    a, b = seg(session="alice", seq=0, tokens=300, seed=7), seg(session="bob", seq=0, tokens=300)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, a)
        await store(tier, b)
        pa = ssd_dir / "segments" / segment_file_name(a.key)
        pb = ssd_dir / "segments" / segment_file_name(b.key)
        os.replace(pa, pb)  # bob's name, alice's bytes
        with aligned_buffer(b.length) as out, pytest.raises(CorruptSegmentError):
            await tier.read([b.key], [out])
        assert not tier.contains(b.key)
    # at restart: alice's data under seq 1 of alice's own hash (a plausible mix-up)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, a)
    wrong = ssd_dir / "segments" / segment_file_name(("alice", 1))
    os.replace(ssd_dir / "segments" / segment_file_name(a.key), wrong)
    tier = SSDTier(ssd_dir, CAPACITY)
    headers = await tier.open()
    try:
        assert headers == []
        assert not tier.contains(("alice", 1))
        assert not tier.contains(a.key)
        assert not wrong.exists()
        assert tier.used == 0
    finally:
        await tier.aclose()


# -- opening -----------------------------------------------------------------------------


async def test_directory_under_a_regular_file_is_refused(tmp_path: Path) -> None:
    """A directory that cannot be created (its parent is a file) fails open() with
    TierIOError naming the directory and what to do."""
    (tmp_path / "afile").write_text("not a directory")
    tier = SSDTier(tmp_path / "afile" / "ssd", CAPACITY)
    with pytest.raises(TierIOError, match="writable directory") as info:
        await tier.open()
    assert "afile" in str(info.value)
    assert info.value.errno == errno.ENOTDIR
    with pytest.raises(Exception, match="not open"):
        tier.reserve(("s", 0), 4096)


async def test_read_only_directory_is_refused(ssd_dir: Path) -> None:
    """A directory the process may not write fails open() with TierIOError."""
    os.chmod(ssd_dir, 0o500)
    try:
        if os.access(ssd_dir, os.W_OK):
            pytest.skip("running with privileges that bypass directory permissions (root)")
        with pytest.raises(TierIOError, match="writable"):
            await SSDTier(ssd_dir / "tier", CAPACITY).open()
    finally:
        os.chmod(ssd_dir, 0o700)


async def test_second_tier_on_the_same_directory_is_refused(ssd_dir: Path) -> None:
    """While one SSDTier has a directory open, a second one fails with TierIOError (flock);
    after the first closes, the second can open."""
    first = SSDTier(ssd_dir, CAPACITY)
    await first.open()
    try:
        with pytest.raises(TierIOError, match="another SSDTier has this directory open"):
            await SSDTier(ssd_dir, CAPACITY).open()
    finally:
        await first.aclose()
    async with SSDTier(ssd_dir, CAPACITY) as second:
        assert second.used == 0


# -- write faults ------------------------------------------------------------------------


def failing(real: Callable[..., Any], err: int, *, after: int = 0) -> Callable[..., Any]:
    """Wrap ``real``: the call number ``after`` (0-based) and later raise OSError(err)."""
    calls = [0]

    def fn(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            del args  # the traceback keeps this frame: it must not pin the caller's buffers
            raise OSError(err, os.strerror(err))
        return real(*args)

    return fn


@pytest.mark.parametrize(
    ("call", "err", "after"),
    [
        ("pwrite", errno.ENOSPC, 0),
        ("pwrite", errno.EIO, 0),
        ("fsync", errno.EIO, 0),
        ("fsync", errno.ENOSPC, 1),  # the file's fsync passes, the directory's fails
    ],
    ids=["pwrite-ENOSPC", "pwrite-EIO", "fsync-EIO", "dir-fsync-ENOSPC"],
)
@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
async def test_write_fault_commits_nothing(
    ssd_dir: Path,
    seg: SegmentFactory,
    monkeypatch: pytest.MonkeyPatch,
    call: str,
    err: int,
    after: int,
    direct_io: bool,
) -> None:
    """Disk full or I/O error while writing: TierIOError with that errno, no temp file, no
    segment file, nothing committed, the reservation still releasable, earlier segments
    still readable byte-exactly; and after the fault clears, the write succeeds."""
    old, new = seg(seq=0, tokens=2000, seed=8), seg(seq=1, tokens=6000, seed=9)
    async with SSDTier(ssd_dir, CAPACITY, direct_io=direct_io) as tier:
        await store(tier, old)
        real = getattr(os, call)
        monkeypatch.setattr(os, call, failing(real, err, after=after))
        assert tier.reserve(new.key, new.length)
        with pytest.raises(TierIOError) as info:
            await tier.write(new.key, new.view)
        monkeypatch.setattr(os, call, real)
        assert info.value.errno == err
        assert isinstance(info.value, OSError)
        assert list((ssd_dir / "tmp").iterdir()) == []
        assert not (ssd_dir / "segments" / segment_file_name(new.key)).exists()
        assert not tier.contains(new.key)
        assert tier.stats().writes == 1
        assert tier.used == old.length + new.length
        tier.release(new.key)
        assert tier.used == old.length
        assert await read_back(tier, old) == old.data
        await store(tier, new)
        assert await read_back(tier, new) == new.data
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert tier.contains(old.key)
        assert tier.contains(new.key)


async def test_read_io_error_is_tier_io_error(
    ssd_dir: Path, seg: SegmentFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EIO while reading is a TierIOError (not corruption): the segment stays indexed and
    reads fine once the device recovers."""
    s = seg(tokens=3000, seed=10)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, s)
        real = os.preadv
        monkeypatch.setattr(os, "preadv", failing(real, errno.EIO))
        with aligned_buffer(s.length) as out, pytest.raises(TierIOError) as info:
            await tier.read([s.key], [out])
        monkeypatch.setattr(os, "preadv", real)
        assert info.value.errno == errno.EIO
        assert tier.contains(s.key)
        assert tier.stats().corrupt == 0
        assert await read_back(tier, s) == s.data


# -- O_DIRECT ----------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [8, 1200, 40_000])
async def test_unaligned_buffers_work_with_o_direct(
    ssd_dir: Path, seg: SegmentFactory, tokens: int
) -> None:
    """Writing from and reading into buffers that are not page-aligned (the bounce path)
    stores and returns the exact bytes."""
    s = seg(tokens=tokens, seed=tokens)
    async with SSDTier(ssd_dir, CAPACITY, direct_io=True) as tier:
        assert tier.direct_io
        with unaligned_buffer(s.length) as src:
            src[:] = s.view
            assert tier.reserve(s.key, s.length)
            await tier.write(s.key, src)
        assert (ssd_dir / "segments" / segment_file_name(s.key)).read_bytes() == s.data
        with unaligned_buffer(s.length) as out:
            await tier.read([s.key], [out])
            assert bytes(out) == s.data
        out_b = bytearray(s.length)  # heap memory: no alignment guarantee at all
        await tier.read([s.key], [memoryview(out_b)])
        assert bytes(out_b) == s.data


@pytest.mark.parametrize("chunk_size", [4096, 12288, 1 << 20])
async def test_small_read_chunks_and_long_headers(
    ssd_dir: Path, seg: SegmentFactory, chunk_size: int
) -> None:
    """Chunk sizes smaller than the header (a 10 kB key) or not dividing the segment still
    read back byte-exactly and verify."""
    s = seg(session="k" * 10_000, seq=3, tokens=9000, seed=12)
    async with SSDTier(ssd_dir, CAPACITY, chunk_size=chunk_size) as tier:
        await store(tier, s)
        assert await read_back(tier, s) == s.data
        end = s.header.body_offset + s.header.body_len
        flip_byte(ssd_dir / "segments" / segment_file_name(s.key), end - 1)
        with aligned_buffer(s.length) as out, pytest.raises(CorruptSegmentError, match="body"):
            await tier.read([s.key], [out])


def test_bad_constructor_arguments_are_refused(tmp_path: Path) -> None:
    """Empty name, non-positive capacity and unaligned chunk sizes raise ValueError."""
    with pytest.raises(ValueError, match="name"):
        SSDTier(tmp_path, CAPACITY, name="")
    with pytest.raises(ValueError, match="capacity"):
        SSDTier(tmp_path, 0)
    with pytest.raises(ValueError, match="chunk_size"):
        SSDTier(tmp_path, CAPACITY, chunk_size=1000)


async def test_reserve_of_unaligned_length_is_refused(ssd_dir: Path) -> None:
    """Segment lengths are multiples of 4096; anything else is a ValueError."""
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        with pytest.raises(ValueError, match="multiple"):
            tier.reserve(("s", 0), 1000)
        assert tier.used == 0


async def test_a_history_read_in_one_call_is_in_order_and_stops_at_damage(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """A history read in one call: every segment byte-exact; a damaged one in the middle
    stops the read there (the ones before it are complete), is quarantined and raised, and
    the ones after it stay in service."""
    segs = [seg(seq=i, tokens=300 + i, seed=i) for i in range(3)]
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        for s in segs:
            await store(tier, s)
        with aligned_buffer(sum(s.length for s in segs)) as out:
            views, at = [], 0
            for s in segs:
                views.append(out[at : at + s.length])
                at += s.length
            await tier.read([s.key for s in segs], views)
            assert [bytes(v) for v in views] == [s.data for s in segs]
            assert tier.stats().reads == 3
            flip_byte(ssd_dir / "segments" / segment_file_name(segs[1].key), 5000)
            for v in views:
                v[:] = bytes(len(v))
            with pytest.raises(CorruptSegmentError):
                await tier.read([s.key for s in segs], views)
            assert bytes(views[0]) == segs[0].data
            for v in views:
                v.release()
        assert not tier.contains(segs[1].key)
        assert tier.contains(segs[2].key)
        assert await read_back(tier, segs[2]) == segs[2].data
        assert tier.stats().corrupt == 1
