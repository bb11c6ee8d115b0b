"""The SSD tier against hostile and unlucky directories: forged headers, symlinked
subdirectories, unreadable headers at open, bad constructor arguments.

Every forged file here has a correct CRC and body hash (:func:`tests.segments.forge`): only
what its header says can give it away.
"""

from __future__ import annotations

import errno
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tests.faults import FaultInjector
from tests.segments import (
    Segment,
    SegmentFactory,
    aligned_buffer,
    forge,
    make_segment,
    read_back,
    store,
)
from tieredkv import HostMemoryTier, MmapTier, SessionNotFoundError, SSDTier, TieredKVCache
from tieredkv.backends.base import SegmentKey, Tier
from tieredkv.backends.ssd import segment_file_name
from tieredkv.errors import (
    CorruptSegmentError,
    InvalidArgumentError,
    InvalidTypeError,
    TieredKVError,
    TierIOError,
)
from tieredkv.payload import SegmentHeader, TensorSpec, parse_header

CAPACITY = 64 << 20


def quarantined(root: Path) -> list[str]:
    """Names of the files in quarantine/, without the timestamp suffix."""
    return sorted(p.name.rsplit(".", 1)[0] for p in (root / "quarantine").iterdir())


def seg_path(root: Path, s: Segment) -> Path:
    return root / "segments" / segment_file_name(s.key)


def spec(s: Segment, i: int = 0, **changes: Any) -> tuple[TensorSpec, ...]:
    """``s``'s tensor specs with tensor ``i``'s fields changed."""
    specs = list(s.header.tensors)
    fields = {f: getattr(specs[i], f) for f in TensorSpec.__struct_fields__}
    specs[i] = TensorSpec(**{**fields, **changes})
    return tuple(specs)


def every_shape(s: Segment, shape: tuple[int, ...]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(t.name, t.dtype, shape, t.offset, t.nbytes) for t in s.header.tensors)


# Lies told by a header with a valid CRC. Each keeps body_len, so the file is exactly as
# long as the header says and the old size check passes.
LIES: dict[str, Callable[[Segment], dict[str, Any]]] = {
    "huge-shape": lambda s: {"tensors": spec(s, shape=(10**12, 64))},
    "huge-tokens": lambda s: {"tokens": 10**12, "tensors": every_shape(s, (10**12, 64))},
    "huge-width": lambda s: {"tensors": every_shape(s, (8, 2**50))},
    "unknown-dtype": lambda s: {"tensors": spec(s, dtype="complex128")},
    "nbytes-too-small": lambda s: {"tensors": spec(s, 1, nbytes=64)},
    "offset-past-body": lambda s: {"tensors": spec(s, 1, offset=s.header.body_len + 64)},
    "overlapping": lambda s: {"tensors": spec(s, 1, offset=0)},
    "token-dim-out-of-range": lambda s: {"token_dim": 7},
    "negative-dimension": lambda s: {"tensors": spec(s, shape=(8, -64))},
    "rank-zero": lambda s: {"tensors": spec(s, shape=())},
    "no-tensors": lambda s: {"tensors": ()},
    "repeated-name": lambda s: {"tensors": spec(s, 1, name="k")},
    "tokens-disagree": lambda s: {"tokens": 9},
    "negative-answer": lambda s: {"answer_tokens": -1},
    "bad-mac-field": lambda s: {"mac": b"x"},
}


@pytest.mark.parametrize("lie", sorted(LIES))
async def test_forged_header_is_quarantined_at_open(
    ssd_dir: Path, seg: SegmentFactory, lie: str
) -> None:
    """A header whose CRC is right but whose contents lie (shapes, dtypes, offsets, token
    counts, version) is found at open, moved to quarantine/ and not indexed; the other
    segments open and read back byte for byte."""
    s, other = seg(session="s", tokens=8, seed=1), seg(session="t", tokens=8, seed=2)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, s)
        await store(tier, other)
    forged = forge(s.data, **LIES[lie](s))
    assert len(forged) == s.length
    with pytest.raises(CorruptSegmentError, match="header is inconsistent"):
        parse_header(forged, "forged", len(forged))  # the CRC passes; the contents do not
    seg_path(ssd_dir, s).write_bytes(forged)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert not tier.contains(s.key)
        assert tier.used == other.length
        assert await read_back(tier, other) == other.data
    assert quarantined(ssd_dir) == [seg_path(ssd_dir, s).name]


