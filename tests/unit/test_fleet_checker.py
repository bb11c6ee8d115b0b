"""The fleet campaign's checker (benchmarks/fleet_campaign.py) on hand-made logs: a fork
whose replica was killed before it could check which history of its parent the cache
forked (the parent's current one, maybe newer than the replica's view) is judged against
every history the parent could have had; a checked fork is not."""

from __future__ import annotations

from typing import Any

from tests.benchmark_scripts import benchmark_script


def _append(
    r: int, t: float, conv: str, tag: int, tokens: int, base: list[int], **fork: Any
) -> list[dict[str, Any]]:
    begin = {"r": r, "i": 1, "op": "append", "ph": "begin", "t0": t, "conv": conv, "tag": tag}
    begin.update(tokens=tokens, base=base, **fork)
    end = {"r": r, "i": 1, "op": "append", "ph": "end", "t0": t, "t1": t + 0.01, "conv": conv}
    end.update(tag=tag, ok=True)
    return [begin, end]


def _logs(checked: bool) -> list[dict[str, Any]]:
    """Replica 0 saw ``c7`` = [71] and forks it at 56 tokens, but the cache forks the
    parent's current history, replica 1's [11, 13]: the fork holds 16 + 40 tokens of it.
    Replica 0 is killed before its check (``checked``: it checked, and logged no rebase)."""
    records = [
        *_append(1, 1.0, "c7", 71, 256, []),
        *_append(1, 2.0, "c7", 11, 16, []),  # (c7 dropped and begun again: not logged here)
        *_append(1, 2.1, "c7", 13, 256, [11]),
        *_append(0, 3.0, "f2", 290, 256, [71], fork="c7", inherited=[[71, 56]]),
    ]
    if checked:
        records.append({"r": 0, "i": 1, "op": "fork-checked", "tag": 290})
    served = [[11, 16], [13, 40], [290, 256]]
    load = {"r": 0, "i": 2, "op": "load", "t0": 4.0, "t1": 4.01, "conv": "f2", "ok": True}
    return [*records, {**load, "turns": served}]


def test_an_unchecked_fork_may_hold_any_history_of_its_parent_at_its_fork_point() -> None:
    with benchmark_script("fleet_campaign") as campaign:
        assert campaign.check(_logs(checked=False), [], campaign.Options()).wrong == []
        wrong = campaign.check(_logs(checked=True), [], campaign.Options()).wrong
    assert wrong
    assert all("f2" in w for w in wrong)


def test_the_report_tells_the_story_of_the_first_wrong_history() -> None:
    """With a wrong history, the report prints the log records of its turns' appends (and
    of its conversation's loads) in time order: a CI failure, whose logs are gone, can be
    read from its output alone."""
    with benchmark_script("fleet_campaign") as campaign:
        result = campaign.check(_logs(checked=True), [], campaign.Options())
    story = "\n".join(result.lines())
    assert len(result.wrong) == 1
    begins = [line for line in result.story if '"ph": "begin"' in line]
    assert [int(line.split('"tag": ')[1].split(",")[0]) for line in begins] == [11, 13, 290]
    assert '"fork": "c7"' in begins[-1]
    assert all(line in story for line in (f"    {line}" for line in result.story))


def test_a_fork_checked_after_another_replica_appended_to_it_is_still_seen_rebased() -> None:
    """The check's load finds the fork's turn wherever it is: last, or followed by a turn
    another replica appended after taking the fork over (what the fork inherited is then
    still known); a history without the fork's turn says nothing of it."""
    inherited = [(71, 56)]
    current = [(11, 16), (13, 40)]
    with benchmark_script("fleet_campaign") as campaign:
        assert campaign.rebased([*current, (290, 256)], (290, 256), inherited) == current
        after = [*current, (290, 256), (100005, 16)]
        assert campaign.rebased(after, (290, 256), inherited) == current
        assert campaign.rebased([(71, 56), (290, 256), (5, 16)], (290, 256), inherited) is None
        assert campaign.rebased([(11, 16), (7, 256)], (290, 256), inherited) is None
