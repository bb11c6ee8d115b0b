"""TieredKVCache through its public API: round trips, placement, events, bad input, faults."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tieredkv import (
    LRU,
    CapacityError,
    ClosedError,
    HostMemoryTier,
    InvalidArgumentError,
    InvalidTypeError,
    MmapTier,
    SchemaMismatchError,
    SessionNotFoundError,
    SSDTier,
    TieredKVCache,
    TierIOError,
)
from tieredkv.meta import Demoted, Dropped, Event, Loaded, Promoted, Stored

KIB = 1024


def kv(
    tokens: int, seed: int, *, dtype: torch.dtype = torch.float16, width: int = 64
) -> dict[str, torch.Tensor]:
    """A turn's KV: two tensors of ``tokens`` x 4 x ``width`` (token dimension 0)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(tokens, 4, width, generator=g).to(dtype),
        "v": torch.randn(tokens, 4, width, generator=g).to(dtype),
    }


def joined(turns: list[dict[str, torch.Tensor]], dim: int = 0) -> dict[str, torch.Tensor]:
    return {name: torch.cat([t[name] for t in turns], dim=dim) for name in turns[0]}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype
        assert a[name].shape == b[name].shape
        # byte-identical, not merely close
        assert a[name].contiguous().view(torch.uint8).equal(b[name].contiguous().view(torch.uint8))


@pytest.fixture
async def cache(ssd_dir: Path) -> AsyncIterator[TieredKVCache]:
    """Host tier of 64 KiB (about five 8-token turns) over a 4 MiB SSD tier."""
    async with TieredKVCache([HostMemoryTier(64 * KIB), SSDTier(ssd_dir, 4 << 20)]) as c:
        yield c


async def test_round_trip_is_byte_identical_across_dtypes(ssd_dir: Path) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        for i, dtype in enumerate(
            [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.bool]
        ):
            turns = [kv(3 + t, seed=10 * i + t, dtype=dtype) for t in range(3)]
            for t, turn in enumerate(turns):
                await c.append(f"s{i}", turn, answer_tokens=t)
            assert_same(await c.load(f"s{i}"), joined(turns))


async def test_strided_views_are_stored_byte_identical(ssd_dir: Path) -> None:
    """Non-contiguous tensors (a model cache's slice, a transpose, a stepped slice, a
    broadcast) are stored exactly, in every tier: write_into copies them strided."""
    g = torch.Generator().manual_seed(3)
    buffer = torch.randn(4, 40, 16, generator=g)  # [heads, capacity, head_dim]
    turns = [
        {
            "sliced": buffer[:, 0:7],
            "transposed": torch.randn(16, 7, 4, generator=g).transpose(0, 2),
            "stepped": torch.randn(4, 14, 32, generator=g)[:, ::2, ::2],
            "broadcast": torch.randn(4, 1, 16, generator=g).expand(4, 7, 16),
        },
        {
            "sliced": buffer[:, 7:12],
            "transposed": torch.randn(16, 5, 4, generator=g).transpose(0, 2),
            "stepped": torch.randn(4, 10, 32, generator=g)[:, ::2, ::2],
            "broadcast": torch.randn(4, 1, 16, generator=g).expand(4, 5, 16),
        },
    ]
    assert not any(t.is_contiguous() for turn in turns for t in turn.values())
    expected = {name: torch.cat([t[name] for t in turns], dim=1) for name in turns[0]}
    for tiers in ([HostMemoryTier(1 << 20)], [SSDTier(ssd_dir, 8 << 20)]):
        async with TieredKVCache(tiers, token_dim=1) as c:
            for turn in turns:
                await c.append("s", turn, answer_tokens=1)
            assert_same(await c.load("s"), expected)
            await c.drop("s")


async def test_numpy_input_and_token_dim_minus_two(ssd_dir: Path) -> None:
    """Hugging Face layout [batch, heads, tokens, head_dim]: token_dim=-2; numpy arrays accepted."""
    rng = np.random.default_rng(0)
    turns = [{"k": rng.standard_normal((1, 2, n, 8), dtype=np.float32)} for n in (5, 1, 3)]
    async with TieredKVCache([HostMemoryTier(1 << 20)], token_dim=-2) as c:
        for turn in turns:
            await c.append("hf", turn, answer_tokens=1)
        out = await c.load("hf")
    expected = np.concatenate([t["k"] for t in turns], axis=2)
    assert out["k"].shape == (1, 2, 9, 8)
    assert np.array_equal(out["k"].numpy(), expected)


