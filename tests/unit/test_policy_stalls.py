"""The policy-stalls diagnostic (benchmarks/_policy_stalls.py) names what made a long
``on_access`` call: here the reuse tracker's new tree (begun when three quarters of its
65,536 positions are taken, taking over some thousands of accesses later) and the new heap
of hint deadlines (once superseded hints are half of the old one)."""

from __future__ import annotations

from tests.benchmark_scripts import benchmark_script


def test_the_long_calls_are_put_down_to_their_rebuilds() -> None:
    with benchmark_script("_policy_stalls") as script:
        # 2,000 users, 35 accesses each: 70,000 accesses, past the tracker's 65,536
        # positions once; every access hints, so superseded hints pile up again and again
        times, slow = script.stalls(2_000, 35, hints=True, over_ns=0)
        assert len(times) == 70_000
        causes = [cause for _, _, cause in slow]
        assert len(slow) == len(times)  # (over 0 ns: every call is listed)
        starts = [i for i, _, cause in slow if cause == "tracker start"]
        takeovers = [i for i, _, cause in slow if cause == "tracker takeover"]
        assert starts == [49_152]
        assert len(takeovers) == 1
        assert 49_152 < takeovers[0] <= 49_152 + 65_536 // 7 + 1
        assert causes.count("hints") >= 10
        _, quiet = script.stalls(2_000, 3, hints=False, over_ns=0)
        assert "hints" not in {cause for _, _, cause in quiet}