async def test_file_swapped_while_open_is_refused(ssd_dir: Path, seg: SegmentFactory) -> None:
    """A segment file replaced while the tier is open by another valid segment of the same
    key and length (an older copy, or a forged one with a consistent header) is refused on
    read and quarantined: the tier serves only the bytes it wrote."""
    s = seg(session="s", tokens=8, seed=1)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, s)
        swapped = forge(s.data, answer_tokens=s.header.answer_tokens + 5)
        parse_header(swapped, "swapped", len(swapped))  # a valid segment
        seg_path(ssd_dir, s).write_bytes(swapped)
        with (
            aligned_buffer(s.length) as out,
            pytest.raises(CorruptSegmentError, match="not the one"),
        ):
            await tier.read([s.key], [out])
        assert not tier.contains(s.key)
    assert quarantined(ssd_dir) == [seg_path(ssd_dir, s).name]


async def test_cache_treats_a_forged_header_as_a_miss(ssd_dir: Path) -> None:
    """Through the cache: a session whose stored header claims 10**12 tokens is quarantined
    at open and is a miss (SessionNotFoundError), never a huge allocation or a bare
    RuntimeError; the other sessions load byte for byte."""
    g = torch.Generator().manual_seed(0)
    turns = {
        name: {"k": torch.randn(8, 4, 16, generator=g), "v": torch.randn(8, 4, 16, generator=g)}
        for name in ("victim", "bystander")
    }

    def tiers() -> list[Tier]:
        return [HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]

    async with TieredKVCache(tiers(), mode="inclusive") as cache:
        for name, kv in turns.items():
            await cache.append(name, kv, answer_tokens=1)
    (path,) = [
        p
        for p in (ssd_dir / "segments").glob("*/*.seg")
        if parse_header(p.read_bytes(), p.name)[0].session == "victim"
    ]
    data = path.read_bytes()
    header, _ = parse_header(data, path.name)
    lie = tuple(
        TensorSpec(t.name, t.dtype, (10**12, 4, 16), t.offset, t.nbytes) for t in header.tensors
    )
    path.write_bytes(forge(data, tokens=10**12, tensors=lie))
    async with TieredKVCache(tiers(), mode="inclusive") as cache:
        with pytest.raises(SessionNotFoundError):
            await cache.load("victim")
        got = await cache.load("bystander")
        for name, t in turns["bystander"].items():
            assert got[name].view(torch.uint8).equal(t.view(torch.uint8))
    assert len(quarantined(ssd_dir)) == 1


# -- symbolic links ----------------------------------------------------------------------


@pytest.mark.parametrize("sub", ["tmp", "segments", "quarantine", "LOCK"])
async def test_symlinked_subdirectory_is_refused(tmp_path: Path, sub: str) -> None:
    """A tmp/, segments/, quarantine/ or LOCK that is a symbolic link fails open() with a
    TierIOError naming it; open() deletes nothing and creates nothing through it (before,
    a tmp/ link made open() delete every file in the link's target)."""
    root, outside = tmp_path / "ssd", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (root / sub).symlink_to(outside / "precious.txt" if sub == "LOCK" else outside)
    with pytest.raises(TierIOError, match="symbolic link") as info:
        await SSDTier(root, CAPACITY).open()
    assert info.value.errno == errno.ELOOP
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"]
    assert (outside / "precious.txt").read_text() == "keep me"


async def test_symlinked_segment_subdirectory_at_open(tmp_path: Path, seg: SegmentFactory) -> None:
    """A segments/xx that is a link to a directory outside, holding a valid segment, is not
    followed: the link is moved to quarantine/ (the link, not its target), the segment is
    not indexed, and the target is untouched."""
    s = seg(session="s", seed=3)
    root, outside = tmp_path / "ssd", tmp_path / "outside"
    outside.mkdir()
    xx, name = segment_file_name(s.key).split("/")
    (outside / name).write_bytes(s.data)
    async with SSDTier(root, CAPACITY):
        pass
    (root / "segments" / xx).symlink_to(outside)
    async with SSDTier(root, CAPACITY) as tier:
        assert not tier.contains(s.key)
        assert tier.used == 0
    (link,) = (root / "quarantine").iterdir()
    assert link.is_symlink()
    assert (outside / name).read_bytes() == s.data


