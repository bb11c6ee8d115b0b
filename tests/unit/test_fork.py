"""A child forked from a process with an open cache or tier (``multiprocessing``'s default
start method on Linux before Python 3.14, a pre-forking server) gets a clear
:class:`~tieredkv.errors.ForkedError` from every operation on it, and closing it there
releases only the child's copy: the parent's files, shared map, Redis leases and data stay
as they were, and the parent goes on using the cache. A long-lived child no longer keeps
an SSD tier's directory locked once the parent has closed it.

Before 5 December 2026 a child's load from an SSD tier waited forever (its reader threads
are the parent's), a child's append into an ``MmapTier`` wrote into the parent's shared
map, and a child that merely lived on (doing anything else) kept the directory's lock, so
the parent could not open it again. Each test's child does no torch work (a forked child
may not use torch's own threads): every call it makes is refused before any.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import redis
import torch

from tests.forked import wait_child
from tests.redis_server import RedisServer, new_prefix, redis_server
from tieredkv import (
    ForkedError,
    HostMemoryTier,
    MmapTier,
    RedisTier,
    SSDTier,
    TieredKVCache,
)
from tieredkv.errors import TierIOError

__all__ = ["redis_server"]  # a fixture used below

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(256, 64, generator=g).half(), "v": torch.randn(256, 64, generator=g)}


def exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(
        got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want
    )


def files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def in_child(work: Callable[[], str], seconds: float = 30) -> str:
    """Fork, run ``work`` in the child and return what it returned (or the exception it
    raised, as ``"raised <type>: <message>"``); fails the test if the child hangs."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        try:
            try:
                out = work()
            except BaseException as exc:  # reported to the parent
                out = f"raised {type(exc).__name__}: {exc}"
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        wait_child(pid, "the forked child hung on the cache it inherited", seconds)
        return f.read().decode()


def refusals(cache: TieredKVCache) -> str:
    """In the child: every kind of call on the inherited cache, each refused, then a close
    that returns; what happened, one line per call."""

    async def calls() -> str:
        lines = []
        for name, call in (
            ("load", lambda: cache.load("a")),
            ("append", lambda: cache.append("a", {"k": torch.empty(0)}, answer_tokens=1)),
            ("drop", lambda: cache.drop("a")),
            ("flush", cache.flush),
            ("open", cache.open),
        ):
            try:
                await call()
                lines.append(f"{name}: not refused")
            except ForkedError as exc:
                lines.append(f"{name}: ForkedError opened_in={exc.opened_in} {exc}")
        await cache.aclose()
        lines.append("aclose: returned")
        try:  # the child's copy stays the parent's: it cannot be opened again here either
            await cache.open()
            lines.append("reopen: not refused")
        except ForkedError as exc:
            lines.append(f"reopen: ForkedError opened_in={exc.opened_in} {exc}")
        return "\n".join(lines)

    return anyio.run(calls)


def check_refusals(out: str) -> None:
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "load",
        "append",
        "drop",
        "flush",
        "open",
        "aclose",
        "reopen",
    ], out
    for line in lines[:5] + lines[6:]:
        assert f"ForkedError opened_in={os.getpid()} " in line, line
        assert "open a cache of its own in the child" in line
        assert "'spawn' or 'forkserver'" in line
    assert lines[5] == "aclose: returned"


async def test_a_forked_child_is_refused_and_the_parents_ssd_cache_is_untouched(
    tmp_path: Path,
) -> None:
    a, b = kv(1), kv(2)
    root = tmp_path / "ssd"
    async with TieredKVCache([HostMemoryTier(8 << 20), SSDTier(root, 64 << 20)]) as cache:
        await cache.append("a", a, answer_tokens=1)
        await cache.flush()
        before = files(root)
        check_refusals(in_child(lambda: refusals(cache)))
        assert files(root) == before  # the child's close wrote, moved and deleted nothing
        assert exact(await cache.load("a"), a)
        await cache.append("b", b, answer_tokens=1)
        assert exact(await cache.load("b"), b)
    async with TieredKVCache([SSDTier(root, 64 << 20)]) as again:  # closed, kept, reopened
        assert exact(await again.load("a"), a)
        assert exact(await again.load("b"), b)


async def test_a_forked_ssd_tier_is_refused_on_its_own(tmp_path: Path) -> None:
    tier = SSDTier(tmp_path, 64 << 20)
    async with tier:

        def child() -> str:
            async def go() -> str:
                with pytest.raises(ForkedError, match="tier 'ssd' was opened in process"):
                    await tier.read([("a", 0)], [memoryview(bytearray(4096))])
                with pytest.raises(ForkedError):
                    tier.reserve(("a", 0), 4096)
                await tier.aclose()
                return "ok"

            return anyio.run(go)

        assert in_child(child) == "ok"
        assert tier.reserve(("a", 0), 4096)  # the parent's tier works on
        tier.release(("a", 0))


