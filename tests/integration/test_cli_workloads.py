"""``tieredkv simulate --workload shared-prompt`` and ``--workload agentic``: each runs at
a tiny size, its options reach the workload (the table's turn and user counts are the
workload's own), shared-prompt prints the bytes sharing would save (computed here from the
workload's ranges), and misplaced or out-of-range options are refused in one line."""

from __future__ import annotations

import re

import pytest

from tieredkv.cli import main
from tieredkv.cli._workload import GENERATED, WORKLOADS
from tieredkv.sim.costmodel import get_model
from tieredkv.sim.workloads import GENERATED_KINDS, WORKLOAD_KINDS, WorkloadSpec

TINY = ["--minutes", "2", "--rate", "5", "--systems", "ideal,bidaw", "--no-progress"]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def _counts(out: str, kind: str) -> tuple[int, int]:
    """The turns and users the table's heading names."""
    m = re.search(rf"{kind} workload, 5 users/min: ([\d,]+) turns of ([\d,]+) users", out)
    assert m is not None, out
    return int(m[1].replace(",", "")), int(m[2].replace(",", ""))


def _rows(out: str) -> dict[str, list[str]]:
    return {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("ideal", "bidaw")
    }


def test_the_choices_are_the_simulators_workloads_and_defaults() -> None:
    assert set(WORKLOADS) == set(WORKLOAD_KINDS)
    assert set(GENERATED) == set(GENERATED_KINDS)
    spec = WorkloadSpec()
    from tieredkv.cli import _workload

    assert spec.prompt_tokens == _workload._PROMPT_TOKENS
    assert spec.fork_fraction == _workload._FORK_FRACTION
    assert spec.agent_share == _workload._AGENT_SHARE


@pytest.mark.parametrize(("prompt", "forks"), [(None, None), (512, 0.3)])
def test_shared_prompt_runs_and_prints_stored_next_to_unique_bytes(
    capsys: pytest.CaptureFixture[str], prompt: int | None, forks: float | None
) -> None:
    argv = ["simulate", "--workload", "shared-prompt", "--model", "llama-3-8b", *TINY]
    if prompt is not None:
        argv += ["--prompt-tokens", str(prompt), "--fork-fraction", str(forks)]
    out = _run(capsys, argv)
    spec = WorkloadSpec(
        kind="shared-prompt",
        minutes=2,
        prompt_tokens=prompt if prompt is not None else 2048,
        fork_fraction=forks if forks is not None else 0.05,
    )
    forest = spec.forest(5)
    assert forest is not None
    assert _counts(out, "shared-prompt") == (len(forest.turns), forest.turns.users())
    rows = _rows(out)
    assert set(rows) == {"ideal", "bidaw"}
    assert float(rows["ideal"][0]) > 0  # a mean latency
    per_token = get_model("llama-3-8b").kv_bytes_per_token
    stored = forest.total_tokens() * per_token
    unique = forest.unique_tokens() * per_token
    assert (
        f"Shared history: the conversations' final histories hold {stored / 1e9:,.1f} GB of "
        f"llama-3-8b KV, stored whole by every system here (the simulator does not share "
        f"history); their distinct ranges (the system prompt and forked turns once) hold "
        f"{unique / 1e9:,.1f} GB (the histories hold {stored / unique:.2f}x that)."
    ) in " ".join(out.split())
    assert stored > 2 * unique  # several conversations list one prompt


def test_the_prompt_and_fork_options_reach_the_workload() -> None:
    """A longer prompt and more forks make a different workload (so the counts the tests
    above compare could not match by accident)."""
    base = WorkloadSpec(kind="shared-prompt", minutes=2).forest(5)
    other = WorkloadSpec(kind="shared-prompt", minutes=2, prompt_tokens=512, fork_fraction=0.3)
    forest = other.forest(5)
    assert base is not None
    assert forest is not None
    assert forest.turns.users() > base.turns.users()  # forks are conversations of their own
    first = base.turns.round_index == 0
    assert int(base.turns.query[first].min()) > 2048  # the prompt counts in a first turn
    assert int(forest.turns.query[forest.turns.round_index == 0].min()) <= 2048


