"""SIGKILL a real process that forks, appends and drops conversations; a restart finds
every acknowledged operation, at most the one in flight besides, each fork whole or
absent, no dropped conversation back, and every history byte for byte."""

from __future__ import annotations

import os
import random
import select
import signal
import time
from pathlib import Path

import anyio
import pytest
import torch

from tests.integration.forest_crash_writer import Parts, model, script
from tests.killed_writer import complete_lines, start_writer
from tieredkv import SSDTier, TieredKVCache
from tieredkv.fsck import check_directory

from ..invariants import problems

WRITER = Path(__file__).with_name("forest_crash_writer.py")
SEED = int(os.environ.get("TIEREDKV_CAMPAIGN_SEED", "0"))
"""Shifts every round's seed (a sweep runs the test at many: 0 is what CI runs)."""


def run_and_kill(directory: Path, seed: int, log: Path) -> int:
    """Start the writer, SIGKILL it at a random point; the last operation acknowledged."""
    rng = random.Random(seed)
    kill_after = rng.randint(5, 40)
    acked = -1
    with log.open("ab") as err:
        proc = start_writer(WRITER, [str(directory), str(seed)], err)
        assert proc.stdout is not None
        try:
            deadline = time.monotonic() + 120
            while acked + 1 < kill_after:
                ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
                line = proc.stdout.readline().decode() if ready else ""
                if not line:
                    raise AssertionError(f"the writer stopped early (see {log})")
                if line.startswith("acked "):
                    acked = int(line.split()[1])
            time.sleep(rng.uniform(0, 0.02))  # often in the middle of the next operation
        finally:
            proc.send_signal(signal.SIGKILL)
            rest, _ = proc.communicate()  # acks the child wrote before it died
    for words in complete_lines(rest):  # (a line torn by the kill is no ack)
        if len(words) == 2 and words[0] == "acked":
            acked = int(words[1])
    return acked


def _same(got: dict[str, torch.Tensor], parts: Parts) -> bool:
    return all(torch.equal(got[n], torch.cat([p[n] for p in parts])) for n in parts[0])


async def recovered(directory: Path, seed: int, acked: int) -> int:
    """Check what a restart finds; which of the two allowed states it is (0: the
    acknowledged operations, 1: and the one in flight)."""
    ops = script(seed, acked + 2)
    states = [model(seed, ops[: acked + 1]), model(seed, ops[: acked + 2])]
    kind, key, _, _ = ops[acked + 1]
    async with TieredKVCache([SSDTier(directory, 1 << 30)]) as cache:
        assert problems(cache) == []
        cut = cache.truncated()
        if kind == "drop" and cut:
            # a drop cut short: its first turn went first, so nothing of it is served;
            # recovery reports (and deletes) the rest
            assert list(cut) == [key], cut
            assert cut[key].turns == 0, cut
        else:
            assert cut == {}
        keys = set(cache.sessions())
        which = [i for i, s in enumerate(states) if set(s) == keys]
        assert which, (sorted(keys), [sorted(s) for s in states])
        for i in which:
            loads = [_same(await cache.load(k), states[i][k]) for k in sorted(keys)]
            if all(loads):
                return i
        raise AssertionError(f"a history differs from both allowed states ({which})")


@pytest.mark.slow  # a child process per round (torch import): about 30 s
def test_sigkill_while_forking_leaves_forks_whole_or_absent(tmp_path: Path) -> None:
    log = tmp_path / "writer.log"
    seen = []
    for r in range(4):
        directory = tmp_path / f"round{r}"
        seed = SEED + 7 + r
        acked = run_and_kill(directory, seed=seed, log=log)
        seen.append(anyio.run(recovered, directory, seed, acked))
        assert check_directory(directory).clean
    print(f"\nkill rounds: {len(seen)}; in-flight operation found done in {sum(seen)}")