async def fork_a_child() -> tuple[int, int]:
    """Fork a child that does something else, and outlives the parent's cache, until
    :func:`end_child`; return its pid and the pipe that ends it, once it runs. (The hooks
    that let go of its copies of the tiers' locks run in the child at its start, which a
    loaded machine may delay past the parent's close.)"""
    r, w = os.pipe()
    up_r, up_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.write(up_w, b"x")
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(up_w)
    await anyio.to_thread.run_sync(os.read, up_r, 1)
    os.close(up_r)
    return pid, w


async def end_child(pid: int, w: int) -> None:
    os.write(w, b"x")
    os.close(w)
    await anyio.to_thread.run_sync(os.waitpid, pid, 0)


async def test_a_long_lived_child_does_not_keep_the_ssd_directory_locked(
    tmp_path: Path,
) -> None:
    a = kv(3)
    async with TieredKVCache([SSDTier(tmp_path, 64 << 20)]) as cache:
        await cache.append("a", a, answer_tokens=1)
        pid, w = await fork_a_child()
    try:
        async with TieredKVCache([SSDTier(tmp_path, 64 << 20)]) as again:
            assert exact(await again.load("a"), a)
    except TierIOError as exc:  # what it raised before: the child held the lock
        pytest.fail(f"the directory stayed locked by the forked child: {exc}")
    finally:
        await end_child(pid, w)


async def test_a_long_lived_child_does_not_keep_the_map_file_locked(tmp_path: Path) -> None:
    """As for the SSD directory: once the parent's mmap tier closed, a new one takes the
    same file, though a child forked while it was open still runs (with keep_file, the
    file itself stays: without it each open makes a new one, which no child holds)."""
    path = tmp_path / "tier.map"
    async with TieredKVCache([MmapTier(path, 8 << 20, keep_file=True)]) as cache:
        await cache.append("a", kv(3), answer_tokens=1)
        pid, w = await fork_a_child()
    try:
        async with TieredKVCache([MmapTier(path, 8 << 20)]) as again:
            await again.append("b", kv(4), answer_tokens=1)
            assert exact(await again.load("b"), kv(4))
    finally:
        await end_child(pid, w)


async def test_a_forked_child_cannot_write_into_a_shared_map(tmp_path: Path) -> None:
    a = kv(4)
    path = tmp_path / "tier.map"
    async with TieredKVCache([MmapTier(path, 8 << 20)]) as cache:
        await cache.append("a", a, answer_tokens=1)
        check_refusals(in_child(lambda: refusals(cache)))
        assert path.exists()  # the child's close did not remove the parent's file
        assert exact(await cache.load("a"), a)
        await cache.append("a", kv(5), answer_tokens=1)
        assert exact(await cache.load("a"), {n: torch.cat([a[n], kv(5)[n]]) for n in a})


async def test_a_forked_child_does_not_use_or_release_the_parents_redis_tier(
    redis_server: RedisServer,
) -> None:
    a = kv(6)
    prefix = new_prefix()
    tier = RedisTier(redis_server.url, 64 << 20, prefix=prefix)
    async with TieredKVCache([HostMemoryTier(8 << 20), tier], mode="inclusive") as cache:
        await cache.append("a", a, answer_tokens=1)
        await cache.flush()  # committed to the shared tier: this replica holds its lease
        manifest = tier._manifest("a")
        with redis.Redis.from_url(redis_server.url) as client:
            lease = client.hget(manifest, "le")
            assert lease not in (None, b"0")
            check_refusals(in_child(lambda: refusals(cache)))

            def tier_alone() -> str:  # the tier itself, used and closed in a child
                async def go() -> str:
                    with pytest.raises(ForkedError, match="tier 'redis' was opened in"):
                        await tier.open()
                    with pytest.raises(ForkedError):
                        await tier.delete(("a", 0))
                    await tier.aclose()
                    return "ok"

                return anyio.run(go)

            assert in_child(tier_alone) == "ok"
            # the children sent nothing: their closes did not end the parent's lease (a
            # release sets it to 0, and another replica could take the conversation at once)
            assert client.hget(manifest, "le") == lease
        assert tier.may_serve_local("a")
        await cache.append("a", kv(7), answer_tokens=1)
        await cache.flush()
        want = {n: torch.cat([a[n], kv(7)[n]]) for n in a}
        assert exact(await cache.load("a"), want)
    async with TieredKVCache([RedisTier(redis_server.url, 64 << 20, prefix=prefix)]) as other:
        assert exact(await other.load("a"), want)


async def test_a_cache_closed_before_the_fork_opens_in_the_child(tmp_path: Path) -> None:
    """What the parent closed before forking is not the parent's any more: the child opens
    it as any process would (and finds what the parent stored)."""
    a = kv(8)
    cache = TieredKVCache([HostMemoryTier(8 << 20), SSDTier(tmp_path, 64 << 20)])
    async with cache:
        await cache.append("a", a, answer_tokens=1)

    def child() -> str:
        async def go() -> str:
            async with cache:
                return f"{cache.contains('a')} {cache.where('a')}"

        return anyio.run(go)

    assert in_child(child) == "True ssd"  # (written down to the SSD tier at the close)
    async with cache:  # and the parent, again
        assert exact(await cache.load("a"), a)
