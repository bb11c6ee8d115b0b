"""The serving loop on a real (tiny, random-weight) model, real tiers and real policies.

Every configuration must produce the same answers, token for token, as recomputing every
conversation from scratch: scheduling and caching reorder and store, they never change
what the model says.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tieredkv import HostMemoryTier, SSDTier, Tier, TieredKVCache
from tieredkv.policies import FCFS, BidawScheduler
from tieredkv.policies.scheduling import Scheduler
from tieredkv.serve import ServedTurn, ServingEngine, TurnRequest, summarize
from tieredkv.serve.load import timed_requests
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.systems import LookAheadFCFS

transformers = pytest.importorskip("transformers")

VOCAB = 128


@pytest.fixture(scope="module")
def adapter_factory() -> object:
    from tieredkv.integrations.transformers import TransformersAdapter

    torch.manual_seed(0)
    config = transformers.OPTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        word_embed_proj_dim=64,
    )
    model = transformers.OPTForCausalLM(config).eval()
    return lambda codec, layerwise=False: TransformersAdapter(
        model, codec=codec, layerwise=layerwise
    )


def requests() -> list[tuple[float, TurnRequest]]:
    turns = SyntheticWorkload(users=6, arrival_rate=2.0, seed=3).generate()
    return timed_requests(
        turns, vocab_size=VOCAB, time_scale=0.002, max_context=400, max_turns=30, seed=1
    )


async def serve(
    adapter_factory: object,
    ssd_dir: Path,
    scheduler: Scheduler,
    *,
    eviction: str = "lru",
    codec: str = "kv",
    host: int = 160 << 10,
    recompute: bool = False,
    mode: str = "exclusive",
    layerwise: bool = False,
    predictive: bool = False,
) -> tuple[list[ServedTurn], TieredKVCache]:
    adapter = adapter_factory(codec, layerwise)  # type: ignore[operator]
    tiers: list[Tier] = [HostMemoryTier(host), SSDTier(ssd_dir, 64 << 20, fsync=False)]
    cache = TieredKVCache(
        tiers,
        eviction=eviction,
        token_dim=adapter.token_dim,
        mode=mode,  # type: ignore[arg-type]
    )
    async with cache:
        engine = ServingEngine(
            adapter,
            cache,
            scheduler,
            recompute=recompute,
            layerwise=layerwise,
            predictive=predictive,
        )
        results = await engine.run(requests())
        assert cache.sessions() == []  # every conversation ended and was dropped
        # only predictive prefetch brings sessions up unasked (this dense workload leaves
        # it few idle moments: tests/unit/test_predictive_prefetch.py measures what it adds)
        assert cache.stats().predicted == engine.predicted
        if not predictive:
            assert engine.predicted == 0
        # a layer-wise engine started some turns on a streamed history instead of idling
        assert (engine.streamed > 0) == layerwise
    return results, cache


def answers(results: list[ServedTurn]) -> list[tuple[str, float, tuple[int, ...]]]:
    by_session: dict[str, list[tuple[int, ...]]] = {}
    for r in sorted(results, key=lambda r: r.arrival):
        by_session.setdefault(r.session, []).append(r.answer)
    return sorted((s, float(i), a) for s, turns in by_session.items() for i, a in enumerate(turns))


@pytest.mark.slow  # every configuration of the benchmark: CI runs it
async def test_every_configuration_answers_exactly_like_recompute(
    adapter_factory: object, tmp_path: Path
) -> None:
    reference, _ = await serve(adapter_factory, tmp_path / "r", FCFS(), recompute=True)
    assert len(reference) == len(requests())
    configs = {
        "fcfs+lru": {"scheduler": FCFS()},
        "fcfs-on-demand": {"scheduler": FCFS(prefetch=False)},
        "fcfs+queue": {"scheduler": FCFS(), "eviction": "queue-enhanced"},
        "bidaw": {"scheduler": BidawScheduler(max_loads=2), "eviction": "bidaw"},
        "bidaw+act": {"scheduler": BidawScheduler(), "eviction": "bidaw", "codec": "act"},
        "inclusive": {"scheduler": BidawScheduler(), "mode": "inclusive"},
        "bidaw+layerwise": {"scheduler": BidawScheduler(), "eviction": "bidaw", "layerwise": True},
        "bidaw+act+layerwise": {
            "scheduler": BidawScheduler(),
            "codec": "act",
            "layerwise": True,
            "mode": "inclusive",
        },
        "bidaw+predictive": {
            "scheduler": BidawScheduler(),
            "eviction": "bidaw",
            "predictive": True,
        },
        "cachedattention": {
            "scheduler": LookAheadFCFS(window=4),
            "eviction": "queue-enhanced",
            "layerwise": True,
        },
    }
    for name, kwargs in configs.items():
        results, cache = await serve(adapter_factory, tmp_path / name, **kwargs)  # type: ignore[arg-type]
        assert answers(results) == answers(reference), name
        stats = cache.stats()
        assert stats.tiers[1].bytes_read > 0, name  # KV really came back from the SSD
        assert stats.promotions > 0, name


async def test_results_measure_queueing_and_hits(adapter_factory: object, tmp_path: Path) -> None:
    results, _ = await serve(adapter_factory, tmp_path, BidawScheduler())
    for r in results:
        assert r.arrival <= r.start <= r.end
        assert r.queueing == pytest.approx(r.start - r.arrival)
        # the turn's phases happen inside its service time (1 ms: two clocks' rounding)
        assert r.compute > 0
        assert r.store > 0
        assert r.restore >= 0
        assert r.service == pytest.approx(r.end - r.start)
        assert r.restore + r.compute + r.store <= r.service + 1e-3
        if r.restored_tokens:
            assert r.restore > 0
    first_turns = [r for r in results if r.host_hit is None]
    assert first_turns  # first turns have no history to hit or miss
    summary = summarize(results)
    assert summary["requests"] == len(results)
    assert 0.0 <= summary["host_hit_ratio"] <= 1.0
    assert summary["latency_p90"] >= summary["latency_p50"]
    # restored history + recomputed history never exceed what the conversation had
    assert all(r.restored_tokens >= 0 and r.recomputed_tokens >= 0 for r in results)
    assert sum(r.restored_tokens for r in results) > 0


def test_timed_requests_scales_samples_and_caps() -> None:
    turns = SyntheticWorkload(users=40, arrival_rate=1.0, seed=0).generate()
    full = timed_requests(turns, vocab_size=VOCAB, time_scale=1.0, seed=0)
    half = timed_requests(turns, vocab_size=VOCAB, time_scale=0.5, sample_users=0.5, seed=0)
    assert {r.session for _, r in half} < {r.session for _, r in full}
    assert full[-1][0] == pytest.approx(float(turns.time[-1] - turns.time[0]))
    capped = timed_requests(turns, vocab_size=VOCAB, max_context=300, seed=0)
    context: dict[str, int] = {}
    for _, r in capped:
        context[r.session] = context.get(r.session, 0) + len(r.query) + r.answer_tokens
        assert context[r.session] <= 300
        assert all(0 <= t < VOCAB for t in r.query)
    assert sum(r.last for _, r in capped) == len({r.session for _, r in capped})
    with pytest.raises(ValueError, match="time_scale"):
        timed_requests(turns, vocab_size=VOCAB, time_scale=0)
    with pytest.raises(ValueError, match="query_scale"):
        timed_requests(turns, vocab_size=VOCAB, query_scale=-1)


def test_timed_requests_moves_tokens_from_answers_to_queries() -> None:
    turns = SyntheticWorkload(users=10, arrival_rate=1.0, seed=0).generate()
    plain = timed_requests(turns, vocab_size=VOCAB, seed=0)
    moved = timed_requests(turns, vocab_size=VOCAB, answer_scale=0.125, query_scale=2.0, seed=0)
    assert len(plain) == len(moved)
    for (t1, a), (t2, b) in zip(plain, moved, strict=True):
        assert t1 == t2
        assert a.session == b.session
        assert len(b.query) == max(1, round(len(a.query) * 2.0))
        assert b.answer_tokens == max(1, round(a.answer_tokens * 0.125))


async def test_an_ended_conversation_is_dropped_after_its_last_turn(
    adapter_factory: object, tmp_path: Path
) -> None:
    """Dropping an ended conversation's KV (files deleted on the SSD tier, fsync'd) is not
    part of its last turn: each Dropped event comes at or after that turn's end."""
    from tieredkv.meta import Dropped, Event

    adapter = adapter_factory("kv")  # type: ignore[operator]
    tiers: list[Tier] = [HostMemoryTier(160 << 10), SSDTier(tmp_path / "ssd", 64 << 20)]
    dropped: dict[str, float] = {}

    def record(event: Event) -> None:
        if isinstance(event, Dropped):
            dropped[event.session] = event.time

    async with TieredKVCache(
        tiers, token_dim=adapter.token_dim, mode="inclusive", clock=time.monotonic
    ) as cache:
        cache.channel.subscribe(record)
        engine = ServingEngine(adapter, cache, BidawScheduler(), clock=time.monotonic)
        results = await engine.run(requests())
        assert cache.sessions() == []
    last = {r.session: r for r in sorted(results, key=lambda r: r.arrival)}
    assert set(dropped) == set(last)
    for session, r in last.items():
        assert dropped[session] >= r.end