async def test_load_into_fills_a_larger_preallocated_buffer(cache: TieredKVCache) -> None:
    turns = [kv(4, 1), kv(2, 2)]
    for turn in turns:
        await cache.append("a", turn, answer_tokens=2)
    out = {name: torch.full((10, 4, 64), 7.0, dtype=torch.float16) for name in ("k", "v")}
    assert await cache.load_into("a", out) == 6
    expected = joined(turns)
    for name in out:
        assert torch.equal(out[name][:6], expected[name])
        assert torch.all(out[name][6:] == 7.0)


async def test_load_into_rejects_a_buffer_that_does_not_fit(cache: TieredKVCache) -> None:
    await cache.append("a", kv(4, 1), answer_tokens=2)
    wrong = [
        {"k": torch.empty(4, 4, 64, dtype=torch.float16)},  # a name missing
        {n: torch.empty(4, 4, 64, dtype=torch.float32) for n in ("k", "v")},  # dtype
        {n: torch.empty(4, 4, 32, dtype=torch.float16) for n in ("k", "v")},  # shape
        {n: torch.empty(3, 4, 64, dtype=torch.float16) for n in ("k", "v")},  # too short
    ]
    for out in wrong:
        with pytest.raises(ValueError, match="out"):
            await cache.load_into("a", out)
    assert cache.where("a") == "host"


async def test_lru_demotes_to_ssd_and_load_promotes_back(cache: TieredKVCache) -> None:
    for i in range(8):  # 8 sessions of 8 KiB + header in a 64 KiB host tier
        await cache.append(f"s{i}", kv(8, i), answer_tokens=i)
    assert cache.where("s0") == "ssd"  # least recently used went down
    assert cache.where("s7") == "host"
    stats = cache.stats()
    assert stats.demotions >= 1
    assert stats.tiers[0].used <= stats.tiers[0].capacity
    assert_same(await cache.load("s0"), kv(8, 0))
    assert cache.where("s0") == "host"
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.promotions) == (0, 1, 1)
    await cache.load("s0")
    assert cache.stats().hits == 1


async def test_metadata_channel_tracks_location_size_and_answer_length(
    cache: TieredKVCache,
) -> None:
    await cache.append("a", kv(4, 1), answer_tokens=30)
    meta = await cache.append("a", kv(2, 2), answer_tokens=45)
    assert meta is cache.channel.get("a")
    assert (meta.tier, meta.tokens, meta.turns, meta.prev_answer_tokens) == ("host", 6, 2, 45)
    assert meta.nbytes == cache.stats().tiers[0].used
    assert meta.copies == ("host",)
    assert meta.in_flight is None
    assert [t.name for t in cache.channel.tiers] == ["host", "ssd"]


async def test_the_channel_tells_what_the_latest_turn_added(ssd_dir: Path) -> None:
    """``turn_tokens`` is the latest append's tokens (its new input and its answer): set by
    each append, kept by loads, found again by a cache opened over what was stored, and a
    fork's is its own first turn."""
    async with TieredKVCache([SSDTier(ssd_dir, 4 << 20)]) as c:
        assert (await c.append("a", kv(5, 1), answer_tokens=2)).turn_tokens == 5
        assert (await c.append("a", kv(3, 2), answer_tokens=1)).turn_tokens == 3
        await c.load("a")
        assert (c.channel["a"].turn_tokens, c.channel["a"].tokens) == (3, 8)
        fork = await c.append("f", kv(2, 3), answer_tokens=1, parent="a", parent_tokens=6)
        assert (fork.turn_tokens, fork.tokens) == (2, 8)
    async with TieredKVCache([SSDTier(ssd_dir, 4 << 20)]) as c:
        assert (c.channel["a"].turn_tokens, c.channel["a"].prev_answer_tokens) == (3, 1)
        assert c.channel["f"].turn_tokens == 2


async def test_events_follow_the_life_of_a_session(cache: TieredKVCache) -> None:
    events: list[Event] = []
    unsubscribe = cache.channel.subscribe(events.append)
    await cache.append("a", kv(8, 1), answer_tokens=1)
    for i in range(8):
        await cache.append(f"other{i}", kv(8, i), answer_tokens=1)
    await cache.load("a")
    await cache.drop("a")
    unsubscribe()
    mine = [type(e) for e in events if e.session == "a"]
    assert mine == [Stored, Demoted, Promoted, Loaded, Dropped]
    assert "a" not in cache.channel


