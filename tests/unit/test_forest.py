"""Forks: a conversation that starts as another's first tokens, stored once in every tier."""

from __future__ import annotations

import asyncio
import errno
import shutil
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
import pytest
import torch

from tests.faults import FaultInjector
from tieredkv import (
    BidawEviction,
    CapacityError,
    HostMemoryTier,
    KVMeta,
    MmapTier,
    SchemaMismatchError,
    SessionNotFoundError,
    SSDTier,
    TieredKVCache,
)
from tieredkv._cache import turns
from tieredkv.backends.base import Tier
from tieredkv.backends.ssd import segment_file_name
from tieredkv.fsck import check_directory, repair_directory
from tieredkv.payload import plan_segment, segment_id, verify_segment
from tieredkv.policies.base import freed_bytes

from ..invariants import problems

KIB = 1024


def kv(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(tokens, 4, 64, generator=g).to(torch.float16),
        "v": torch.randn(tokens, 4, 64, generator=g).to(torch.float16),
    }


def cat(*parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}


def head(t: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    return {k: v[:n] for k, v in t.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].shape == b[n].shape, n
        assert a[n].contiguous().view(torch.uint8).equal(b[n].contiguous().view(torch.uint8)), n


def segments(tier: Tier) -> int:
    return tier.stats().segments


async def check(cache: TieredKVCache) -> None:
    await cache.flush()
    assert problems(cache) == []


async def test_fork_loads_parent_prefix_then_its_own_turns(ssd_dir: Path) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        a0, a1 = kv(8, 1), kv(6, 2)
        await c.append("a", a0, answer_tokens=3)
        await c.append("a", a1, answer_tokens=3)
        b0 = kv(5, 3)
        meta = await c.append("b", b0, answer_tokens=2, parent="a")
        assert (meta.parent, meta.parent_tokens, meta.tokens) == ("a", 14, 19)
        assert meta.shared_bytes > 0
        assert meta.owned_bytes > 0
        same(await c.load("b"), cat(a0, a1, b0))
        same(await c.load("a"), cat(a0, a1))
        # stored once: a's two turns and b's one
        assert segments(c.tiers[0]) == 3
        assert c.channel["a"].shared_bytes == c.channel["a"].nbytes
        await check(c)


async def test_fork_inside_a_turn_references_a_token_range(ssd_dir: Path) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        a0, a1 = kv(8, 1), kv(6, 2)
        await c.append("a", a0, answer_tokens=3)
        await c.append("a", a1, answer_tokens=3)
        r0 = kv(4, 5)
        await c.append("regen", r0, answer_tokens=4, parent="a", parent_tokens=11)
        want = cat(a0, head(a1, 3), r0)
        same(await c.load("regen"), want)
        out = {n: torch.zeros(20, 4, 64, dtype=torch.float16) for n in want}
        assert await c.load_into("regen", out) == 15
        same(head(out, 15), want)
        assert segments(c.tiers[0]) == 3
        # the fork point inside the first turn
        await c.append("early", kv(2, 6), answer_tokens=1, parent="a", parent_tokens=5)
        same(await c.load("early"), cat(head(a0, 5), kv(2, 6)))
        await check(c)


async def test_forks_of_forks_and_dropping_the_parents(ssd_dir: Path) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        a0, b0, c0, c1 = kv(8, 1), kv(5, 2), kv(3, 3), kv(2, 4)
        await c.append("a", a0, answer_tokens=1)
        await c.append("b", b0, answer_tokens=1, parent="a")
        await c.append("c", c0, answer_tokens=1, parent="b", parent_tokens=10)
        await c.append("c", c1, answer_tokens=1)
        want = cat(a0, head(b0, 2), c0, c1)
        same(await c.load("c"), want)
        await c.drop("a")
        await c.drop("b")
        assert not c.contains("a")
        assert not c.contains("b")
        with pytest.raises(SessionNotFoundError):
            await c.load("a")
        same(await c.load("c"), want)
        # a0 and b0 stay for c; nothing else of a or b does
        assert segments(c.tiers[0]) == 4
        await check(c)
        await c.drop("c")
        assert segments(c.tiers[0]) == 0
        await check(c)


async def test_fork_moves_between_tiers_with_what_no_resident_needs(ssd_dir: Path) -> None:
    # host room for about three 8-token turns
    async with TieredKVCache([HostMemoryTier(40 * KIB), SSDTier(ssd_dir, 8 << 20)]) as c:
        p = kv(8, 1)
        await c.append("p", p, answer_tokens=1)
        await c.append("f", kv(8, 2), answer_tokens=1, parent="p")
        await c.append("g", kv(8, 3), answer_tokens=1, parent="p")
        _host, _ssd = c.tiers
        assert c.where("f") == "host"
        assert c.where("g") == "host"
        # a newcomer pushes the others down: each fork's own turn goes; p's turn stays
        # while a resident still needs it
        await c.append("x", kv(8, 4), answer_tokens=1)
        await c.append("y", kv(8, 5), answer_tokens=1)
        await check(c)
        places = {k: c.where(k) for k in ("p", "f", "g", "x", "y")}
        assert "ssd" in places.values()
        for k in ("f", "g"):
            want = cat(p, kv(8, 2 if k == "f" else 3))
            same(await c.load(k), want)
            await check(c)
        assert await c.prefetch("p") == "host"
        same(await c.load("p"), p)
        await check(c)


async def test_fork_errors_say_what_to_fix(ssd_dir: Path) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        await c.append("a", kv(8, 1), answer_tokens=1)
        with pytest.raises(SessionNotFoundError):
            await c.append("b", kv(4, 2), answer_tokens=1, parent="nobody")
        with pytest.raises(ValueError, match="holds 8 tokens"):
            await c.append("b", kv(4, 2), answer_tokens=1, parent="a", parent_tokens=9)
        with pytest.raises(ValueError, match="needs parent"):
            await c.append("b", kv(4, 2), answer_tokens=1, parent_tokens=3)
        with pytest.raises(ValueError, match="already stored"):
            await c.append("a", kv(4, 2), answer_tokens=1, parent="a")
        other = {"k": torch.zeros(4, 2, 64, dtype=torch.float16)}
        with pytest.raises(SchemaMismatchError):
            await c.append("b", other, answer_tokens=1, parent="a")
        assert not c.contains("b")
        assert segments(c.tiers[0]) == 1
        await check(c)


async def test_forks_survive_a_reopen_and_keep_sharing(ssd_dir: Path) -> None:
    a0, a1, b0, c0 = kv(8, 1), kv(6, 2), kv(5, 3), kv(3, 4)
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        await c.append("a", a0, answer_tokens=1)
        await c.append("a", a1, answer_tokens=1)
        await c.append("b", b0, answer_tokens=1, parent="a", parent_tokens=10)
        await c.append("c", c0, answer_tokens=1, parent="b")
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        assert c.truncated() == {}
        same(await c.load("a"), cat(a0, a1))
        same(await c.load("b"), cat(a0, head(a1, 2), b0))
        same(await c.load("c"), cat(a0, head(a1, 2), b0, c0))
        # each load promoted its conversation; a segment left the SSD with the last
        # conversation that needed it there
        assert segments(c.tiers[1]) == 0
        assert segments(c.tiers[0]) == 4
        assert c.channel["c"].parent_tokens == 15
        await check(c)


async def test_a_restart_names_the_parent_a_fork_was_given(ssd_dir: Path) -> None:
    """A fork of a fork at a point inside the turns it inherited lists only its
    grandparent's turns; after a restart it still names the conversation it was forked
    from (and the tokens), as it did before."""
    a0, a1, b0, c0, d0 = kv(8, 1), kv(6, 2), kv(5, 3), kv(3, 4), kv(2, 5)
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        await c.append("a", a0, answer_tokens=1)
        await c.append("a", a1, answer_tokens=1)
        await c.append("b", b0, answer_tokens=1, parent="a", parent_tokens=10)
        await c.append("c", c0, answer_tokens=1, parent="b", parent_tokens=7)  # inside a0
        await c.append("d", d0, answer_tokens=1, parent="b", parent_tokens=12)  # inside b0
        before = {k: (c.channel[k].parent, c.channel[k].parent_tokens) for k in "bcd"}
    assert before == {"b": ("a", 10), "c": ("b", 7), "d": ("b", 12)}
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        assert c.truncated() == {}
        after = {k: (c.channel[k].parent, c.channel[k].parent_tokens) for k in "bcd"}
        assert after == before
        same(await c.load("c"), cat(head(a0, 7), c0))
        same(await c.load("d"), cat(a0, head(a1, 2), head(b0, 2), d0))
        await check(c)


def test_a_fork_header_names_its_parent_only_where_its_turns_do_not() -> None:
    """A fork's first turn whose parent owns the last turn it lists is written as before
    the parent was named (no ``parent`` field: the same bytes); another names it."""
    plain = plan_segment("b", 1, kv(2, 1), token_dim=0, answer_tokens=1, base=(("a", 0, 8),))
    named = plan_segment(
        "c", 1, kv(2, 1), token_dim=0, answer_tokens=1, base=(("a", 0, 7),), parent="b"
    )
    fields = msgspec.msgpack.decode(plain.header_bytes)
    assert "parent" not in fields
    assert fields["base"] == [["a", 0, 8]]
    assert "parent" in msgspec.msgpack.decode(named.header_bytes)
    for plan, parent in ((plain, ""), (named, "b")):
        stored = bytearray(plan.length)
        plan.write_into(memoryview(stored))
        assert verify_segment(memoryview(stored), "test").parent == parent
    with pytest.raises(ValueError, match="parent names"):
        plan_segment("c", 1, kv(2, 1), token_dim=0, answer_tokens=1, parent="b")


async def test_a_fork_whose_parent_history_is_gone_is_not_served(ssd_dir: Path) -> None:
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        await c.append("a", kv(8, 1), answer_tokens=1)
        await c.append("b", kv(5, 2), answer_tokens=1, parent="a")
    # a's segment disappears behind the cache's back: b's reference dangles
    (ssd_dir / "segments" / segment_file_name(("a", 0))).unlink()
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        assert not c.contains("a")
        assert not c.contains("b")
        assert "forked from 'a'" in c.truncated()["b"].reason
        await check(c)


async def test_a_fork_names_the_turns_it_inherits_and_another_historys_are_not_them(
    ssd_dir: Path, tmp_path: Path
) -> None:
    """A fork's first turn names the segments it inherits by their ids (``base_ids``).
    Behind the cache's back, another history's turn 0 (another cache's ``a``, as long) is
    put under ``a``'s key: the reopened cache serves that history as ``a``, and not the
    fork (a truncation saying why, never the other turn's first tokens followed by the
    fork's own); fsck, before, reports the fork's reference as dangling."""
    a0, b1 = kv(8, 1), kv(5, 2)
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        await c.append("a", a0, answer_tokens=1)
        await c.append("b", b1, answer_tokens=1, parent="a", parent_tokens=6)
        same(await c.load("b"), cat(head(a0, 6), b1))
    files = ssd_dir / "segments"
    parent = verify_segment(memoryview((files / segment_file_name(("a", 0))).read_bytes()), "a")
    first = verify_segment(memoryview((files / segment_file_name(("b", 1))).read_bytes()), "b")
    assert first.base == (("a", 0, 6),)
    assert first.base_ids == (segment_id(parent),)
    other = tmp_path / "other"
    async with TieredKVCache([SSDTier(other, 8 << 20)]) as o:
        await o.append("a", kv(8, 9), answer_tokens=1)
    name = segment_file_name(("a", 0))
    shutil.copyfile(other / "segments" / name, files / name)
    report = await asyncio.to_thread(check_directory, ssd_dir)
    assert [d.path for d in report.damaged] == [f"segments/{segment_file_name(('b', 1))}"]
    assert "another history's turn under that key" in report.damaged[0].problem
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        same(await c.load("a"), kv(8, 9))
        assert not c.contains("b")
        assert "another history's" in c.truncated()["b"].reason
        await check(c)


@pytest.mark.parametrize("how", ["task.cancel", "wait_for"])
async def test_cancelled_fork_leaves_no_trace(ssd_dir: Path, how: str) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        a0 = kv(8, 1)
        await c.append("a", a0, answer_tokens=1)
        big = kv(2048, 2)
        for _ in range(5):
            task = asyncio.ensure_future(c.append("b", big, answer_tokens=1, parent="a"))
            await asyncio.sleep(0)
            if how == "task.cancel":
                task.cancel()
            else:
                task2 = asyncio.ensure_future(asyncio.wait_for(task, 0))
                await asyncio.sleep(0)
                task = task2
            try:
                await task
            except (asyncio.CancelledError, TimeoutError):
                assert not c.contains("b")
                assert segments(c.tiers[0]) == 1
            else:
                same(await c.load("b"), cat(a0, big))
                await c.drop("b")
            assert c.channel["a"].shared_bytes == 0
            await check(c)
        same(await c.load("a"), a0)


async def test_fork_in_mmap_and_inclusive_mode(tmp_path: Path, ssd_dir: Path) -> None:
    tiers = [MmapTier(tmp_path / "m", 1 << 20), SSDTier(ssd_dir, 8 << 20)]
    async with TieredKVCache(tiers, mode="inclusive") as c:
        a0, b0 = kv(8, 1), kv(4, 2)
        await c.append("a", a0, answer_tokens=1)
        await c.append("b", b0, answer_tokens=1, parent="a", parent_tokens=6)
        await c.flush()
        assert segments(c.tiers[0]) == 2
        assert segments(c.tiers[1]) == 2
        same(await c.load("b"), cat(head(a0, 6), b0))
        await c.drop("a")
        await check(c)
        same(await c.load("b"), cat(head(a0, 6), b0))
        assert segments(c.tiers[0]) == 2
        assert segments(c.tiers[1]) == 3  # and a's retirement marker: a stays dropped


async def test_layerwise_load_of_a_fork(ssd_dir: Path) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        a0, b0 = kv(8, 1), kv(4, 2)
        await c.append("a", a0, answer_tokens=1)
        await c.append("b", b0, answer_tokens=1, parent="a", parent_tokens=5)
        want = cat(head(a0, 5), b0)
        for where in ("host", "ssd"):
            if where == "ssd":
                await c.append("z", kv(1010, 9), answer_tokens=1)  # pushes a and b down
                assert c.where("b") == "ssd"
            out = {n: torch.zeros(9, 4, 64, dtype=torch.float16) for n in want}
            async with c.load_layerwise("b", out, [["k"], ["v"]]) as load:
                await load.finished()
            same(out, want)
            await check(c)


async def test_a_dropped_parent_stays_dropped_after_a_reopen(ssd_dir: Path) -> None:
    a0, a1, b0 = kv(8, 1), kv(6, 2), kv(5, 3)
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        await c.append("a", a0, answer_tokens=1)
        await c.append("a", a1, answer_tokens=1)
        await c.append("b", b0, answer_tokens=1, parent="a", parent_tokens=4)
        await c.drop("a")
        with pytest.raises(ValueError, match="another key"):
            await c.append("a", a0, answer_tokens=1)
        await check(c)
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        assert c.sessions() == ["b"]
        assert c.truncated() == {}
        same(await c.load("b"), cat(head(a0, 4), b0))
        await check(c)
        await c.drop("b")
        await check(c)
        # nothing of a or b is left, and the key is free again
        await c.append("a", a1, answer_tokens=1)
        same(await c.load("a"), a1)
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        assert c.sessions() == ["a"]
        assert segments(c.tiers[0]) == 1


async def test_fsck_reports_forks_dangling_references_and_reclaimable_turns(
    ssd_dir: Path,
) -> None:
    a0, a1 = kv(8, 1), kv(6, 2)
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        await c.append("a", a0, answer_tokens=1)
        await c.append("a", a1, answer_tokens=1)
        await c.append("b", kv(5, 3), answer_tokens=1, parent="a", parent_tokens=4)
        await c.append("b", kv(5, 4), answer_tokens=1)
        await c.append("c", kv(2, 5), answer_tokens=1, parent="b")
        await c.drop("a")
    report = await asyncio.to_thread(check_directory, ssd_dir)
    assert report.clean
    assert report.retired == ["a"]
    assert report.reclaimable == 0
    turns = {s.session: (s.turns, s.stray) for s in report.sessions}
    assert turns == {"b": (2, 0), "c": (1, 0)}
    # c's reference to b's second turn dangles once that file is gone: damage
    (ssd_dir / "segments" / segment_file_name(("b", 2))).unlink()
    report = await asyncio.to_thread(check_directory, ssd_dir)
    assert not report.clean
    assert [d.path for d in report.damaged] == [f"segments/{segment_file_name(('c', 3))}"]
    assert "dangling reference" in report.damaged[0].problem
    # a repair quarantines the fork no cache would recover (nothing is deleted)
    copy = ssd_dir.parent / "copy"
    shutil.copytree(ssd_dir, copy)
    repaired = await asyncio.to_thread(repair_directory, copy)
    assert repaired.clean
    assert repaired.quarantined == 1
    assert [s.session for s in repaired.sessions] == ["b"]
    # a's first turn, which b alone referenced, is reclaimable once b is gone
    for seq in (1, 2):
        f = ssd_dir / "segments" / segment_file_name(("b", seq))
        if f.exists():
            f.unlink()
    (ssd_dir / "segments" / segment_file_name(("c", 3))).unlink()
    report = await asyncio.to_thread(check_directory, ssd_dir)
    assert report.clean
    assert report.retired == []
    assert report.reclaimable == 2  # a's turn 0 and its marker
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        assert c.sessions() == []
        assert segments(c.tiers[0]) == 0
    assert (await asyncio.to_thread(check_directory, ssd_dir)).reclaimable == 0


class _SecondOpenFails(FaultInjector):
    """EIO on the second open of one file (the first, the tier's scan of headers at open,
    passes; the second, a repair's read of the whole segment, fails once)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.opens = name, 0

    def _decide(self, site: str, name: str = "") -> int | None:
        if site == "open" and self.name in name:
            self.opens += 1
            if self.opens == 2:
                self.injected[site] += 1
                return errno.EIO
        return super()._decide(site, name)


async def test_a_repair_that_cannot_read_a_parent_once_keeps_its_forks(ssd_dir: Path) -> None:
    """A repair's read of a fork's parent fails once (EIO): the parent is left alone (it
    may be whole), and so is the fork, whose reference to it does not dangle. Before, the
    fork's good, acknowledged turns were quarantined as "a dangling reference"."""
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        await c.append("system", kv(8, 1), answer_tokens=0)
        await c.append("chat", kv(4, 2), answer_tokens=3, parent="system")
        await c.append("chat", kv(4, 3), answer_tokens=3)
    garbage = ssd_dir / "segments" / "ab" / ("ab" * 16 + ".0.seg")  # damage to repair
    garbage.parent.mkdir(exist_ok=True)
    garbage.write_bytes(b"garbage")
    parent = segment_file_name(("system", 0)).rsplit("/", 1)[1]
    with _SecondOpenFails(parent) as faults:
        repaired = await asyncio.to_thread(repair_directory, ssd_dir)
    assert faults.total_injected == 1
    assert repaired.quarantined == 1  # the garbage alone
    assert sorted((s.session, s.turns) for s in repaired.sessions) == [
        ("chat", 2),
        ("system", 1),
    ]
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        same(await c.load("chat"), cat(kv(8, 1), kv(4, 2), kv(4, 3)))


async def test_eviction_sees_what_evicting_a_conversation_frees(ssd_dir: Path) -> None:
    """Bidaw's resident sizes are owned bytes: the shared prompt counts for nobody while
    both forks hold it, and for the parent alone once the forks are gone."""
    policy = BidawEviction()
    tiers = [HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]
    async with TieredKVCache(tiers, eviction=policy) as c:
        sys_meta = await c.append("system", kv(16, 1), answer_tokens=0)
        f = await c.append("f", kv(4, 2), answer_tokens=1, parent="system")
        g = await c.append("g", kv(4, 3), answer_tokens=1, parent="system")
        prompt = sys_meta.nbytes
        assert c.channel["system"].shared_bytes == prompt
        assert c.channel["system"].owned_bytes == 0
        assert (f.shared_bytes, g.shared_bytes) == (prompt, prompt)
        assert freed_bytes(c.channel["f"]) == f.nbytes - prompt
        own = freed_bytes(c.channel["f"]) + freed_bytes(c.channel["g"])
        assert policy.resident_bytes() == own
        assert c.tiers[0].used == prompt + own  # stored once
        await c.drop("f")
        await c.drop("g")
        assert c.channel["system"].shared_bytes == 0
        assert policy.resident_bytes() == prompt
        await check(c)


@pytest.mark.parametrize("mode", ["exclusive", "inclusive"])
async def test_concurrent_forks_loads_and_evictions_keep_the_forest_consistent(
    ssd_dir: Path, mode: str
) -> None:
    """Many forks of one prompt, appended, loaded and pushed between tiers concurrently:
    a shared segment is never copied into a tier twice at once nor deleted under a
    conversation that needs it, and every load is exact."""
    prompt = kv(64, 1)
    model: dict[str, dict[str, torch.Tensor]] = {}
    async with TieredKVCache(
        [HostMemoryTier(512 * KIB), SSDTier(ssd_dir, 16 << 20)],
        mode=mode,  # type: ignore[arg-type]
    ) as c:
        await c.append("system", prompt, answer_tokens=0)
        at_once = asyncio.Semaphore(4)  # busy conversations are never victims: leave some

        async def user(i: int) -> None:
            async with at_once:
                await converse(i)

        async def converse(i: int) -> None:
            key = f"u{i}"
            mine = [kv(8, 100 + i)]
            await c.append(key, mine[0], answer_tokens=1, parent="system")
            for t in range(3):
                same(await c.load(key), cat(prompt, *mine))
                turn = kv(8 + t, 1000 * i + t)
                mine.append(turn)
                await c.append(key, turn, answer_tokens=t)
                await asyncio.sleep(0)
            model[key] = cat(prompt, *mine)
            if i % 3 == 2:  # a regenerate branch of it, then the original goes
                await c.append(
                    f"{key}/r", kv(4, 5000 + i), answer_tokens=1, parent=key, parent_tokens=70
                )
                model[f"{key}/r"] = cat(prompt, head(mine[0], 6), kv(4, 5000 + i))
                await c.drop(key)
                del model[key]

        await asyncio.gather(*(user(i) for i in range(12)))
        await check(c)
        assert c.stats().demotions > 0  # conversations did move between tiers
        for key, want in model.items():
            same(await c.load(key), want)
        same(await c.load("system"), prompt)
        await check(c)
        # the prompt is stored at most once per tier
        for tier in c.tiers:
            assert sum(1 for k in _keys(tier) if k[0] == "system") <= 1


def _keys(tier: Tier) -> list[tuple[str, int]]:
    from ..invariants import tier_keys

    return list(tier_keys(tier))


async def test_close_writes_forks_down_with_what_they_share(ssd_dir: Path) -> None:
    """Forks held only in host memory are written down at close, the shared turn once, and
    come back as forks."""
    a0, b0, c0 = kv(8, 1), kv(5, 2), kv(3, 3)
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 8 << 20)]) as c:
        await c.append("a", a0, answer_tokens=1)
        await c.append("b", b0, answer_tokens=1, parent="a", parent_tokens=6)
        await c.append("c", c0, answer_tokens=1, parent="a")
        await c.drop("a")
    assert c.stats().written_down == 2
    async with TieredKVCache([SSDTier(ssd_dir, 8 << 20)]) as c:
        assert sorted(c.sessions()) == ["b", "c"]
        assert segments(c.tiers[0]) == 4  # a0 once, b0, c0, and a's retirement marker
        same(await c.load("b"), cat(head(a0, 6), b0))
        same(await c.load("c"), cat(a0, c0))
        await check(c)