async def test_a_name_reused_after_its_conversation_ended_starts_afresh(
    adapter_factory: object, tmp_path: Path
) -> None:
    """A new conversation under an ended one's name, submitted as the old one's KV is being
    dropped, is a first turn: nothing of the old history is restored, and it answers like
    a model that never saw the old conversation."""
    from tieredkv.serve import greedy_generate

    adapter = adapter_factory("kv")  # type: ignore[operator]
    first = TurnRequest(session="a", query=(5, 6, 7, 8), answer_tokens=3, last=True)
    again = TurnRequest(session="a", query=(9, 10, 11), answer_tokens=3, last=True)
    tiers: list[Tier] = [HostMemoryTier(160 << 10), SSDTier(tmp_path / "ssd", 64 << 20)]
    async with TieredKVCache(tiers, token_dim=adapter.token_dim, mode="inclusive") as cache:
        engine = ServingEngine(adapter, cache, BidawScheduler())
        results = await engine.run([(0.0, first), (0.0, again)])
        assert cache.sessions() == []
    one, two = sorted(results, key=lambda r: r.start)
    assert one.host_hit is None
    assert two.host_hit is None
    assert two.restored_tokens == 0
    assert two.recomputed_tokens == 0
    expected = greedy_generate(adapter.model, torch.tensor(again.query), 3)
    assert two.answer == expected