async def test_prefetch_promotes_without_counting_a_load(cache: TieredKVCache) -> None:
    for i in range(8):
        await cache.append(f"s{i}", kv(8, i), answer_tokens=1)
    assert cache.where("s0") == "ssd"
    assert await cache.prefetch("s0") == "host"
    stats = cache.stats()
    assert (stats.prefetches, stats.loads, stats.promotions) == (1, 0, 1)
    await cache.load("s0")
    assert cache.stats().hits == 1


async def test_drop_deletes_every_copy(cache: TieredKVCache, ssd_dir: Path) -> None:
    for i in range(8):
        await cache.append(f"s{i}", kv(8, i), answer_tokens=1)
    assert cache.where("s0") == "ssd"
    await cache.drop("s0")
    assert not cache.contains("s0")
    assert cache.where("s0") is None
    files = list((ssd_dir / "segments").glob("*/*.seg"))
    assert files  # other sessions are still there
    assert all(_header_session(p) != "s0" for p in files)
    await cache.drop("s7")
    with pytest.raises(SessionNotFoundError):
        await cache.drop("s7")


# -- bad input ---------------------------------------------------------------------------


async def test_unknown_session_is_a_keyerror(cache: TieredKVCache) -> None:
    for op in (cache.load, cache.prefetch, cache.drop):
        with pytest.raises(KeyError, match="no KV in any tier"):
            await op("nobody")
    with pytest.raises(SessionNotFoundError):
        await cache.load_into("nobody", {})


async def test_segment_larger_than_every_tier_is_a_capacity_error(cache: TieredKVCache) -> None:
    huge = {"k": torch.zeros(5 << 20, dtype=torch.uint8)}  # 5 MiB > 4 MiB SSD
    with pytest.raises(CapacityError, match="largest tier holds"):
        await cache.append("big", huge, answer_tokens=1)
    assert not cache.contains("big")
    assert "big" not in cache.channel
    assert [t.used for t in cache.stats().tiers] == [0, 0]


async def test_segment_too_big_for_memory_goes_to_ssd(cache: TieredKVCache) -> None:
    big = {"k": torch.arange(100 * KIB, dtype=torch.uint8).reshape(100, KIB)}
    await cache.append("big", big, answer_tokens=1)
    assert cache.where("big") == "ssd"
    assert_same(await cache.load("big"), big)  # served from SSD, never promoted
    assert cache.where("big") == "ssd"
    assert cache.stats().misses == 1


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (
            {
                "k": torch.zeros(2, 4, 64, dtype=torch.float32),
                "v": torch.zeros(2, 4, 64, dtype=torch.float16),
            },
            "dtype",
        ),
        ({"k": torch.zeros(2, 4, 64, dtype=torch.float16)}, "names"),
        (
            {
                "k": torch.zeros(2, 4, 32, dtype=torch.float16),
                "v": torch.zeros(2, 4, 32, dtype=torch.float16),
            },
            "non-token shape",
        ),
        (
            {
                "v": torch.zeros(2, 4, 64, dtype=torch.float16),
                "k": torch.zeros(2, 4, 64, dtype=torch.float16),
            },
            "names",
        ),
    ],
)
async def test_schema_mismatch_leaves_the_session_untouched(
    cache: TieredKVCache, second: dict[str, torch.Tensor], message: str
) -> None:
    first = kv(3, 1)
    await cache.append("a", first, answer_tokens=5)
    with pytest.raises(SchemaMismatchError, match=message):
        await cache.append("a", second, answer_tokens=9)
    meta = cache.channel["a"]
    assert (meta.turns, meta.tokens, meta.prev_answer_tokens) == (1, 3, 5)
    assert_same(await cache.load("a"), first)