async def test_write_refuses_a_symlinked_segment_subdirectory(
    tmp_path: Path, seg: SegmentFactory
) -> None:
    """A segments/xx link planted while the tier is open: the write fails with TierIOError,
    nothing lands outside, nothing is committed, and the temporary file is gone."""
    s = seg(session="s", seed=4)
    root, outside = tmp_path / "ssd", tmp_path / "outside"
    outside.mkdir()
    xx, _ = segment_file_name(s.key).split("/")
    async with SSDTier(root, CAPACITY) as tier:
        (root / "segments" / xx).symlink_to(outside)
        assert tier.reserve(s.key, s.length)
        with pytest.raises(TierIOError, match="symbolic link"):
            await tier.write(s.key, s.view)
        assert not tier.contains(s.key)
        assert list(outside.iterdir()) == []
        assert list((root / "tmp").iterdir()) == []


async def test_symlinked_segment_file_is_not_followed(tmp_path: Path, seg: SegmentFactory) -> None:
    """A segment file that is a link to a valid segment elsewhere is quarantined at open
    (as a link); its target is untouched."""
    s = seg(session="s", seed=5)
    root, outside = tmp_path / "ssd", tmp_path / "outside"
    outside.mkdir()
    (outside / "copy.seg").write_bytes(s.data)
    async with SSDTier(root, CAPACITY):
        pass
    path = root / "segments" / segment_file_name(s.key)
    path.parent.mkdir()
    path.symlink_to(outside / "copy.seg")
    async with SSDTier(root, CAPACITY) as tier:
        assert not tier.contains(s.key)
    (link,) = (root / "quarantine").iterdir()
    assert link.is_symlink()
    assert (outside / "copy.seg").read_bytes() == s.data


# -- I/O errors at open ------------------------------------------------------------------


async def test_one_io_error_on_a_header_is_retried(ssd_dir: Path, seg: SegmentFactory) -> None:
    """A single EIO reading a header at open is retried: nothing is quarantined."""
    segs = [seg(session=f"s{i}", seed=i) for i in range(3)]
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        for s in segs:
            await store(tier, s)
    with FaultInjector() as faults:
        faults.fail_nth("pread", 1)
        async with SSDTier(ssd_dir, CAPACITY) as tier:
            assert faults.injected == {"pread": 1}
            assert sorted(tier.keys()) == sorted(s.key for s in segs)
    assert quarantined(ssd_dir) == []


async def test_unlistable_directory_at_open_is_tier_io_error(ssd_dir: Path) -> None:
    """An EIO listing the segments directory fails open() with TierIOError (never a bare
    OSError), and a retry once the fault clears opens the tier."""
    with FaultInjector() as faults:
        faults.fail_always("listdir")
        tier = SSDTier(ssd_dir, CAPACITY)
        with pytest.raises(TierIOError, match="scan") as info:
            await tier.open()
        assert info.value.errno == errno.EIO
        faults.clear()
        async with tier:
            assert tier.used == 0


# -- constructor arguments (SSD, host and mmap tiers) ------------------------------------

TIER_MAKERS: dict[str, Callable[..., Tier]] = {
    "ssd": lambda tmp, capacity, **kw: SSDTier(tmp / "ssd", capacity, **kw),
    "host": lambda tmp, capacity, **kw: HostMemoryTier(capacity, **kw),
    "mmap": lambda tmp, capacity, **kw: MmapTier(tmp / "m.mmap", capacity, **kw),
}


