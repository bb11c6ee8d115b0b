"""The ``tieredkv`` command checks every argument before any work.

Each rejection ends with one line on standard error naming the argument, exit status 2,
and no traceback. The rejections of ``reproduce`` would otherwise surface only after the
whole experiment (minutes), so a test that finishes at all shows the check came first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tieredkv.cli import main
from tieredkv.sim.trace import HEADER

MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "mooncake"
MOONCAKE_TRACE = MOONCAKE / "conversation_trace_head1500.jsonl"


def _rejected(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``argv``; check the exit status and the one-line error, and return that line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    # unknown options are reported by the top-level parser, as "tieredkv: error: ..."
    assert lines[0].startswith((f"tieredkv {argv[0]}: error: ", "tieredkv: error: ")), lines[0]
    return lines[0]


BAD_ARGUMENTS = [
    # the parser's own checks are one line too
    (["simulate", "--rate", "fast"], "argument --rate: invalid float value: 'fast'"),
    (["reproduce", "--jobs", "two"], "argument --jobs: invalid int value: 'two'"),
    (["simulate", "--workload", "nope"], "argument --workload: invalid choice: 'nope'"),
    (["demo", "--conversations", "0"], "--conversations must be at least 1 (got 0)"),
    (["demo", "--turns", "-2"], "--turns must be at least 1 (got -2)"),
    (["demo", "--host-mb", "0"], "--host-mb must be a positive number (got 0)"),
    (["demo", "--host-mb", "nan"], "--host-mb must be a positive number (got nan)"),
    (["demo", "--seed", "-1"], "--seed must be at least 0 (got -1)"),
    (["demo", "--metrics-port", "70000"], "--metrics-port must be in 0-65535 (got 70000)"),
    (["costs", "--model", "gpt-9"], "--model: unknown model 'gpt-9'; presets: "),
    (["simulate", "--rate", "0"], "--rate must be a positive number (got 0)"),
    (["simulate", "--rate", "inf"], "--rate must be a positive number (got inf)"),
    (["simulate", "--eviction", "foo"], "--eviction: unknown eviction policy 'foo'; known: "),
    (["simulate", "--scheduler", "sjf"], "--scheduler: unknown scheduler policy 'sjf'; known: "),
    (["simulate", "--model", "gpt-9"], "--model: unknown model 'gpt-9'; presets: "),
    (["simulate", "--gpu", "tpu"], "--gpu: unknown GPU 'tpu'; presets: "),
    (["simulate", "--systems", " , "], "--systems names no system"),
    (["simulate", "--systems", "vllm,sglang"], "--systems: unknown system 'sglang'; presets: "),
    (["simulate", "--host-mem", "0"], "--host-mem must be a positive number (got 0)"),
    (["simulate", "--ssd-bw", "-1.5"], "--ssd-bw must be a positive number (got -1.5)"),
    (["simulate", "--minutes", "0"], "--minutes must be a positive number (got 0)"),
    (["simulate", "--seed", "-3"], "--seed must be at least 0 (got -3)"),
    (["simulate", "--workload", "bidaw"], "--workload bidaw needs its trace file: add --trace"),
    (["reproduce", "--workload", "mooncake"], "--workload mooncake needs its trace file"),
    (["reproduce", "--jobs", "0"], "--jobs must be at least 1 (got 0)"),
    (["reproduce", "--jobs", "-4"], "--jobs must be at least 1 (got -4)"),
    (["reproduce", "--rates", "10,fast"], "--rates must be numbers separated by commas"),
    (["reproduce", "--rates", ","], "--rates names no rate"),
    (["reproduce", "--rates", "10,-5"], "every rate of --rates must be a positive number"),
    (["reproduce", "--rates", "-5,10"], "every rate of --rates must be a positive number (got -5)"),
    (["reproduce", "--rates", "-.5"], "every rate of --rates must be a positive number (got -0.5)"),
    (["reproduce", "--rates"], "argument --rates: expected a value after it (write a value that"),
    (["reproduce", "--rate", "0"], "--rate must be a positive number (got 0)"),
    (["reproduce", "--slo", "0"], "--slo must be a positive number (got 0)"),
    (["reproduce", "--eviction", "lru"], "unrecognized arguments: --eviction lru"),
    # a generated workload's users (rate x minutes) are bounded, refused before any memory
    (["simulate", "--minutes", "1e6"], "--minutes/--rate: 25 users/min for 1e+06 minutes is "
     "25,000,000 users; a generated workload holds at most 200,000 in memory (lower the rate "
     "or the minutes)"),
    (["simulate", "--rate", "1e9"], "--minutes/--rate: 1e+09 users/min for 40 minutes is "
     "40,000,000,000 users; a generated workload holds at most 200,000"),
    (["simulate", "--rate", "1e308", "--minutes", "1e308"], "is inf users; a generated"),
    (["simulate", "--workload", "sharegpt", "--minutes", "1e6"], "holds at most 200,000"),
    (["reproduce", "--minutes", "1e6"], "--minutes/--rates/--rate: 40 users/min for 1e+06 "
     "minutes is 40,000,000 users"),
    (["reproduce", "--rates", "5,1e12"], "1e+12 users/min for 40 minutes"),
    (["reproduce", "--rate", "1e12"], "1e+12 users/min for 40 minutes"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"), BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS]
)
def test_a_bad_argument_is_one_line_and_exit_status_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in _rejected(capsys, argv)


def test_an_output_folder_that_cannot_be_written_is_refused_before_the_experiment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _rejected(capsys, ["reproduce", "--out", "/proc/tieredkv-report"])
    assert "--out /proc/tieredkv-report: cannot write a report there" in line
    assert not Path("/proc/tieredkv-report").exists()


def test_an_output_path_that_is_a_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "report").write_text("keep me")
    line = _rejected(capsys, ["reproduce", "--out", str(tmp_path / "report")])
    assert "exists and is not a folder" in line
    assert (tmp_path / "report").read_text() == "keep me"


def _bidaw(tmp_path: Path, *rows: str) -> str:
    path = tmp_path / "trace.txt"
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    return str(path)


def _mooncake(tmp_path: Path, *records: dict[str, object]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_trace_files_are_checked(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def refused(workload: str, trace: str) -> str:
        return _rejected(capsys, ["simulate", "--workload", workload, "--trace", trace])

    missing = str(tmp_path / "missing.txt")
    assert f"--trace {missing}: does not exist" in refused("bidaw", missing)
    assert f"--trace {tmp_path}: is a folder" in refused("bidaw", str(tmp_path))
    empty = _bidaw(tmp_path)
    assert f"--trace {empty}: the trace has no turns (expected lines of: {HEADER})" in refused(
        "bidaw", empty
    )
    negative = _bidaw(tmp_path, "1 0.0 100 20 0", "1 30.0 -40 20 1")
    assert "must be >= 0 in every turn" in refused("bidaw", negative)
    torn = _bidaw(tmp_path, "1 0.0 100 20 0", "2 3.5 80")
    assert f"{torn}:3: expected 5 numeric columns" in refused("bidaw", torn)

    record = {"timestamp": 0, "input_length": 700, "output_length": 30, "hash_ids": [0, 1]}
    assert "the trace has no requests" in refused("mooncake", _mooncake(tmp_path))
    bad = _mooncake(tmp_path, record, {**record, "output_length": -30})
    assert f"{bad}:2: negative output_length -30" in refused("mooncake", bad)
    garbled = tmp_path / "garbled.jsonl"
    garbled.write_text(json.dumps(record) + "\n{not json\n")
    assert f"{garbled}:2: expected a JSON object" in refused("mooncake", str(garbled))
    line = _rejected(
        capsys,
        ["simulate", "--workload", "mooncake", "--trace", str(bad), "--trace", str(bad)],
    )
    assert "--workload mooncake reads one file; got 2 --trace options" in line
    line = _rejected(capsys, ["simulate", "--trace", str(MOONCAKE_TRACE)])
    assert "the synthetic workload is generated" in line


def test_a_rejection_from_the_installed_command_has_no_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tieredkv", "simulate", "--eviction", "foo"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "tieredkv simulate: error: --eviction: unknown eviction policy 'foo'; known: "
        "belady, bidaw, bidaw-paper, fifo, lfu, lru, queue-enhanced\n"
    )


def test_simulate_draws_a_progress_bar_and_no_progress_turns_it_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--minutes", "2", "--rate", "5", "--systems", "ideal,vllm"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    # not a terminal: a line at each 10% step, over both systems together
    assert err[0].startswith("tieredkv simulate [")
    assert err[-1].startswith("tieredkv simulate [" + "#" * 30 + "] 100%")
    assert main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_a_valid_trace_passes_the_checks(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["simulate", "--workload", "mooncake", "--trace", str(MOONCAKE_TRACE), "--rate", "20",
         "--systems", "ideal", "--no-progress"]
    )  # fmt: skip
    assert code == 0
    assert "mooncake workload, 20 users/min" in capsys.readouterr().out


def test_simulate_on_a_trace_picks_a_rate_the_ideal_keeps_up_with(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --rate, a trace runs at the highest of its native rate / 2, / 4, ... at
    which the ideal system meets the SLO (half the native rate saturated every system)."""
    argv = ["simulate", "--workload", "mooncake", "--trace", str(MOONCAKE_TRACE),
            "--systems", "bidaw,ideal", "--model", "llama-3-8b", "--gpu", "h200",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "at which the ideal system meets the SLO; --rate to choose)" in out
    ideal = next(line for line in out.splitlines() if line.startswith("ideal "))
    assert float(ideal.split()[1]) <= 40.0  # the SLO of 340-token answers: 5 * 343 / 44 s
    assert "saturated" not in out


def test_simulate_says_plainly_when_every_system_misses_the_slo(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trace = ["--workload", "mooncake", "--trace", str(MOONCAKE_TRACE), "--no-progress"]
    # at the trace's own rate one H200 cannot keep up: a queue, whatever the cache
    assert main(["simulate", *trace, "--systems", "bidaw,ideal", "--model", "llama-3-8b",
                 "--gpu", "h200", "--rate", "138"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "\nsaturated: even the ideal system (all KV in host memory) misses the 40 s " in out
    assert "at 17.25 users/min the ideal system meets the SLO (" in out  # 138 / 8
    assert out.rstrip().endswith("lower --rate.")
    # OPT-13B on an A800: the 8-12k-token prompts take longer than the SLO at any rate
    assert main(["simulate", *trace, "--systems", "ideal", "--json"]) == 0
    captured = capsys.readouterr()
    assert msgspec.json.decode(captured.out.splitlines()[-1])["system"] == "ideal"
    assert captured.err.startswith("tieredkv simulate: too slow for the SLO: even the ideal")
    assert "a lower rate will not help" in captured.err
    # a system that misses the SLO where the ideal meets it is a finding, not a saturation
    slow = ["simulate", "--minutes", "20", "--rate", "25", "--systems", "vllm", "--no-progress"]
    assert main(slow) == 0
    out = capsys.readouterr().out
    vllm = next(line for line in out.splitlines() if line.startswith("vllm "))
    assert float(vllm.split()[1]) > 5.0
    assert "ideal system" not in out


def test_demo_options_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag, words in [
        ("--conversations CONVERSATIONS", "conversations taking turns (default 5)"),
        ("--turns TURNS", "turns per conversation (default 4)"),
        ("--seed SEED", "seed of the KV and the turn lengths (default 0)"),
        ("--keep DIR", "keep the SSD tier's files in DIR"),
    ]:
        assert f"{flag} {words}" in text, flag


def test_demo_keep_leaves_a_directory_that_fsck_and_inspect_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    kept = tmp_path / "kept"
    assert main(["demo", "--keep", str(kept)]) == 0
    out = capsys.readouterr().out
    assert f"the SSD tier's files are kept in {kept}: closing the cache wrote the " in out
    assert "only host memory held down to the SSD tier (a crash instead of a close" in out
    assert f"tieredkv fsck {kept}" in out
    assert main(["fsck", str(kept)]) == 0  # clean
    assert capsys.readouterr().out.rstrip().endswith("clean")
    assert main(["inspect", str(kept)]) == 0
    sessions = [line for line in capsys.readouterr().out.splitlines() if "conversation-" in line]
    assert sessions  # the conversations demoted to SSD, with every turn
    # a second demo into the same folder would start afresh over the kept tier: refused
    line = _rejected(capsys, ["demo", "--keep", str(kept)])
    assert f"--keep {kept}: is not empty" in line
    (tmp_path / "file").write_text("keep me")
    assert "exists and is not a folder" in _rejected(
        capsys, ["demo", "--keep", str(tmp_path / "file")]
    )
    assert (tmp_path / "file").read_text() == "keep me"


def test_simulate_scheduler_replaces_every_systems_scheduler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--scheduler bidaw on CachedAttention (whose FCFS has a look-ahead window): the
    window goes with the scheduler it belongs to."""
    argv = ["simulate", "--minutes", "2", "--rate", "5", "--scheduler", "bidaw",
            "--systems", "cachedattention,flashgen", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\ncachedattention ") == 1
    assert out.count("\nflashgen ") == 1


def test_a_degenerate_run_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """0.01 minutes of arrivals is one user at any rate: every system serves it alike (every
    latency 0, every throughput the highest rate), and the run says the results mean
    nothing, on standard error first, and under the table and in the report."""
    note = (
        "degenerate run: 1 user at 25 users/min for 0.01 minutes, too few to load the GPU, "
        "host memory or SSD, so every system serves them alike and the latencies and "
        "throughputs say nothing about caching; give at least 10 users (--minutes 1 or more "
        "at this rate)"
    )
    argv = ["simulate", "--minutes", "0.01", "--systems", "vllm,ideal", "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == f"tieredkv simulate: {note}\n"
    assert captured.out.rstrip().endswith(f"\n\nD{note[1:]}.")
    out = tmp_path / "report"
    argv = ["reproduce", "--minutes", "0.01", "--rates", "5,25", "--systems", "vllm,bidaw",
            "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"tieredkv reproduce: {note}\n")
    assert f"\n{note}.\n" in captured.out
    assert f"**D{note[1:]}.**" in (out / "report.md").read_text()
    # 10 users is enough to say nothing
    assert main(["simulate", "--minutes", "0.4", "--systems", "ideal", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "degenerate" not in captured.out + captured.err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from tieredkv import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"tieredkv {__version__}\n"


def test_simulate_help_lists_the_presets_and_says_what_seed_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tieredkv.sim.costmodel import GPUS, MODELS
    from tieredkv.sim.systems import SYSTEMS

    for command in ("simulate", "reproduce"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        assert f"--model MODEL model preset: {', '.join(MODELS)} (default opt-13b)" in text
        assert f"--gpu GPU GPU preset: {', '.join(GPUS)} (default a800)" in text
        assert f"comma-separated system presets, of: {', '.join(SYSTEMS)} (default: all" in text
        assert "vllm recomputes each turn's whole history" in text
        assert "--seed SEED seed of the generated users" in text


def test_a_demo_of_many_conversations_keeps_its_rows_short_and_shows_the_time_left(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """25 conversations of 4 turns: a row names its own conversation's place (not 25
    cells), a count per tier ends the table, and the 100 turns draw a progress bar with
    the time left on standard error."""
    assert main(["demo", "--conversations", "25", "--turns", "4", "--host-mb", "2"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    start = lines.index("turn  conversation tokens  history from  where now") + 1
    rows = lines[start : start + 100]
    assert all(row.split()[-1] in ("host", "ssd") for row in rows), rows[:3]
    assert max(len(row) for row in rows) < 60
    summary = next(line for line in lines if line.startswith("where the 25 conversations"))
    counts = dict(part.rsplit(" ", 1) for part in summary.split(": ")[1].split(", "))
    assert sum(int(n) for n in counts.values()) == 25
    bar = captured.err.splitlines()
    assert bar[0].startswith("tieredkv demo [")
    assert any(line.endswith(" s left") for line in bar)
    assert bar[-1].startswith("tieredkv demo [" + "#" * 30 + "] 100%")
    # --no-progress, and a short demo, draw none
    assert main(["demo", "--conversations", "25", "--turns", "4", "--no-progress"]) == 0
    assert "tieredkv demo [" not in capsys.readouterr().err
    assert main(["demo"]) == 0
    assert "tieredkv demo [" not in capsys.readouterr().err