async def test_layerwise_needs_an_adapter_that_streams(
    adapter_factory: object, tmp_path: Path
) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20)]) as cache:
        with pytest.raises(TypeError, match="layerwise"):
            ServingEngine(adapter_factory("kv"), cache, FCFS(), layerwise=True)  # type: ignore[operator]
        streaming = adapter_factory("kv", True)  # type: ignore[operator]
        with pytest.raises(TypeError, match="layerwise"):
            ServingEngine(streaming, cache, FCFS(), layerwise=True, recompute=True)
        assert ServingEngine(streaming, cache, FCFS(), layerwise=True).layerwise


async def test_a_turns_retention_hint_reaches_its_conversation(
    adapter_factory: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A TurnRequest's hint goes through the adapter to the conversation stored with the
    turn: a pin, a priority and an expected next turn; a pin past the cache's bound is
    refused with a warning and the turn (and the rest of its hint) kept."""
    import logging
    import math

    from tieredkv.meta import RetentionHint

    adapter = adapter_factory("kv")  # type: ignore[operator]
    tiers: list[Tier] = [HostMemoryTier(160 << 10), SSDTier(tmp_path / "ssd", 64 << 20)]
    async with TieredKVCache(
        tiers, token_dim=adapter.token_dim, max_pinned_bytes=40 << 10, clock=time.monotonic
    ) as cache:
        engine = ServingEngine(adapter, cache, FCFS(), clock=time.monotonic)
        hint = RetentionHint(pin=True, ttl=600.0, priority=2, next_turn_in=30.0)
        q = tuple(range(3, 30))
        with caplog.at_level(logging.WARNING, logger="tieredkv.integrations.hints"):
            results = await engine.run(
                [
                    (0.0, TurnRequest(session="agent", query=q, answer_tokens=4, hint=hint)),
                    (0.0, TurnRequest(session="plain", query=q, answer_tokens=4)),
                    # pinned, it alone would pass the 40 KiB bound
                    (0.0, TurnRequest(session="big", query=q * 2, answer_tokens=4, hint=hint)),
                ]
            )
        assert len(results) == 3
        now = time.monotonic()
        agent, plain, big = (cache.channel[s] for s in ("agent", "plain", "big"))
        assert agent.pinned_until is not None
        assert now < agent.pinned_until <= now + 600
        assert agent.priority == 2
        assert agent.next_turn is not None
        assert (plain.pinned_until, plain.priority, plain.next_turn) == (None, 0, None)
        assert (big.pinned_until, big.priority) == (None, 2)  # pin refused, the rest kept
        assert big.tokens == len(q) * 2 + 4
        assert any("pin refused" in r.getMessage() for r in caplog.records)
        assert math.isfinite(agent.pinned_until)


async def test_a_hint_for_an_adapter_that_takes_none_is_a_clear_error(tmp_path: Path) -> None:
    """Hints need an adapter whose chat_turn takes ``hint=``: refused before anything runs,
    saying what to do."""
    from tieredkv.meta import RetentionHint

    class NoHints:
        async def chat_turn(
            self,
            cache: TieredKVCache,
            session: str,
            query: list[int],
            *,
            max_new_tokens: int,
            history: list[int],
        ) -> object:
            raise AssertionError("never run")

    async with TieredKVCache([HostMemoryTier(1 << 20)]) as cache:
        engine = ServingEngine(NoHints(), cache, FCFS())  # type: ignore[arg-type]
        turn = TurnRequest(session="s", query=(1, 2), answer_tokens=1, hint=RetentionHint(pin=True))
        with pytest.raises(TypeError, match=r"NoHints\.chat_turn takes no hint= argument"):
            await engine.run([(0.0, turn)])
        assert cache.sessions() == []