@pytest.mark.parametrize("kind", sorted(TIER_MAKERS))
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_threads": 0}, InvalidArgumentError, "max_threads must be from 1"),
        ({"max_threads": -3}, InvalidArgumentError, "max_threads must be from 1"),
        ({"max_threads": 2.0}, InvalidTypeError, "max_threads must be an int"),
        ({"max_threads": True}, InvalidTypeError, "max_threads must be an int"),
        ({"capacity": 1.5e9}, InvalidTypeError, "capacity .bytes. must be an int"),
        ({"capacity": True}, InvalidTypeError, "capacity .bytes. must be an int"),
        ({"capacity": -4096}, InvalidArgumentError, "capacity .bytes. must be from 1"),
        ({"capacity": 0}, InvalidArgumentError, "capacity .bytes. must be from 1"),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "",
)
def test_bad_tier_arguments_fail_at_construction(
    tmp_path: Path, kind: str, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """max_threads of 0 (which made open() wait forever for a thread) or below, and a
    capacity that is a float, a bool or not positive, are refused when the tier is built,
    with a TieredKVError that is also a ValueError or TypeError and names the argument."""
    kwargs = dict(kwargs)  # the parameter is shared by every kind
    capacity = kwargs.pop("capacity", 1 << 20)
    with pytest.raises(error, match=match) as info:
        TIER_MAKERS[kind](tmp_path, capacity, **kwargs)
    assert isinstance(info.value, TieredKVError)
    assert isinstance(info.value, ValueError | TypeError)
    assert not (tmp_path / "ssd").exists()
    assert not (tmp_path / "m.mmap").exists()


# -- authenticated segments --------------------------------------------------------------

SECRET = bytes(range(32))
ZERO16, ZERO32 = bytes(16), bytes(32)


def header_of(path: Path) -> SegmentHeader:
    data = path.read_bytes()
    return parse_header(data, path.name, len(data))[0]


async def test_authenticated_segments_round_trip(ssd_dir: Path, seg: SegmentFactory) -> None:
    """With a secret, each file is the segment with its header's authentication fields set
    (same length, same body bytes); it reads back (header patched, body exact) in this
    process and after a restart; a session's segments share one incarnation."""
    segs = [seg(session="s", seq=i, tokens=100 * (i + 1), seed=i) for i in range(3)]
    async with SSDTier(ssd_dir, CAPACITY, secret=SECRET) as tier:
        assert tier.authenticated
        for s in segs:
            await store(tier, s)
    incarnations = set()
    for s in segs:
        path = seg_path(ssd_dir, s)
        data, header = path.read_bytes(), header_of(path)
        assert len(data) == s.length
        assert header.authenticated
        incarnations.add(header.incarnation)
        start = s.header.body_offset
        assert data[start:] == s.data[start:]
        assert (
            msgspec.structs.replace(header, incarnation=ZERO16, body_mac=ZERO32, mac=ZERO32)
            == s.header
        )
    assert len(incarnations) == 1
    async with SSDTier(ssd_dir, CAPACITY, secret=SECRET) as tier:
        for s in segs:
            got = await read_back(tier, s)
            assert got == seg_path(ssd_dir, s).read_bytes()


async def test_forged_and_foreign_segments_are_refused(ssd_dir: Path, seg: SegmentFactory) -> None:
    """Without the secret nothing passes: a header changed (with a correct CRC) fails its
    MAC at open; a body changed (with a correct xxh3 and CRC) fails its MAC on read; a
    file written without a secret is refused at open. All are quarantined."""
    s_head, s_body, good = (seg(session=n, seed=i) for i, n in enumerate(["h", "b", "g"]))
    plain = seg(session="p", seed=9)
    async with SSDTier(ssd_dir, CAPACITY, secret=SECRET) as tier:
        for s in (s_head, s_body, good):
            await store(tier, s)
    path = seg_path(ssd_dir, s_head)
    path.write_bytes(forge(path.read_bytes(), answer_tokens=77))
    path = seg_path(ssd_dir, s_body)
    raw = bytearray(path.read_bytes())
    raw[s_body.header.body_offset + 10] ^= 0x01
    path.write_bytes(forge(bytes(raw)))  # fresh xxh3 and CRC: only the MAC can tell
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, plain)  # a plain tier on the same directory
        assert tier.contains(s_body.key)  # without the secret the change goes unnoticed
    async with SSDTier(ssd_dir, CAPACITY, secret=SECRET) as tier:
        assert sorted(tier.keys()) == [s_body.key, good.key]
        with (
            aligned_buffer(s_body.length) as out,
            pytest.raises(CorruptSegmentError, match="body MAC"),
        ):
            await tier.read([s_body.key], [out])
        assert await read_back(tier, good) == seg_path(ssd_dir, good).read_bytes()
    assert quarantined(ssd_dir) == sorted(
        seg_path(ssd_dir, s).name for s in (s_head, plain, s_body)
    )


