"""The real cache's replay of workloads that share history (benchmarks/bench_forest_replay.py):
its byte check tells a wrong history from the right one, a small replay counts what the
cache served (``where()`` and the cache's own hit counter agree, every load matches), and
at the benchmark's small size sharing raises the host hit ratio on the shared-prompt
workload, for the real cache as for the simulator."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tieredkv.sim.forest import SharedPromptWorkload
from tieredkv.sim.synthetic import SyntheticWorkload

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_forest_replay import Content, cut, replay_real  # noqa: E402


def test_the_byte_check_tells_a_wrong_history_from_the_right_one() -> None:
    content = Content(32)
    a = content.source("a", 300)
    b = content.source("b", 200)
    history = [(a, 0, 300), (b, 0, 120)]
    got = content.tensor(history)
    assert got["kv"].shape == (420, 16)
    assert got["kv"].dtype == torch.float16
    assert content.matches(got, history)
    assert content.matches(content.tensor(cut(history, 350)), [(a, 0, 300), (b, 0, 50)])
    # one token's bits changed
    bits = got["kv"].clone().view(torch.int16)
    bits[333, 7] ^= 1
    assert not content.matches({"kv": bits.view(torch.float16)}, history)
    # short, long, another range in its place, a splice of two others' tokens
    assert not content.matches(content.tensor(cut(history, 419)), history)
    assert not content.matches(content.tensor([*history, (b, 120, 1)]), history)
    assert not content.matches(content.tensor([(a, 0, 300), (a, 0, 120)]), history)
    assert not content.matches(content.tensor([(a, 0, 300), (b, 1, 120)]), history)
    assert not content.matches({"kv": got["kv"], "v": got["kv"]}, history)
    # a source's tokens depend on the source and the place only: another run agrees
    other = Content(32)
    assert other.source("a", 300) == a
    again = other.tensor([(a, 0, 300)])["kv"].view(torch.int16)
    assert torch.equal(again, got["kv"][:300].view(torch.int16))


def test_a_small_replay_counts_what_the_cache_served(tmp_path: Path) -> None:
    forest = SharedPromptWorkload(
        base=SyntheticWorkload(users=4, arrival_rate=0.2, seed=3), fork_fraction=0.2
    ).generate()
    returning = int((forest.turns.round_index > 0).sum())
    results = {}
    for sharing in (False, True):
        directory = tmp_path / str(sharing)
        results[sharing] = asyncio.run(
            replay_real(
                forest,
                policy="bidaw",
                host_bytes=384 << 10,
                sharing=sharing,
                bytes_per_token=64,
                roots=[(("prompt", 2048),)],
                directory=str(directory),
            )
        )
    off, on = results[False], results[True]
    for r in (off, on):
        assert r.wrong == 0, r
        assert r.disagreed == 0, r
        assert r.hits + r.misses == returning, r
        assert r.hits > 0, r  # the host size makes both happen
        assert r.misses > 0, r
    assert off.forks == 0
    # every conversation (base and fork) forks at its first turn
    assert on.forks + on.refused == forest.turns.users()
    assert on.held_bytes < off.held_bytes / 2  # the prompt is stored once, not per conversation
    assert on.hits > off.hits


@pytest.mark.slow  # about 2 minutes on a busy 2-core machine
def test_sharing_raises_the_host_hit_ratio_on_the_shared_prompt_workload() -> None:
    done = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "bench_forest_replay.py", "--users", "30",
         "--gb", "2", "--mooncake-limit", "300", "--mooncake-gb", "16"],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr  # 1 if a load came back wrong
    assert "loads byte-checked: all equal" in out
    prompt, mooncake = out.split("== Mooncake")
    row = re.compile(
        r"^ +2 +[\d.]+ (?P<policy>\w+) +(?P<off>[\d.]+) +(?P<on>[\d.]+) +(?P<soff>[\d.]+) "
        r"+(?P<son>[\d.]+) +(?P<poff>[\d.]+) +(?P<pon>[\d.]+) +(?P<held_off>[\d.]+) "
        r"+(?P<held_on>[\d.]+)",
        re.M,
    )
    rows = {m["policy"]: m for m in row.finditer(prompt)}
    assert set(rows) == {"bidaw", "lru"}, out
    for m in rows.values():
        assert float(m["on"]) > float(m["off"]) + 0.05, out  # the real cache
        assert float(m["son"]) > float(m["soff"]) + 0.05, out  # the simulator
        assert float(m["pon"]) > float(m["poff"]) + 0.05, out  # holding the real's tokens
        assert float(m["held_on"]) < float(m["held_off"]) / 2, out
    assert re.search(r"^ +16 +4.0 bidaw ", mooncake, re.M), out
