"""A reopen that keeps only the prefix of a damaged history says so (issue 22, case 14).

Before, a reopen that found a damaged turn served the shorter history and counted nothing
(``stats().lost`` stayed 0). Now ``stats().truncated`` counts those sessions and
:meth:`TieredKVCache.truncated` names each one with what it kept, what its tiers stored,
and why; each is logged as a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tieredkv import HostMemoryTier, SessionNotFoundError, SSDTier, TieredKVCache
from tieredkv.backends.ssd import segment_file_name
from tieredkv.cache import Truncation


def turn(session: str, t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(hash((session, t)) % (1 << 31))
    return {"kv": torch.randint(0, 256, (8, 1024), dtype=torch.uint8, generator=g)}


def make(root: Path) -> TieredKVCache:
    return TieredKVCache(
        [HostMemoryTier(1 << 20), SSDTier(root / "ssd", 64 << 20)], mode="inclusive"
    )


def path(root: Path, session: str, seq: int) -> Path:
    return root / "ssd" / "segments" / segment_file_name((session, seq))


def damage_header(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[40] ^= 0xFF  # inside the msgpack header: its CRC fails at open
    file.write_bytes(bytes(raw))


STORED = {"a": 3, "b": 3, "c": 2, "e": 2}


@pytest.fixture
async def damaged(tmp_path: Path) -> Path:
    """a: turn 1's header damaged; b: turn 2's (the last); c: turn 0's file deleted; e whole."""
    async with make(tmp_path) as cache:
        for session, turns in STORED.items():
            for t in range(turns):
                await cache.append(session, turn(session, t), answer_tokens=2)
    damage_header(path(tmp_path, "a", 1))
    damage_header(path(tmp_path, "b", 2))
    path(tmp_path, "c", 0).unlink()
    return tmp_path


async def test_reopen_reports_each_truncated_history(
    damaged: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reopen serves a's first turn and b's first two, byte for byte, and c not at all;
    stats().truncated is 3; truncated() names a, b and c with turns kept, turns stored and
    why; a warning names each; e, whole, is not mentioned."""
    cache = make(damaged)
    async with cache:
        assert cache.stats().truncated == 3
        assert cache.truncated() == {
            "a": Truncation(
                session="a", turns=1, stored=3, reason="turn 1 was damaged (quarantined)"
            ),
            "b": Truncation(
                session="b", turns=2, stored=3, reason="turn 2 was damaged (quarantined)"
            ),
            "c": Truncation(session="c", turns=0, stored=2, reason="turn 0 is missing"),
        }
        for session, kept in (("a", 1), ("b", 2), ("e", 2)):
            got = await cache.load(session)
            want = torch.cat([turn(session, t)["kv"] for t in range(kept)])
            assert torch.equal(got["kv"], want)
            assert cache.channel[session].turns == kept
        with pytest.raises(SessionNotFoundError):
            await cache.load("c")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        "session 'a' came back with 1 of the 3 turns its tiers stored: turn 1 was damaged "
        "(quarantined)" in warnings
    )
    assert (
        "session 'c' came back with 0 of the 2 turns its tiers stored: turn 0 is missing"
        in warnings
    )
    assert not any("'e'" in w for w in warnings)


async def test_a_later_clean_reopen_reports_nothing(damaged: Path) -> None:
    """truncated() is about the last open: a reopen of what that open kept reports none."""
    async with make(damaged):
        pass
    async with make(damaged) as cache:
        assert cache.truncated() == {}
        assert cache.stats().truncated == 0
        assert sorted(cache.sessions()) == ["a", "b", "e"]