@pytest.mark.parametrize("share", [None, "0", "1"])
def test_agentic_runs_with_its_agent_share(
    capsys: pytest.CaptureFixture[str], share: str | None
) -> None:
    argv = ["simulate", "--workload", "agentic", *TINY]
    if share is not None:
        argv += ["--agent-share", share]
    out = _run(capsys, argv)
    spec = WorkloadSpec(
        kind="agentic", minutes=2, agent_share=float(share) if share is not None else 0.5
    )
    turns = spec.turns(5)
    assert _counts(out, "agentic") == (len(turns), turns.users())
    assert set(_rows(out)) == {"ideal", "bidaw"}
    assert "Shared history" not in out


def test_agents_make_more_turns_than_humans() -> None:
    humans = WorkloadSpec(kind="agentic", minutes=2, agent_share=0).turns(5)
    agents = WorkloadSpec(kind="agentic", minutes=2, agent_share=1).turns(5)
    assert humans.users() == agents.users() == 10
    assert len(agents) > len(humans)


def test_the_help_says_the_simulator_stores_shared_history_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{synthetic,bidaw,sharegpt,mooncake,shared-prompt,agentic}" in text
    assert "The serving simulator stores every conversation's whole history" in text
    assert "--prompt-tokens PROMPT_TOKENS shared-prompt: tokens of the system prompt" in text
    assert "--agent-share AGENT_SHARE agentic: fraction of the conversations" in text


REFUSED = [
    (["--prompt-tokens", "100"], "--prompt-tokens is read by --workload shared-prompt (the "
     "synthetic workload has no such setting): drop it or choose --workload shared-prompt"),
    (["--workload", "agentic", "--fork-fraction", "0.1"], "--fork-fraction is read by "
     "--workload shared-prompt (the agentic workload"),
    (["--workload", "shared-prompt", "--agent-share", "0.5"], "--agent-share is read by "
     "--workload agentic"),
    (["--workload", "shared-prompt", "--prompt-tokens", "-1"], "--prompt-tokens must be at "
     "least 0 (got -1)"),
    (["--workload", "shared-prompt", "--fork-fraction", "1.5"], "--fork-fraction must be a "
     "fraction from 0 to 1 (got 1.5)"),
    (["--workload", "agentic", "--agent-share", "-0.1"], "--agent-share must be a fraction "
     "from 0 to 1 (got -0.1)"),
    (["--workload", "agentic", "--agent-share", "nan"], "--agent-share must be a fraction"),
    (["--workload", "shared-prompt", "--trace", "x.jsonl"], "--trace is read by --workload "
     "bidaw, sharegpt or mooncake; the shared-prompt workload is generated"),
    (["--workload", "agentic", "--minutes", "1e6"], "--minutes/--rate: 25 users/min for "
     "1e+06 minutes is 25,000,000 users; a generated workload holds at most 200,000"),
    (["--workload", "shared-prompt", "--minutes", "1e6"], "holds at most 200,000"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
@pytest.mark.parametrize("command", ["simulate", "reproduce"])
def test_misplaced_or_out_of_range_options_are_refused(
    capsys: pytest.CaptureFixture[str], command: str, argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"tieredkv {command}: error: ")
    if command == "reproduce":
        message = (
            message.replace("--minutes/--rate:", "--minutes/--rates/--rate:")
            .replace("25 users/min", "40 users/min")
            .replace("25,000,000", "40,000,000")
        )
    assert message in lines[0]


def test_a_workload_spec_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"prompt_tokens must be >= 0 \(got -5\)"):
        WorkloadSpec(kind="shared-prompt", prompt_tokens=-5)
    with pytest.raises(ValueError, match=r"fork_fraction must be in \[0, 1\] \(got 2\)"):
        WorkloadSpec(kind="shared-prompt", fork_fraction=2)
    with pytest.raises(ValueError, match=r"agent_share must be in \[0, 1\]"):
        WorkloadSpec(kind="agentic", agent_share=-1)
    assert WorkloadSpec(kind="synthetic").forest(5) is None
    with pytest.raises(ValueError, match="holds at most 200,000"):
        WorkloadSpec(kind="agentic", minutes=1e6).turns(25)
