"""Simulator workloads whose conversations share history, and the replay that stores a
shared range once (:mod:`tieredkv.sim.forest`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tieredkv.policies import LRU, make_eviction
from tieredkv.sim.forest import (
    Forest,
    SharedPromptWorkload,
    read_mooncake_forest,
    replay_forest,
)
from tieredkv.sim.replay import replay
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.trace import Turns
from tieredkv.sim.workloads import WORKLOAD_KINDS, WorkloadSpec, read_mooncake

MOONCAKE = (
    Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_trace_head1500.jsonl"
)
BPT = 128 * 1024  # Llama-3-8B-sized KV per token


def small(users: int = 40, seed: int = 0, **kw: object) -> SharedPromptWorkload:
    base = SyntheticWorkload(users=users, arrival_rate=0.2, seed=seed)
    return SharedPromptWorkload(base=base, **kw)  # type: ignore[arg-type]


def test_shared_prompt_workload_lists_the_prompt_and_the_parents_history() -> None:
    w = small(fork_fraction=0.2)
    f = w.generate()
    base = w.base.generate()
    first = {u: i for i, u in reversed(list(enumerate(f.turns.user.tolist())))}
    forks = 0
    for u, i in first.items():
        rs = f.ranges[i]
        assert rs[0] == ("prompt", 2048)
        if u >= base.users():  # a fork: the parent's turns, then its own first turn
            forks += 1
            assert rs[-1][0] == ("turn", u, 0)
            owners = {k[1] for k, _ in rs[1:-1]}
            assert len(owners) <= 1
            assert u not in owners
    assert forks > 0
    # every conversation's history ends with the prompt listed once: unique counts it once
    own = sum(int(t) for t in (f.turns.query + f.turns.answer).tolist())
    inherited = sum(
        sum(t for _, t in f.ranges[i][:-1]) for u, i in first.items() if u >= base.users()
    )
    prompts = base.users() * 2048
    assert f.unique_tokens() == own - inherited - prompts + 2048
    assert f.total_tokens() == own


def test_forest_rejects_ranges_that_do_not_add_up() -> None:
    turns = Turns([0, 0], [0.0, 1.0], [3, 1], [1, 1], [0, 1])
    Forest(turns, [(("a", 4),), (("a", 4), ("b", 2))])
    with pytest.raises(ValueError, match="turn 1: its ranges hold 5 tokens, its context 6"):
        Forest(turns, [(("a", 4),), (("a", 4), ("b", 1))])
    with pytest.raises(ValueError, match="listed with 4 and 6 tokens"):
        Forest(turns, [(("a", 4),), (("a", 6),)])


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "queue-enhanced", "belady", "bidaw"])
def test_without_sharing_the_replay_is_the_plain_replay(policy: str) -> None:
    f = small(users=60, seed=3, fork_fraction=0.1).generate()
    for host in (1 << 30, 3 << 30):
        plain = replay(
            f.turns, make_eviction(policy), host_bytes=host, bytes_per_token=BPT,
            history_cap=1 << 40,
        )  # fmt: skip
        r = replay_forest(
            f, make_eviction(policy), host_bytes=host, sharing=False, bytes_per_token=BPT
        )
        assert r.replay == plain
        assert r.peak_stored_bytes == r.peak_logical_bytes


def test_a_shared_range_is_held_once_and_leaves_with_its_last_lister() -> None:
    # conversations 0 and 1 share a 4-token prompt; each adds 2 tokens; 1 byte a token
    turns = Turns([0, 1, 0, 2], [0.0, 1.0, 2.0, 3.0], [5, 5, 1, 9], [1, 1, 1, 1], [0, 0, 1, 0])
    p = ("p", 4)
    ranges = [
        (p, ("a0", 2)),
        (p, ("b0", 2)),
        (p, ("a0", 2), ("a1", 2)),
        (("c0", 10),),
    ]
    f = Forest(turns, ranges)
    r = replay_forest(f, LRU(), host_bytes=10, bytes_per_token=1)
    # 0 and 1 resident: 4 + 2 + 2 = 8 held (logical 12); 0 grows to 10 held; then 2 needs
    # 10: LRU evicts 1 (frees 2: the prompt stays for 0), then 0 (frees 8)
    assert r.peak_stored_bytes == 10
    assert r.peak_logical_bytes == 6 + 8
    assert (r.replay.hits, r.replay.misses, r.replay.evictions) == (1, 0, 2)
    assert r.unique_bytes == 4 + 2 + 2 + 2 + 10
    # 1's first turn found the prompt it shares with 0 in host memory
    assert (r.prefix_bytes, r.prefix_hit_bytes) == (4, 4)
    plain = replay_forest(f, LRU(), host_bytes=10, bytes_per_token=1, sharing=False)
    # without sharing 1's first turn does not fit next to 0: 0 is evicted, its next turn misses
    assert (plain.replay.hits, plain.replay.misses) == (0, 1)
    assert (plain.prefix_bytes, plain.prefix_hit_bytes) == (0, 0)


def test_sharing_stores_the_unique_bytes_and_hits_at_least_as_often() -> None:
    # 200 conversations sharing a 2k-token prompt, 5% of turns forking
    f = SharedPromptWorkload().generate()
    unbounded = 1 << 50
    shared = replay_forest(f, LRU(), host_bytes=unbounded, bytes_per_token=BPT)
    alone = replay_forest(f, LRU(), host_bytes=unbounded, bytes_per_token=BPT, sharing=False)
    assert shared.peak_stored_bytes <= 1.05 * shared.unique_bytes
    assert alone.peak_stored_bytes > 3 * alone.unique_bytes  # every copy of the prompt
    for policy in ("lru", "bidaw"):
        host = 8 << 30
        on = replay_forest(f, make_eviction(policy), host_bytes=host, bytes_per_token=BPT)
        off = replay_forest(
            f, make_eviction(policy), host_bytes=host, bytes_per_token=BPT, sharing=False
        )
        assert on.replay.accesses == off.replay.accesses
        assert on.replay.hit_ratio >= off.replay.hit_ratio, policy
        assert on.peak_stored_bytes <= host


def test_mooncake_forest_lists_hash_blocks(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 5, "input_length": 1200, "output_length": 7, "hash_ids": [0, 3, 4]},
        {"timestamp": 9, "input_length": 1600, "output_length": 5, "hash_ids": [0, 1, 2, 5]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    f = read_mooncake_forest(str(path))
    plain = read_mooncake(path)
    assert f.turns.user.tolist() == plain.user.tolist()
    assert f.turns.query.tolist() == plain.query.tolist()
    assert f.ranges[0] == ((("block", 0), 512), (("block", 1), 512), (("own", 0, 0), 86))
    assert f.ranges[1] == ((("block", 0), 512), (("block", 3), 512), (("own", 1, 0), 183))
    # the third request continues the first: 1110 tokens of context, 490 new, 5 answered;
    # 1605 - 3 * 512 of them its own
    assert f.ranges[2] == (
        (("block", 0), 512), (("block", 1), 512), (("block", 2), 512), (("own", 0, 1), 69),
    )  # fmt: skip
    assert f.unique_tokens() == 4 * 512 + 183 + 69  # final histories: 86 was replaced


def test_mooncake_trace_forest_matches_the_turns() -> None:
    f = read_mooncake_forest(str(MOONCAKE))
    plain = read_mooncake(MOONCAKE)
    assert f.turns.user.tolist() == plain.user.tolist()
    assert f.turns.time.tolist() == plain.time.tolist()
    assert f.unique_tokens() < f.total_tokens()  # block 0 at least is shared


def test_shared_prompt_is_a_workload_kind() -> None:
    assert "shared-prompt" in WORKLOAD_KINDS
    turns = WorkloadSpec(kind="shared-prompt", minutes=5.0, seed=1).turns(12.0)
    first = turns.query[turns.round_index == 0]
    assert int(first.min()) > 2048  # the prompt, and for a fork its inherited history too
    assert turns.users() > 60  # 60 conversations and their forks
