"""SIGKILL a real writer process at random points; what survives must be exact.

The child (:mod:`tests.integration.crash_writer`) appends deterministic segments of 4 KiB
to 3 MB to a few sessions and acks each append once it returns. The parent kills it at a
random moment (after a random number of acks, plus a random delay that often lands in the
middle of a write), several rounds on the same directory, then reopens the cache here and
checks every recovered session byte for byte.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import time
from pathlib import Path

import anyio
import pytest
import torch

from tests.integration.crash_writer import SESSIONS, make_cache, tensors_for
from tests.killed_writer import complete_lines, start_writer

WRITER = Path(__file__).with_name("crash_writer.py")
SCALE = int(os.environ.get("TIEREDKV_CAMPAIGN_SCALE", "1"))
"""Multiplies the kill rounds (the long campaign: see tests/integration/test_fault_campaign.py)."""
SEED = int(os.environ.get("TIEREDKV_CAMPAIGN_SEED", "0"))
"""Shifts every round's seed (a sweep runs the test at many: 0 is what CI runs)."""


def start(directory: Path, mode: str, seed: int, log: Path) -> subprocess.Popen[bytes]:
    """Start a writer that waits (its imports done) until :func:`run_and_kill` lets it go."""
    with log.open("ab") as err:
        return start_writer(WRITER, [str(directory), mode, str(seed), "--wait"], err, stdin=True)


def run_and_kill(proc: subprocess.Popen[bytes], seed: int, log: Path) -> dict[int, int]:
    """Let the writer ``proc`` (:func:`start`) go, SIGKILL it at a random point; the highest
    acked seq per session."""
    rng = random.Random(seed)
    kill_after = rng.randint(2, 10)
    acked: dict[int, int] = {}
    last_ack = interval = 0.0
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        deadline = time.monotonic() + 60
        count = 0
        while count < kill_after:
            ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
            line = proc.stdout.readline().decode() if ready else ""
            if not line:
                pytest.fail(f"writer exited or stalled: {log.read_text()[-2000:]}")
            words = line.split()
            if words[0] == "acked":
                acked[int(words[1])] = int(words[2])
                count += 1
                now = time.monotonic()
                interval, last_ack = now - last_ack, now
        # somewhere within the next append (one append takes about `interval`)
        time.sleep(rng.uniform(0, interval))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # acks the writer printed while we slept count too (a torn last line does not)
        for words in complete_lines(proc.stdout.read()):
            if len(words) == 3 and words[0] == "acked":
                acked[int(words[1])] = int(words[2])
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return acked


async def check_recovered(directory: Path, mode: str, acked: dict[int, int]) -> dict[str, int]:
    """Reopen the cache; every session is byte-identical to its expected data; acked appends
    are all there in SSD-only mode. Returns the recovered turns per session."""
    turns: dict[str, int] = {}
    async with make_cache(directory, mode) as cache:
        # the tier cleared interrupted writes at open; nothing was damaged
        assert list((directory / "tmp").iterdir()) == []
        assert list((directory / "quarantine").iterdir()) == []
        for session in cache.sessions():
            assert session in SESSIONS
            meta = cache.channel.get(session)
            assert meta is not None
            turns[session] = meta.turns
            got = await cache.load(session)
            parts = [tensors_for(session, seq) for seq in range(meta.turns)]
            for name in ("k", "v"):
                expected = torch.cat([p[name] for p in parts])
                assert torch.equal(got[name], expected), (session, name, meta.turns)
        stats = cache.stats()
        assert stats.corrupt == 0
        assert all(t.corrupt == 0 for t in stats.tiers)
    if mode == "ssd":
        for index, seq in acked.items():
            recovered = turns.get(SESSIONS[index], 0)
            # every acked append is durable; at most the one append in flight at the kill
            # (never acked) may also have made it
            assert seq + 1 <= recovered <= seq + 2, (SESSIONS[index], seq, recovered)
    return turns


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "rounds"), [("ssd", 8), ("inclusive", 3)])
def test_sigkill_at_random_points_serves_only_exact_data(
    tmp_path: Path, mode: str, rounds: int
) -> None:
    """Several kill rounds on one directory: after each, every recovered segment loads
    byte-identical, no acked (SSD-only) append is lost, no temp file or corrupt data."""
    directory = tmp_path / "ssd"
    log = tmp_path / "writer.log"
    previous: dict[str, int] = {}
    total_acks = 0
    seeds = [SEED + 1000 * r + len(mode) for r in range(rounds * SCALE)]
    # each round's writer starts (imports torch and tieredkv) while the round before it
    # is checked; it touches the directory only once its round lets it go
    writer = start(directory, mode, seeds[0], log)
    try:
        for r, seed in enumerate(seeds):
            acked = run_and_kill(writer, seed, log=log)
            if r + 1 < len(seeds):
                writer = start(directory, mode, seeds[r + 1], log)
            total_acks += len(acked)
            turns = anyio.run(check_recovered, directory, mode, acked)
            for session, n in previous.items():  # what was recovered once stays
                if mode == "ssd":
                    assert turns.get(session, 0) >= n
            previous = turns
    finally:
        if writer.poll() is None:  # (a round that failed: the next one's writer waits)
            writer.kill()
            writer.communicate()  # reaps it and closes its pipes
    assert total_acks >= rounds
    print(f"\nkill rounds ({mode}): {rounds * SCALE}, acknowledged appends: {total_acks}")
    assert sum(previous.values()) > 0
