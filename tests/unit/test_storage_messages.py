"""What the storage tiers say when something goes wrong (issue 26, item 6's papercuts).

A full disk's error names the directory and what to do; closing after it logs nothing
alarming (before: ``tier 'host' closed while views of its memory are still alive``, which
meant only that a failed call's traceback still pointed at host memory); a view the
application really keeps gets a message that says what it means and that nothing is lost.
The ``fsck --repair`` message is pinned in tests/unit/test_fsck.py.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch

from tests.faults import FaultInjector
from tests.segments import SegmentFactory
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache, TierIOError


def turn(i: int) -> dict[str, torch.Tensor]:
    return {"kv": torch.full((64, 1024), i, dtype=torch.uint8)}


async def test_a_full_disk_names_the_directory_and_what_to_do(
    ssd_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An append that must demote a conversation onto an SSD whose filesystem is full
    (ENOSPC from pwrite) raises a TierIOError naming the SSD tier's directory, saying to
    free space there or lower the capacity; the close afterwards logs no warning about
    views of host memory, and nothing is lost (the demotion's victim stayed in memory and
    is written down at close, the disk having room again)."""
    cache = TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 64 << 20)])
    with FaultInjector() as faults:
        async with cache:
            faults.fail_always("pwrite", errno.ENOSPC)
            for i in range(15):  # 15 turns of 69,632 bytes fill 1 MiB of host memory
                await cache.append(f"s{i}", turn(i), answer_tokens=1)
            with pytest.raises(TierIOError) as info:  # the 16th must demote one
                await cache.append("last", turn(99), answer_tokens=1)
            faults.clear()
            stored = cache.sessions()
            message, code = str(info.value), info.value.errno
            del info  # as a program that handled the error keeps nothing of it
    assert code == errno.ENOSPC
    assert message.startswith("tier 'ssd' could not write segment 0 (69,632 bytes): ")
    assert message.endswith(
        f"; the filesystem holding {str(ssd_dir)!r} is full (or its quota is used up): "
        f"free space there, or give the tier a capacity below the space it has free "
        f"(its capacity is {64 << 20:,} bytes)"
    )
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert cache.stats().unsaved == 0
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 64 << 20)]) as again:
        assert sorted(again.sessions()) == sorted(stored)


async def test_a_full_disk_at_open_is_not_called_a_permissions_problem(ssd_dir: Path) -> None:
    """ENOSPC while the tier probes its directory at open says the filesystem is full,
    not that permissions need fixing."""
    with FaultInjector() as faults:
        faults.fail_always("pwrite", errno.ENOSPC)
        with pytest.raises(TierIOError, match=r"is full \(or its quota is used up\)") as info:
            await SSDTier(ssd_dir, 1 << 20).open()
    assert "permissions" not in str(info.value)


async def test_a_view_kept_past_close_is_explained(
    seg: SegmentFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A view of host memory the application still holds when the tier closes: the warning
    says what holds the memory, that nothing stored is lost, and how to free it."""
    s = seg()
    tier = HostMemoryTier(1 << 20)
    async with tier:
        assert tier.reserve(s.key, s.length)
        await tier.write(s.key, s.view)
        kept = tier.view(s.key)
    assert (
        f"tier 'host': closed while the application still holds a view of its memory (a "
        f"memoryview or tensor made from it, e.g. with view()); nothing stored is lost or "
        f"damaged, but its {1 << 20:,} bytes stay allocated until that view is released: drop "
        f"it to free them" in caplog.messages
    )
    assert bytes(kept) == s.data  # still valid memory, freed when released
    kept.release()


async def test_a_failed_ssd_write_does_not_blame_the_application_for_a_view(
    ssd_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An append whose SSD write fails: the error on its way out holds views of the staging
    buffer the turn was copied into (its traceback's frames), so that buffer is not reused;
    that is no view the application holds, and no warning says it is. The error says what
    failed, and the next append is stored."""
    tensors = {"k": torch.arange(1 << 20, dtype=torch.float32).reshape(256, 4096)}
    async with TieredKVCache([SSDTier(ssd_dir, 64 << 20)]) as cache:
        with FaultInjector() as faults:
            faults.fail_nth("pwrite", faults.calls["pwrite"] + 1)
            with pytest.raises(TierIOError):
                await cache.append("s", tensors, answer_tokens=1)
        assert "s" not in cache.channel
        await cache.append("s", tensors, answer_tokens=1)
        assert torch.equal((await cache.load("s"))["k"], tensors["k"])
    assert not [m for m in caplog.messages if "still holds a view" in m], caplog.messages
