"""Under pytest-xdist (the README's ``pytest -n 2``), each test file's tests run in one
worker, and files that share a session-scoped fixture's run in the same one
(``tests/conftest.py``'s scheduler): otherwise a second worker would run that fixture
again (the quick vLLM benchmark: every one of its engines started twice)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import _xdist_unit

ROOT = Path(__file__).resolve().parents[2]


def test_a_files_tests_are_one_unit_and_files_are_apart() -> None:
    a = "tests/integration/test_vllm_forks.py"
    assert _xdist_unit(f"{a}::test_forks_store_the_shared_prompt_once") == a
    assert _xdist_unit(f"{a}::test_shared_prompt_conversations_answer_like_recompute") == a
    assert _xdist_unit("tests/unit/test_codecs.py::test_kv_codec_round_trips_as_is") != a


def test_the_files_that_check_the_quick_vllm_run_are_one_unit() -> None:
    users = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if path != Path(__file__).resolve() and "(bench_vllm_quick: QuickRun)" in path.read_text()
    )
    assert users == [
        "tests/integration/test_bench_vllm.py",
        "tests/integration/test_bench_vllm_lmcache.py",
    ]
    assert len({_xdist_unit(f"{path}::test") for path in users}) == 1