@pytest.mark.parametrize(
    ("tensors", "kwargs", "error", "message"),
    [
        ([1, 2], {}, ValueError, "mapping"),
        ({}, {}, ValueError, "non-empty"),
        ({"k": [1.0, 2.0]}, {}, TypeError, "torch tensors or numpy"),
        ({"k": torch.zeros(())}, {}, ValueError, "scalar"),
        ({"k": torch.zeros(0, 3)}, {}, ValueError, "0 tokens"),
        ({"k": torch.zeros(2, 3), "v": torch.zeros(3, 3)}, {}, ValueError, "tokens"),
        ({"k": torch.zeros(2, 3, dtype=torch.complex64)}, {}, TypeError, "cannot store"),
        ({"k": torch.zeros(2, 3)}, {"token_dim": 5}, ValueError, "out of range"),
    ],
)
async def test_bad_tensors_get_a_clear_error_and_store_nothing(
    cache: TieredKVCache, tensors: Any, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        await cache.append("a", tensors, answer_tokens=1, **kwargs)
    assert not cache.contains("a")
    assert "a" not in cache.channel


@pytest.mark.parametrize(
    ("session", "answer", "error"),
    [
        ("", 1, ValueError),
        (b"bytes", 1, TypeError),
        ("bad\ud800", 1, ValueError),
        ("a", -1, ValueError),
        ("a", 1.5, ValueError),
    ],
)
async def test_bad_keys_and_answer_lengths(
    cache: TieredKVCache, session: Any, answer: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        await cache.append(session, kv(1, 1), answer_tokens=answer)
    assert cache.sessions() == []


async def test_hostile_session_keys_stay_inside_the_directory(
    cache: TieredKVCache, ssd_dir: Path
) -> None:
    keys = ["a/b", "../../etc/passwd", "..", "/abs", "nul\x00byte", "x" * 10_000, "会话-é-🙂", "."]
    for i, key in enumerate(keys):
        await cache.append(key, kv(8, i), answer_tokens=1)  # 8 keys x 8 KiB: most go to SSD
    assert sum(cache.where(k) == "ssd" for k in keys) >= 2
    for i, key in enumerate(keys):
        assert_same(await cache.load(key), kv(8, i))
    root = ssd_dir.resolve()
    for path in ssd_dir.rglob("*"):
        assert path.resolve().is_relative_to(root)
        assert all(c in "0123456789abcdef." or c.isalpha() for c in path.name), path.name
    assert not (ssd_dir.parent / "etc").exists()


async def test_use_outside_async_with_is_a_clear_error(ssd_dir: Path) -> None:
    c = TieredKVCache([HostMemoryTier(64 * KIB)])
    with pytest.raises(ClosedError, match="async with"):
        await c.append("a", kv(1, 1), answer_tokens=1)
    async with c:
        await c.append("a", kv(1, 1), answer_tokens=1)
    with pytest.raises(ClosedError):
        await c.load("a")


def test_constructor_rejects_bad_configuration(ssd_dir: Path) -> None:
    with pytest.raises(ValueError, match="at least one tier"):
        TieredKVCache([])
    with pytest.raises(ValueError, match="unique"):
        TieredKVCache([HostMemoryTier(KIB), HostMemoryTier(KIB)])
    with pytest.raises(TypeError, match="Tier protocol"):
        TieredKVCache([object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="mode"):
        TieredKVCache([HostMemoryTier(KIB)], mode="write-back")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one per tier"):
        TieredKVCache([HostMemoryTier(KIB), SSDTier(ssd_dir, KIB)], eviction=[LRU()])
    shared = LRU()
    with pytest.raises(ValueError, match="own eviction policy"):
        TieredKVCache([HostMemoryTier(KIB), SSDTier(ssd_dir, KIB)], eviction=[shared, shared])


async def test_unwritable_directory_fails_at_open_with_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    c = TieredKVCache([HostMemoryTier(64 * KIB), SSDTier(blocker / "ssd", 1 << 20)])
    with pytest.raises(TierIOError, match="writable directory"):
        await c.open()
    with pytest.raises(ClosedError):
        await c.load("a")


# -- faults ------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
async def test_io_error_while_demoting_keeps_the_victim_where_it_was(
    cache: TieredKVCache, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    for i in range(5):
        await cache.append(f"s{i}", kv(8, i), answer_tokens=1)
    assert all(cache.where(f"s{i}") == "host" for i in range(5))
    used = [t.used for t in cache.stats().tiers]

    def broken(*args: Any, **kwargs: Any) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwrite", broken)
    with pytest.raises(TierIOError) as info:
        await cache.append("new", kv(8, 99), answer_tokens=1)
    assert info.value.errno == code
    assert [t.used for t in cache.stats().tiers] == used
    assert cache.stats().errors == 1
    assert not cache.contains("new")
    monkeypatch.undo()
    for i in range(5):  # nothing lost, nothing moved
        assert cache.where(f"s{i}") == "host"
        assert_same(await cache.load(f"s{i}"), kv(8, i))
    assert not list((cache.tiers[1].directory / "tmp").iterdir())  # type: ignore[attr-defined]


async def test_flipped_byte_on_ssd_is_a_miss_never_served(
    cache: TieredKVCache, ssd_dir: Path
) -> None:
    for i in range(8):
        await cache.append(f"s{i}", kv(8, i), answer_tokens=1)
    assert cache.where("s0") == "ssd"
    (path,) = [p for p in (ssd_dir / "segments").glob("*/*.seg") if _header_session(p) == "s0"]
    raw = bytearray(path.read_bytes())
    raw[-5000] ^= 0x01  # inside the body
    path.write_bytes(bytes(raw))
    with pytest.raises(SessionNotFoundError):
        await cache.load("s0")
    assert cache.where("s0") is None
    assert cache.channel["s0"].tier is None  # the engine can see it must recompute
    stats = cache.stats()
    assert (stats.corrupt, stats.misses, stats.lost) == (1, 1, 1)
    assert len(list((ssd_dir / "quarantine").iterdir())) == 1
    # the session can start afresh
    await cache.append("s0", kv(2, 5), answer_tokens=1)
    assert_same(await cache.load("s0"), kv(2, 5))


def _flip_body(directory: Path, session: str) -> None:
    """Flip a byte inside the body of ``session``'s one segment file under ``directory``."""
    (path,) = [p for p in (directory / "segments").glob("*/*.seg") if _header_session(p) == session]
    raw = bytearray(path.read_bytes())
    raw[-5000] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["load", "layerwise"])
async def test_a_damaged_copy_with_a_whole_one_below_is_served_from_it_or_leaves_nothing(
    tmp_path: Path, how: str
) -> None:
    """SSD ``a`` over SSD ``b``, inclusive: ``s0`` is served from ``a`` and held whole in
    ``b`` too. A flipped byte in ``a``: a load serves ``s0`` from ``b`` (the damage cost
    that copy only). A layerwise load cannot start again once the caller has computed on
    what landed: a miss, and nothing of ``s0`` stays (its next turn starts it afresh; a
    whole copy left listed after a miss used to be extended by that turn)."""
    a, b = tmp_path / "a", tmp_path / "b"
    tiers = [SSDTier(a, 4 << 20, name="a"), SSDTier(b, 4 << 20, name="b")]
    async with TieredKVCache(tiers, mode="inclusive") as cache:
        await cache.append("s0", kv(8, 0), answer_tokens=1)
        await cache.flush()
        assert cache.where("s0") == "a"
        assert [t.segments for t in cache.stats().tiers] == [1, 1]
        _flip_body(a, "s0")
        if how == "load":
            assert_same(await cache.load("s0"), kv(8, 0))
            stats = cache.stats()
            assert (stats.corrupt, stats.misses, stats.lost) == (1, 0, 0)
            return
        out = {n: torch.zeros(8, 4, 64, dtype=torch.float16) for n in ("k", "v")}
        with pytest.raises(SessionNotFoundError, match="damaged"):
            async with cache.load_layerwise("s0", out, [["k"], ["v"]]) as load:
                await load.finished()
        assert not cache.contains("s0")
        assert (cache.stats().corrupt, cache.stats().misses) == (1, 1)
        await cache.append("s0", kv(2, 5), answer_tokens=1)
        assert_same(await cache.load("s0"), kv(2, 5))


def _header_session(path: Path) -> str:
    from tieredkv.payload import parse_header

    header, _ = parse_header(memoryview(path.read_bytes()), path.name)
    return header.session


async def test_mmap_tier_as_capacity_layer(tmp_path: Path) -> None:
    tiers = [HostMemoryTier(32 * KIB), MmapTier(tmp_path / "cap.mmap", 1 << 20)]
    async with TieredKVCache(tiers) as c:
        for i in range(6):
            await c.append(f"s{i}", kv(8, i), answer_tokens=1)
        assert c.where("s0") == "mmap"
        assert_same(await c.load("s0"), kv(8, 0))
        assert (tmp_path / "cap.mmap").stat().st_size == 1 << 20
    assert not (tmp_path / "cap.mmap").exists()


async def test_a_tier_reopened_smaller_says_what_it_evicted_to_fit(
    ssd_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An SSD directory holding two conversations reopened with room for one: the open
    evicts one to fit (from the last tier: deleted) and says so, naming it. Before, it was
    deleted silently (only stats().lost moved)."""
    async with TieredKVCache([SSDTier(ssd_dir, 64 << 20)]) as c:
        for i, session in enumerate(("a", "b")):
            await c.append(session, kv(64, i), answer_tokens=1)
        one = c.channel["a"].nbytes
    with caplog.at_level(logging.WARNING, logger="tieredkv.cache"):
        async with TieredKVCache([SSDTier(ssd_dir, one + one // 2)]) as c:
            [kept] = c.sessions()
    [gone] = {"a", "b"} - {kept}
    assert f"past its capacity of {one + one // 2:,}" in caplog.text
    assert f"1 conversation(s) evicted to fit, deleted: lost: {gone!r}" in caplog.text


async def test_a_second_mmap_tier_on_the_same_file_is_refused(tmp_path: Path) -> None:
    """Two mmap tiers given one file: the second is refused (the first holds the file's
    lock) and the first keeps serving what it holds, byte for byte; once it has closed, the
    file is free. Before, the second truncated the file, so the first served zeros, and the
    second's close deleted the first's file."""
    path = tmp_path / "cap.mmap"
    tiers = [HostMemoryTier(32 * KIB), MmapTier(path, 1 << 20)]
    async with TieredKVCache(tiers) as c:
        for i in range(6):
            await c.append(f"s{i}", kv(8, i), answer_tokens=1)
        assert c.where("s0") == "mmap"
        other = TieredKVCache([HostMemoryTier(32 * KIB), MmapTier(path, 1 << 20)])
        with pytest.raises(TierIOError, match="another tier has this file open"):
            await other.open()
        assert path.exists()
        assert_same(await c.load("s0"), kv(8, 0))
    async with TieredKVCache([HostMemoryTier(32 * KIB), MmapTier(path, 1 << 20)]) as again:
        await again.append("t", kv(8, 9), answer_tokens=1)
        assert_same(await again.load("t"), kv(8, 9))


@pytest.mark.parametrize("kind", ["ssd", "host"])
async def test_a_tier_object_serves_one_open_cache_at_a_time(ssd_dir: Path, kind: str) -> None:
    """A second cache opened over a tier object another open cache has is refused, naming
    the tier and what to do, before anything is opened or written; the first cache is
    untouched, and once it has closed the second opens (and finds what the first kept).
    Before 5 December 2026 the second opened with an empty index over the first's tier:
    its appends collided with the first's segments (a ValueError naming segment 0), and
    its close would have closed the first's tier."""
    a = kv(8, 1)
    shared = SSDTier(ssd_dir, 4 << 20) if kind == "ssd" else HostMemoryTier(64 * KIB)
    first = TieredKVCache([shared])
    second = TieredKVCache([shared])
    async with first:
        await first.append("s", a, answer_tokens=1)
        with pytest.raises(InvalidArgumentError, match=f"tier '{shared.name}' belongs to"):
            await second.open()
        with pytest.raises(ClosedError):
            await second.load("s")
        assert_same(await first.load("s"), a)
        await first.append("s", kv(8, 2), answer_tokens=1)
        assert_same(await first.load("s"), joined([a, kv(8, 2)]))
    async with second:  # the first closed: the tier is free
        if kind == "ssd":  # (what a closed host tier held is gone; the SSD keeps it)
            assert_same(await second.load("s"), joined([a, kv(8, 2)]))
        await second.append("t", a, answer_tokens=1)
        assert_same(await second.load("t"), a)


async def test_outputs_that_cannot_hold_a_history_are_refused_before_anything_moves(
    cache: TieredKVCache,
) -> None:
    """A tensor that overlaps itself (``expand()``'s stride 0: positions sharing memory), one
    on the meta device (no data), a numpy array and a list got through, or got a misleading
    message: ``load_into`` returned 8 with the history not in ``out``, or said two tensors
    overlapped. Each is refused with what to pass instead; a permuted tensor still serves."""
    a = kv(8, 1)
    await cache.append("s", a, answer_tokens=1)
    z = torch.zeros(1, 4, 64, dtype=torch.float16)
    cases: list[tuple[Any, type[Exception], str]] = [
        ({n: z.expand(8, 4, 64) for n in a}, InvalidArgumentError, r"out\['k'\] overlaps itself"),
        (
            {n: torch.empty(8, 4, 64, dtype=torch.float16, device="meta") for n in a},
            InvalidArgumentError,
            "meta device",
        ),
        ({n: t.numpy() for n, t in a.items()}, InvalidTypeError, "pass torch tensors"),
        ([1, 2], InvalidTypeError, "out must map the session's tensor names to tensors"),
    ]
    for out, error, message in cases:
        with pytest.raises(error, match=message):
            await cache.load_into("s", out)
    assert bool((z == 0).all())  # nothing moved
    k, v = (torch.zeros(64, 8, 4, dtype=torch.float16).permute(1, 2, 0) for _ in "kv")
    assert await cache.load_into("s", {"k": k, "v": v}) == 8
    assert_same({"k": k, "v": v}, a)


@pytest.mark.parametrize("call", ["load", "load_into", "load_layerwise", "prefetch", "drop"])
async def test_a_session_key_that_is_not_text_is_refused_by_every_call(
    cache: TieredKVCache, call: str
) -> None:
    """``load``, ``load_into``, ``load_layerwise``, ``prefetch`` and ``drop`` raised a bare
    ``TypeError`` from building their miss for a key that is not a ``str``; now the
    ``InvalidTypeError`` ``append`` gives, and nothing stored changes."""
    a = kv(8, 1)
    await cache.append("s", a, answer_tokens=1)
    out = {n: torch.zeros_like(t) for n, t in a.items()}

    async def layerwise() -> None:
        async with cache.load_layerwise(7, out, [["k"], ["v"]]):  # type: ignore[arg-type]
            pass

    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "load": lambda: cache.load(7),  # type: ignore[arg-type]
        "load_into": lambda: cache.load_into(7, out),  # type: ignore[arg-type]
        "load_layerwise": layerwise,
        "prefetch": lambda: cache.prefetch(7),  # type: ignore[arg-type]
        "drop": lambda: cache.drop(7),  # type: ignore[arg-type]
    }
    with pytest.raises(InvalidTypeError, match="session keys are str, not int"):
        await calls[call]()
    assert_same(await cache.load("s"), a)


async def test_an_append_with_a_hint_that_is_not_one_stores_nothing(cache: TieredKVCache) -> None:
    """The hint's type was checked after the turn was stored (an ``AttributeError`` then:
    a caller that retried stored the turn twice); now before anything is."""
    await cache.append("s", kv(8, 1), answer_tokens=1)
    with pytest.raises(InvalidTypeError, match="hint must be a RetentionHint, not dict"):
        await cache.append("s", kv(8, 2), answer_tokens=1, hint={"pin": True})  # type: ignore[arg-type]
    assert cache.channel["s"].tokens == 8
    assert_same(await cache.load("s"), kv(8, 1))


async def test_load_into_refuses_outputs_that_overlap_in_memory(cache: TieredKVCache) -> None:
    """The same tensor under two names, or overlapping slices of one buffer, would have one
    tensor's history overwrite the other's: refused before anything is moved, naming both.
    Outputs that share a buffer without overlapping (K and V interleaved, slices side by
    side) are served exactly. Before 5 December 2026 the overlapping ones were accepted."""
    a = kv(8, 1)
    await cache.append("s", a, answer_tokens=1)
    buf = torch.full((20, 4, 64), 7.0, dtype=torch.float16)
    for out in ({"k": buf, "v": buf}, {"k": buf[:10], "v": buf[5:15]}):
        with pytest.raises(InvalidArgumentError, match=r"out\['k'\] and out\['v'\] overlap"):
            await cache.load_into("s", out)
        assert bool((buf == 7).all())  # nothing moved
    side = {"k": buf[:8], "v": buf[8:16]}  # side by side: apart
    assert await cache.load_into("s", side) == 8
    assert_same(side, a)
    both = torch.zeros(8, 2, 4, 64, dtype=torch.float16)  # interleaved: not contiguous
    inter = {"k": both[:, 0], "v": both[:, 1]}
    assert await cache.load_into("s", inter) == 8
    assert_same({n: t.contiguous() for n, t in inter.items()}, a)
