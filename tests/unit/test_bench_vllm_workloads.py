"""The vLLM benchmark's workloads have the shapes they are named for: the chat and
pressure conversations each start from a context of their own, the system-prompt ones all
from one prompt, the document ones from the documents in turn; and the options a user may
get wrong are refused with what to fix."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmark_scripts import benchmark_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with benchmark_script("bench_vllm", "bench_vllm_shapes") as module:
        yield module


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        users=5,
        turns=3,
        rate=1.0,
        context=100,
        system_prompt=300,
        documents=2,
        document=200,
        query=10,
        answer=4,
        vocab=500,
        seed=0,
    )


def test_chat_contexts_are_each_conversations_own(bench: ModuleType) -> None:
    wl = bench.Workload(_args(), shape="chat")
    heads = [tuple(f[:100]) for f in wl.firsts]
    assert len(heads) == 5
    assert len(set(heads)) == 5


def test_system_prompt_is_shared_by_every_conversation(bench: ModuleType) -> None:
    wl = bench.Workload(_args(), shape="system")
    prompt = wl.firsts[0][:300]
    assert all(f[:300] == prompt for f in wl.firsts)
    # what follows it is each user's own first query
    assert len({tuple(f[300:]) for f in wl.firsts}) == 5


def test_documents_are_reused_in_turn(bench: ModuleType) -> None:
    wl = bench.Workload(_args(), shape="documents")
    docs = [wl.firsts[0][:200], wl.firsts[1][:200]]
    assert docs[0] != docs[1]
    for c, first in enumerate(wl.firsts):
        assert first[:200] == docs[c % 2]


def test_an_unknown_shape_is_refused(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="unknown workload 'forum'"):
        bench.Workload(_args(), shape="forum")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workloads", "chat,forum"], "unknown workload 'forum'"),
        (["--skip", "lmcache gpu"], "unknown row 'lmcache gpu' in --skip"),
        (["--lmcache-chunk", "100"], "multiple of vLLM's block size 32"),
    ],
)
def test_bad_options_are_refused_with_what_to_fix(
    bench: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_lmcache_counters_are_read_from_its_prometheus_text() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peer_lmcache

    text = (
        "# HELP lmcache_mp_lookup_hit_tokens_total x\n"
        'lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="a"} 704.0\n'
        'lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="b"} 6.0\n'
        'lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="",model_name="a"} 512.0\n'
        'lmcache_mp_lookup_hit_l1_keys_total{cache_salt="",model_name="a"} 11.0\n'
        'lmcache_mp_l1_write_chunks_total{l1_tag="_default"} 7.0\n'
    )
    assert peer_lmcache.counter(text, "lookup_hit_tokens") == 710.0
    assert peer_lmcache.counter(text, "lookup_hit_l1_tokens") == 512.0
    assert peer_lmcache.counter(text, "l1_write_chunks") == 7.0
    assert peer_lmcache.counter(text, "lookup_requested_tokens") == 0.0


def test_a_row_that_did_not_start_gives_the_engines_own_error(bench: ModuleType) -> None:
    output = (
        "  File kv_cache_utils.py, line 1030, in _check_enough_kv_cache_memory\n"
        "    raise ValueError(\n"
        "ValueError: To serve at least one request with the model's max seq len (288)\n"
        "    raise RuntimeError(\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert bench.why_not(output) == (
        "ValueError: To serve at least one request with the model's max seq len (288)"
    )
    worker = "Worker failed with error 'CPU Offloading is only supported on GPUs'"
    assert bench.why_not(worker) == "CPU Offloading is only supported on GPUs"


def test_distinct_bytes_count_a_shared_context_once(bench: ModuleType) -> None:
    args = _args()
    args.layers, args.kv_heads, args.hidden, args.heads = 2, 2, 64, 4  # 2*2*2*16*4 = 512 B
    per_token = bench.kv_bytes_per_token(args)
    assert per_token == 512
    chat = bench.Workload(args, shape="chat")
    assert bench.unique_bytes(chat, args) == bench.histories_bytes(chat, args)
    system = bench.Workload(args, shape="system")  # 5 conversations, one 300-token prompt
    total = sum(bench._final_tokens(system))
    assert bench.unique_bytes(system, args) == (total - 4 * 300) * per_token
    documents = bench.Workload(args, shape="documents")  # 2 documents of 200, 5 users
    total = sum(bench._final_tokens(documents))
    assert bench.unique_bytes(documents, args) == (total - 3 * 200) * per_token


def test_forks_on_and_off_run_where_conversations_share_a_prefix(bench: ModuleType) -> None:
    plain = "tieredkv bidaw (no forks)"
    for shape in ("system", "documents"):
        rows = bench.rows_for(shape, set())
        assert rows[-2:] == ["tieredkv bidaw", plain]
        assert "tieredkv lru" not in rows
    exclusive = "tieredkv bidaw (exclusive)"
    for shape in ("chat", "pressure"):
        rows = bench.rows_for(shape, set())
        assert plain not in rows
        assert rows[rows.index("tieredkv lru") :][:2] == ["tieredkv lru", "tieredkv bidaw"]
    assert bench.rows_for("chat", set())[-1] == exclusive  # only where the chat is served
    assert all(exclusive not in bench.rows_for(s, set()) for s in bench.SHAPES if s != "chat")
    assert "vllm example" not in bench.rows_for("pressure", set())
    assert plain not in bench.rows_for("system", {plain})
    assert bench.TIEREDKV_ROWS[plain] == ("bidaw", False, "inclusive")
    assert bench.TIEREDKV_ROWS[exclusive] == ("bidaw", True, "exclusive")