@pytest.mark.parametrize("how", ["task.cancel", "timeout"])
async def test_cancelled_load_of_a_fork_leaves_it_where_it_was_or_promoted(
    ssd_dir: Path, how: str
) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 32 << 20)]) as c:
        a0, b0 = kv(600, 1), kv(300, 2)
        await c.append("a", a0, answer_tokens=1)
        await c.append("b", b0, answer_tokens=1, parent="a", parent_tokens=500)
        want = cat(head(a0, 500), b0)
        for delay in range(8):
            await c.append(f"z{delay}", kv(1010, 9), answer_tokens=1)  # pushes a and b down
            assert c.where("b") == "ssd"
            task = asyncio.ensure_future(c.load("b"))
            for _ in range(delay):
                await asyncio.sleep(0)
            if how == "task.cancel":
                task.cancel()
            try:
                got = await (asyncio.wait_for(task, 0) if how == "timeout" else task)
            except (asyncio.CancelledError, TimeoutError):
                assert c.where("b") in ("ssd", "host")
            else:
                same(got, want)
            await check(c)
            same(await c.load("b"), want)
            same(await c.load("a"), a0)
            await c.drop(f"z{delay}")


def two_conversations_in_host_memory(ssd_dir: Path) -> TieredKVCache:
    """A host tier with room for two conversations of 64 tokens (not three), over SSD."""
    return TieredKVCache([HostMemoryTier(160 * KIB), SSDTier(ssd_dir, 8 << 20)], mode="exclusive")