async def test_another_secret_refuses_everything(ssd_dir: Path, seg: SegmentFactory) -> None:
    """Segments written with one secret are all refused by a tier opened with another."""
    segs = [seg(session=f"s{i}", seed=i) for i in range(3)]
    async with SSDTier(ssd_dir, CAPACITY, secret=SECRET) as tier:
        for s in segs:
            await store(tier, s)
    async with SSDTier(ssd_dir, CAPACITY, secret=b"another secret of 32 bytes......") as tier:
        assert tier.used == 0
    assert len(quarantined(ssd_dir)) == 3


async def test_rollback_of_one_segment_is_refused(ssd_dir: Path, seg: SegmentFactory) -> None:
    """A valid, stale copy of one segment (from an earlier residency of its session, saved
    before the session was deleted and stored again) put back among the newer ones: with
    a secret, the whole session is refused at open (two incarnations) and the others
    stay; without one, the stale copy is served (checksums cannot see a rollback)."""
    old = [seg(session="s", seq=i, tokens=40, seed=i) for i in range(3)]
    new = [seg(session="s", seq=i, tokens=40, seed=10 + i) for i in range(3)]
    other = seg(session="t", seed=20)
    for secret in (SECRET, None):
        root = ssd_dir / ("authenticated" if secret else "plain")
        async with SSDTier(root, CAPACITY, secret=secret) as tier:
            for s in old:
                await store(tier, s)
            saved = seg_path(root, old[1]).read_bytes()
            for s in old:
                await tier.delete(s.key)
            for s in [*new, other]:
                await store(tier, s)
        seg_path(root, new[1]).write_bytes(saved)
        async with SSDTier(root, CAPACITY, secret=secret) as tier:
            if secret is None:
                assert await read_back(tier, old[1]) == saved  # the rollback, served
                continue
            assert sorted(tier.keys()) == [other.key]
            assert await read_back(tier, other) == seg_path(root, other).read_bytes()
        assert len(quarantined(root)) == 3


async def test_rollback_while_open_is_refused(ssd_dir: Path, seg: SegmentFactory) -> None:
    """The same stale copy put back while the tier is open is refused on read."""
    s = seg(session="s", seed=1)
    async with SSDTier(ssd_dir, CAPACITY, secret=SECRET) as tier:
        await store(tier, s)
        saved = seg_path(ssd_dir, s).read_bytes()
        await tier.delete(s.key)
        await store(tier, s)  # same bytes, new incarnation
        assert seg_path(ssd_dir, s).read_bytes() != saved
        seg_path(ssd_dir, s).write_bytes(saved)
        with aligned_buffer(s.length) as out, pytest.raises(CorruptSegmentError):
            await tier.read([s.key], [out])


@pytest.mark.parametrize(
    ("secret", "error"),
    [(b"short", InvalidArgumentError), ("a str of more than 16 chars", InvalidTypeError)],
)
def test_bad_secrets_are_refused(tmp_path: Path, secret: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="secret"):
        SSDTier(tmp_path, CAPACITY, secret=secret)


async def test_cache_over_an_authenticated_tier(ssd_dir: Path) -> None:
    """The cache stores, restarts and loads byte for byte over an authenticated tier."""
    g = torch.Generator().manual_seed(0)
    turns = [
        {"k": torch.randn(8, 4, 16, generator=g), "v": torch.randn(8, 4, 16, generator=g)}
        for _ in range(3)
    ]

    def tiers() -> list[Tier]:
        return [HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20, secret=SECRET)]

    async with TieredKVCache(tiers(), mode="inclusive") as cache:
        for t in turns:
            await cache.append("s", t, answer_tokens=1)
    async with TieredKVCache(tiers()) as cache:
        got = await cache.load("s")
    for name in ("k", "v"):
        want = torch.cat([t[name] for t in turns])
        assert got[name].view(torch.uint8).equal(want.view(torch.uint8))


# -- faults during writes and a seeded campaign ------------------------------------------


async def _fail_leaving_the_file(tier: SSDTier, faults: FaultInjector, s: Segment) -> None:
    """Reserve and write ``s`` with the directory fsync after the rename failing (so the
    write is reported as failed) and the unlink that should take the file back failing
    too: the file stays, doomed (removed at close); the reservation is released."""
    faults.fail_nth("fsync", faults.calls["fsync"] + 2)  # the directory's
    faults.fail_nth("unlink", faults.calls["unlink"] + 2)  # after the tmp file's
    assert tier.reserve(s.key, s.length)
    with pytest.raises(TierIOError):
        await tier.write(s.key, s.view)
    tier.release(s.key)


