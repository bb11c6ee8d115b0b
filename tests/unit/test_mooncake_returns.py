"""The Mooncake returns diagnostic (benchmarks/_mooncake_returns.py) on hand-made turns:
a turn counts as followed when its conversation has a later one, and each bucket counts
its turns and those followed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_scripts import benchmark_script
from tieredkv.sim.trace import Turns

HEAD = (
    Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_trace_head1500.jsonl"
)


def test_a_turn_is_followed_when_its_conversation_has_a_later_one() -> None:
    # users 7 (three turns), 8 (one), 9 (two), interleaved in time
    turns = Turns(
        user=[7, 8, 7, 9, 9, 7],
        time=[0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        query=[600, 4000, 100, 1500, 9000, 300],
        answer=[50, 250, 120, 700, 30, 10],
        round_index=[0, 0, 1, 0, 1, 2],
    )
    with benchmark_script("_mooncake_returns") as script:
        back = script.returns(turns)
        assert back == [True, False, True, True, False, False]
        assert script.shares([600, 4000, 100, 1500, 9000, 300], back, (0, 500, 2000)) == [
            (0, 2, 1),  # 100 (followed), 300 (last)
            (500, 2, 2),  # 600, 1500: both followed
            (2000, 2, 0),  # 4000, 9000: neither
        ]
        with pytest.raises(ValueError, match="below the first bucket's edge, 1"):
            script.shares([0], [True], (1, 2))
        report = script.report(turns)
    assert report.splitlines()[0] == (
        "6 turns in 3 conversations; 3 (0.50) are followed by another turn of theirs"
    )
    assert "query tokens, a later turn\n  >=0: 0.50 of 2  >=8000: 0.00 of 1" in report
    # the pace: seconds since the previous turn (user 7: 2 and 3 s; user 9: 1 s)
    assert script.gaps(turns) == (
        [None, None, 2.0, None, 1.0, 3.0],
        [2.0, None, 3.0, 1.0, None, None],
    )
    assert report.endswith(
        "seconds since the previous turn, a later turn\n  >=0 s: 0.33 of 3, next after 3 s"
    )


def test_it_reads_the_trace_head_the_tests_ship(capsys: pytest.CaptureFixture[str]) -> None:
    with benchmark_script("_mooncake_returns") as script:
        assert script.main(["--trace", str(HEAD)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1,500 turns in 1,175 conversations; 325 (0.22) are followed")