async def test_a_forks_first_turn_waits_for_a_busy_victim_in_its_parents_tier(
    ssd_dir: Path,
) -> None:
    """The fork's first turn goes into its parent's tier, host memory, which has room
    only once conversation ``v`` moves down; while ``v`` is busy (a load under way), the
    fork waits for it instead of being refused for capacity, then is stored, and every
    history is exact."""
    prompt, mine, theirs = kv(64, 1), kv(64, 2), kv(64, 3)
    async with two_conversations_in_host_memory(ssd_dir) as c:
        await c.append("system", prompt, answer_tokens=0)
        await c.append("v", theirs, answer_tokens=1)
        assert c.where("v") == "host"
        out = {n: torch.empty(64, 4, 64, dtype=torch.float16) for n in ("k", "v")}
        async with c.load_layerwise("v", out, [["k"], ["v"]]) as load:
            fork = asyncio.ensure_future(c.append("u", mine, answer_tokens=1, parent="system"))
            await asyncio.sleep(0.3)
            assert not fork.done()  # (before: a CapacityError at once)
            await load.finished()
        await asyncio.wait_for(fork, 30)
        same(out, theirs)
        assert (c.where("u"), c.where("v")) == ("host", "ssd")
        same(await c.load("u"), cat(prompt, mine))
        same(await c.load("v"), theirs)
        await check(c)