async def test_failed_write_whose_cleanup_fails_leaves_nothing_after_close(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """The directory fsync after the rename fails (so the write is reported as failed) and
    so does the unlink that should take the file back: the tier retries it at close, so a
    restart does not find a segment whose write failed (before, it came back)."""
    s = seg(session="s", seed=1)
    with FaultInjector() as faults:
        async with SSDTier(ssd_dir, CAPACITY) as tier:
            await _fail_leaving_the_file(tier, faults, s)
            assert faults.injected == {"fsync": 1, "unlink": 1}
            assert seg_path(ssd_dir, s).exists()  # still there until the retry
    assert not seg_path(ssd_dir, s).exists()
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert not tier.contains(s.key)


async def test_a_rewrite_cancels_the_pending_removal(ssd_dir: Path, seg: SegmentFactory) -> None:
    """The same failure, then the segment is written again successfully: the retry at close
    must not remove the committed file."""
    s = seg(session="s", seed=2)
    with FaultInjector() as faults:
        async with SSDTier(ssd_dir, CAPACITY) as tier:
            await _fail_leaving_the_file(tier, faults, s)
            await store(tier, s)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert await read_back(tier, s) == s.data


async def test_a_refused_reservation_keeps_the_pending_removal(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """The same failure, then a reservation of the same segment that the budget refuses
    (so no write replaces the leftover file): the removal at close still happens, and a
    restart does not find the segment whose write failed (before, the refused reservation
    dropped the pending removal and the file came back)."""
    s = seg(session="s", seed=3)
    other = seg(session="t", seed=4)
    assert other.length == s.length
    with FaultInjector() as faults:
        async with SSDTier(ssd_dir, 2 * s.length - 4096) as tier:
            await _fail_leaving_the_file(tier, faults, s)
            await store(tier, other)
            assert not tier.reserve(s.key, s.length)  # no room: nothing will rewrite it
            assert seg_path(ssd_dir, s).exists()
    assert not seg_path(ssd_dir, s).exists()
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert not tier.contains(s.key)
        assert await read_back(tier, other) == other.data


@pytest.mark.parametrize(
    "then", ["released", "rewrite fails before its rename", "rewrite fails after its rename"]
)
async def test_a_leftover_file_stays_doomed_until_a_write_of_it_commits(
    ssd_dir: Path, seg: SegmentFactory, then: str
) -> None:
    """The same failure, then the segment is reserved again but no write commits: the
    reservation is released unwritten (an append cancelled before its write), or its write
    fails before the rename (the leftover file stays: the removal at close still happens,
    and a restart does not find the segment whose write failed; before, the new
    reservation dropped the pending removal, and the file stayed, out of the index, and
    came back), or after it (the file that replaced the leftover one is taken back: no
    removal stays pending for a file that is gone)."""
    s = seg(session="s", seed=6)
    with FaultInjector() as faults:
        async with SSDTier(ssd_dir, CAPACITY) as tier:
            await _fail_leaving_the_file(tier, faults, s)
            assert tier.reserve(s.key, s.length)
            if then == "released":
                tier.release(s.key)
            elif then == "rewrite fails before its rename":
                faults.fail_nth("pwrite", faults.calls["pwrite"] + 1)
                with pytest.raises(TierIOError):
                    await tier.write(s.key, s.view)
                tier.release(s.key)
            else:  # renamed over the leftover file, then taken back: nothing is left
                faults.fail_nth("fsync", faults.calls["fsync"] + 2)
                with pytest.raises(TierIOError):
                    await tier.write(s.key, s.view)
                tier.release(s.key)
                assert not seg_path(ssd_dir, s).exists()
                assert tier._writer.doomed == set()  # no removal pending for a gone file
                return
            assert seg_path(ssd_dir, s).exists()  # until the removal at close
    assert not seg_path(ssd_dir, s).exists()
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert not tier.contains(s.key)


async def test_a_file_named_with_a_non_ascii_digit_is_set_aside(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """A ``.seg`` file whose segment number is a digit Python's ``int`` cannot read (``²``)
    is quarantined like any damaged file, and the open goes on (before, it failed with a
    bare ValueError on every open); set_aside names no turn for it."""
    s = seg(session="s", seed=5)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, s)
    junk = seg_path(ssd_dir, s).with_name(seg_path(ssd_dir, s).name.split(".")[0] + ".².seg")
    junk.write_bytes(b"\0" * 4096)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert tier.set_aside("s") == ()
        assert tier.stats().corrupt == 1
        assert await read_back(tier, s) == s.data
    assert not junk.exists()
    assert quarantined(ssd_dir) == [junk.name]


@pytest.mark.parametrize("seed", range(3))
async def test_seeded_fault_campaign(tmp_path: Path, seed: int) -> None:
    """400 random writes, reads, deletes and reopens of one tier with 4% of its os calls
    failing (EIO or ENOSPC): every error is a TierIOError; after each operation (faults
    paused) the tier's index is exactly the segments acknowledged and not deleted (an I/O
    error at a reopen fails that open and moves nothing: no file is ever quarantined);
    every read returns the acknowledged bytes; no file is left outside the index; and a
    final fault-free reopen finds exactly that set."""
    rng = random.Random(seed)
    root = tmp_path / "ssd"
    pool = [
        make_segment(f"s{i}", j, rng.randrange(1, 300), seed=seed * 100 + 10 * i + j)
        for i in range(5)
        for j in range(4)
    ]
    by_key = {s.key: s for s in pool}
    acked: set[SegmentKey] = set()
    counts = {"ops": 0, "tier_errors": 0}

    async def open_tier() -> SSDTier:
        for _ in range(50):
            tier = SSDTier(root, CAPACITY, direct_io=False)
            try:
                await tier.open()
            except TierIOError:
                counts["tier_errors"] += 1
                continue
            return tier
        raise AssertionError("the tier would not open")

    def files() -> set[str]:
        return {str(p.relative_to(root / "segments")) for p in (root / "segments").glob("*/*")}

    try:
        with FaultInjector(seed=seed, rate=0.04, errnos=(errno.EIO, errno.ENOSPC)) as faults:
            tier = await open_tier()
            for _ in range(400):
                s = rng.choice(pool)
                op = rng.choices(["write", "read", "delete", "reopen"], [5, 5, 2, 1])[0]
                counts["ops"] += 1
                try:
                    if op == "write" and not tier.contains(s.key):
                        assert tier.reserve(s.key, s.length)
                        try:
                            await tier.write(s.key, s.view)
                        finally:
                            tier.release(s.key)
                        acked.add(s.key)
                    elif op == "read" and s.key in acked:
                        assert await read_back(tier, s) == s.data
                    elif op == "delete":
                        await tier.delete(s.key)
                        acked.discard(s.key)
                    elif op == "reopen":
                        await tier.aclose()
                        tier = await open_tier()
                except TierIOError:
                    counts["tier_errors"] += 1
                with faults.paused():
                    assert set(tier.keys()) == acked
                    assert files() == {segment_file_name(k) for k in acked}
                    assert list((root / "quarantine").iterdir()) == []
            with faults.paused():
                await tier.aclose()
        async with SSDTier(root, CAPACITY) as tier:
            assert set(tier.keys()) == acked
            for key in acked:
                assert await read_back(tier, by_key[key]) == by_key[key].data
        assert list((root / "quarantine").iterdir()) == []
        assert faults.total_injected > 20
        print(seed, counts, dict(faults.injected))
    finally:
        for s in pool:
            s.close()


async def test_mmap_tier_refuses_a_symlinked_file(tmp_path: Path) -> None:
    """An MmapTier whose path is a symbolic link fails open() with TierIOError and leaves
    the link's target as it was (before, O_TRUNC emptied it); close removes nothing."""
    target = tmp_path / "precious.bin"
    target.write_bytes(b"keep me" * 1000)
    link = tmp_path / "cap.mmap"
    link.symlink_to(target)
    tier = MmapTier(link, 1 << 20)
    with pytest.raises(TierIOError, match="symbolic link"):
        await tier.open()
    assert target.read_bytes() == b"keep me" * 1000
    assert link.is_symlink()