async def test_two_forks_each_waiting_for_the_others_parent_do_not_wait_for_nothing(
    ssd_dir: Path,
) -> None:
    """Host memory holds two conversations; a fork of each starts at once. Each fork's
    first turn needs room in host memory, and the only victim is the other fork's parent,
    held by that fork: each would wait for the other. The later one gives up at once
    (a CapacityError), and the earlier one gets the room when it does: no wait of
    :data:`~tieredkv._cache.turns.BUSY_WAIT` seconds (before: both waited 10 s, then both
    were refused; under load, the two waits woke each other without end)."""
    p1, p2, mine, theirs = kv(64, 1), kv(64, 2), kv(64, 3), kv(64, 4)
    async with two_conversations_in_host_memory(ssd_dir) as c:
        await c.append("p1", p1, answer_tokens=0)
        await c.append("p2", p2, answer_tokens=0)
        assert (c.where("p1"), c.where("p2")) == ("host", "host")
        with anyio.fail_after(3):
            first, second = await asyncio.gather(
                c.append("c1", mine, answer_tokens=1, parent="p1"),
                c.append("c2", theirs, answer_tokens=1, parent="p2"),
                return_exceptions=True,
            )
        assert isinstance(first, KVMeta)
        assert isinstance(second, CapacityError), second
        assert "c2" not in c.channel
        assert (c.where("c1"), c.where("p1"), c.where("p2")) == ("host", "host", "ssd")
        same(await c.load("c1"), cat(p1, mine))
        same(await c.load("p2"), p2)
        # the refused fork can be made again once there is room
        await c.append("c2", theirs, answer_tokens=1, parent="p2")
        same(await c.load("c2"), cat(p2, theirs))
        await check(c)


async def test_a_forks_wait_for_a_busy_victim_ends_at_its_deadline_whatever_wakes_it(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the only victim stays busy past the fork's deadline, the fork is refused at
    the deadline, though other conversations keep going busy and idle meanwhile (each of
    those wakes the waiting fork, which must not take them for the end of its wait)."""
    monkeypatch.setattr(turns, "BUSY_WAIT", 0.5)
    prompt, mine, theirs, other = kv(64, 1), kv(64, 2), kv(64, 3), kv(8, 4)
    async with two_conversations_in_host_memory(ssd_dir) as c:
        await c.append("system", prompt, answer_tokens=0)
        await c.append("v", theirs, answer_tokens=1)
        await c.append("w", other, answer_tokens=1)
        await c.flush()
        assert c.where("v") == "host"
        stop = anyio.Event()

        async def churn() -> None:  # "w" goes busy and idle again, all the time
            while not stop.is_set():
                same(await c.load("w"), other)
                await anyio.lowlevel.checkpoint()

        out = {n: torch.empty(64, 4, 64, dtype=torch.float16) for n in ("k", "v")}
        async with anyio.create_task_group() as tg:
            tg.start_soon(churn)
            async with c.load_layerwise("v", out, [["k"], ["v"]]) as load:
                began = anyio.current_time()
                with pytest.raises(CapacityError, match="fork's first turn"):
                    with anyio.fail_after(5):
                        await c.append("u", mine, answer_tokens=1, parent="system")
                waited = anyio.current_time() - began
                await load.finished()
            stop.set()
        assert 0.4 <= waited < 2.0, waited
        same(out, theirs)
        assert "u" not in c.channel
        await check(c)


async def test_a_copy_writes_a_retirement_marker_only_for_retired_turns(ssd_dir: Path) -> None:
    """A conversation still recorded as retired though it lists no retired turn (over a
    shared tier, its history was taken in again while a marker of it was being written:
    the record stays until that marker is spare) is live: the copy of its next turn into
    SSD writes no marker of it there (a restart would take it for retired and serve none
    of it; the copy used to write one for any owner with a record)."""
    from tieredkv._cache.state import Retired

    ssd = SSDTier(ssd_dir, 1 << 20)
    cache = TieredKVCache([HostMemoryTier(1 << 20), ssd], mode="inclusive")
    async with cache:
        await cache.append("a", kv(8, 1), answer_tokens=1)
        await cache.flush()
        cache._core.retired["a"] = Retired([])
        await cache.append("a", kv(8, 2), answer_tokens=1)
        await cache.flush()
        assert sorted(ssd.keys()) == [("a", 0), ("a", 1)]
        same(await cache.load("a"), cat(kv(8, 1), kv(8, 2)))
