"""The transformers adapter on tiny random-weight models, through real tiers (host + SSD).

Lossless means: a multi-turn greedy chat whose history is restored from tieredkv answers
token for token what a model recomputing the whole conversation from its tokens answers.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.invariants import problems
from tests.packed_codec import PackedKV
from tests.redis_server import RedisServer, new_prefix, own_redis_server, redis_server
from tieredkv import HostMemoryTier, SessionNotFoundError, SSDTier, TieredKVCache
from tieredkv.backends.redis import RedisTier
from tieredkv.backends.ssd import segment_file_name
from tieredkv.integrations import architectures
from tieredkv.integrations.architectures import (
    _ARCHITECTURES,
    Architecture,
    UnknownArchitectureError,
    architecture_names,
    get_architecture,
    register_architecture,
)
from tieredkv.integrations.transformers import (
    ArchitectureMismatchError,
    ChatTurn,
    HistoryMismatchError,
    TransformersAdapter,
    TransformersMissingError,
    UnsupportedModelError,
    cache_argument,
)
from tieredkv.payload import plan_segment
from tieredkv.policies import FCFS
from tieredkv.serve import ServingEngine
from tieredkv.serve.adapter import ChatAdapter, RecomputingAdapter

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

__all__ = ["own_redis_server", "redis_server"]  # fixtures used below


def tiny(config: Any, **kw: Any) -> Any:
    """A config of ``config``'s class for a 2-layer model of width 64 (4 heads)."""
    return config(
        hidden_size=64,
        num_hidden_layers=kw.pop("num_hidden_layers", 2),
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=256,
        **kw,
    )


def _randomize_biases(model: Any) -> Any:
    # random init leaves biases at zero: make them count, so a re-projection that forgot
    # them would be caught
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("k_proj.bias", "v_proj.bias", "q_proj.bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def opt(layers: int = 2, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    cfg = tiny(OPTConfig, num_hidden_layers=layers, ffn_dim=128)
    return _randomize_biases(OPTForCausalLM(cfg)).to(dtype)


def llama(kv_heads: int = 4, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    cfg = tiny(LlamaConfig, num_key_value_heads=kv_heads, intermediate_size=128)
    model: Any = LlamaForCausalLM(cfg)
    return model.eval().to(dtype)


def qwen2(dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    cfg = tiny(Qwen2Config, num_key_value_heads=4, intermediate_size=128)
    return _randomize_biases(Qwen2ForCausalLM(cfg)).to(dtype)


CODECS: dict[str, Any] = {"kv": "kv", "act": "act", "packed": PackedKV()}
"""The codec argument of each test id: the two shipped codecs by name, and a codec object
the adapter knows nothing of (:class:`tests.packed_codec.PackedKV`)."""

MODELS: dict[str, Callable[[], Any]] = {
    "opt": opt,
    "llama-mha": llama,
    "llama-gqa": lambda: llama(kv_heads=1),
    "qwen2": qwen2,
}


@pytest.fixture
async def cache(ssd_dir: Path) -> AsyncIterator[TieredKVCache]:
    """A host tier that holds about one small conversation, over an SSD tier."""
    async with TieredKVCache([HostMemoryTier(48 << 10), SSDTier(ssd_dir, 16 << 20)]) as c:
        yield c


def recompute_greedy(model: Any, tokens: list[int], n: int) -> list[int]:
    """Greedy answer computed from the tokens alone, with no cache at all."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.tensor([tokens + out], device=model.device)
            out.append(int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax()))
    return out


def full_cache(model: Any, tokens: list[int]) -> DynamicCache:
    """The model's cache after prefilling ``tokens`` in one pass."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        ids = torch.tensor([tokens], device=model.device)
        model(input_ids=ids, use_cache=True, **{cache_argument(model): cache})
    return cache


def layer_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers: list[Any] = list(cache.layers)
    return [(layer.keys, layer.values) for layer in layers]


def assert_same_kv(a: DynamicCache, b: DynamicCache, *, atol: float, rtol: float) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    ka, kb = layer_kv(a), layer_kv(b)
    assert len(ka) == len(kb)
    for (k1, v1), (k2, v2) in zip(ka, kb, strict=True):
        torch.testing.assert_close(k1, k2, atol=atol, rtol=rtol)
        torch.testing.assert_close(v1, v2, atol=atol, rtol=rtol)


def queries(n: int, length: int = 5, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("codec", ["kv", "act", "packed"])
@pytest.mark.parametrize("arch", sorted(MODELS))
async def test_multi_turn_greedy_chat_is_lossless(arch: str, codec: str, ssd_dir: Path) -> None:
    model = MODELS[arch]()
    adapter = TransformersAdapter(model, codec=CODECS[codec])
    # a turn stores 5 + 4 tokens; the host tier holds two and a half such segments, so the
    # two conversations take turns there, and from the third turn on are served from the SSD
    segment = plan_segment("x", 0, adapter_layout(adapter, 9), token_dim=0, answer_tokens=4)
    host = HostMemoryTier(segment.length * 5 // 2 // 4096 * 4096)
    histories: dict[str, list[int]] = {"alice": [], "bob": []}
    async with TieredKVCache([host, SSDTier(ssd_dir, 16 << 20)]) as cache:
        for turn, qs in enumerate(zip(*(queries(3, seed=s) for s in (1, 2)), strict=True)):
            for (user, history), query in zip(histories.items(), qs, strict=True):
                result = await adapter.chat_turn(
                    cache, user, query, max_new_tokens=4, history=history
                )
                assert list(result.answer) == recompute_greedy(model, history + query, 4)
                assert result.restored_tokens == len(history)
                assert result.recomputed_tokens == 0
                assert result.stored_tokens == len(query) + 4
                history += query + list(result.answer)
                assert result.history_tokens == len(history) == cache.channel[user].tokens
                assert cache.channel[user].prev_answer_tokens == 4
                assert cache.channel[user].turns == turn + 1
        stats = cache.stats()
        assert stats.demotions > 0
        assert stats.promotions > 0
        assert stats.misses > 0
        assert stats.tiers[1].bytes_read > 0
        for user, history in histories.items():
            restored = await adapter.restore(cache, user, expected_tokens=len(history))
            assert_same_kv(restored, full_cache(model, history), atol=1e-5, rtol=1e-4)


def adapter_layout(adapter: TransformersAdapter, tokens: int) -> dict[str, torch.Tensor]:
    """Zero tensors shaped like one segment of ``tokens`` tokens of ``adapter``'s codec."""
    dtype = getattr(torch, adapter.spec.dtype)
    return {
        name: torch.zeros(tuple(tokens if d == -1 else d for d in shape), dtype=dtype)
        for name, shape in adapter.codec.layout(adapter.spec).items()
    }


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
async def test_activation_codec_rebuilds_the_models_kv(
    arch: str, dtype: torch.dtype, tol: float, cache: TieredKVCache
) -> None:
    model = MODELS[arch]().to(dtype)
    adapter = TransformersAdapter(model, codec="act")
    ids = torch.tensor([queries(1, length=24)[0]])
    model_cache = DynamicCache(config=model.config)
    with torch.no_grad(), adapter.capture() as capture:
        model(input_ids=ids, use_cache=True, **{cache_argument(model): model_cache})
    await adapter.store(cache, "s", model_cache, start=0, answer_tokens=0, capture=capture)
    assert cache.channel["s"].nbytes >= adapter.bytes_per_token * 24
    restored = await adapter.restore(cache, "s", expected_tokens=24)
    # one matrix multiplication's rounding, at the model's precision
    assert_same_kv(restored, model_cache, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("arch", "chosen", "kv_bytes", "act_bytes"),
    [
        ("opt", "act", 2 * 2 * 64 * 4, 2 * 64 * 4),
        ("llama-mha", "act", 2 * 2 * 64 * 4, 2 * 64 * 4),
        ("qwen2", "act", 2 * 2 * 64 * 4, 2 * 64 * 4),
        ("llama-gqa", "kv", 2 * 2 * 16 * 4, 2 * 64 * 4),
    ],
)
def test_auto_chooses_activation_for_mha_and_kv_for_gqa(
    arch: str, chosen: str, kv_bytes: int, act_bytes: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tieredkv.integrations.transformers"):
        adapter = TransformersAdapter(MODELS[arch]())
    assert adapter.codec.name == chosen
    assert adapter.bytes_per_token == min(kv_bytes, act_bytes)
    assert adapter.token_dim == (0 if chosen == "act" else 1)
    assert f"storing codec {chosen!r}" in caplog.text
    assert f"K/V {kv_bytes}, activation {act_bytes}" in caplog.text


def test_codec_string_carries_the_model_fingerprint() -> None:
    assert TransformersAdapter(opt()).codec_id == "act/opt-L2-d64-h4-kv4-hd16-float32"
    assert TransformersAdapter(llama(kv_heads=1)).codec_id == "kv/llama-L2-d64-h4-kv1-hd16-float32"
    tagged = TransformersAdapter(opt(), codec="kv", tag="facebook/opt-125m@main")
    assert tagged.codec_id == "kv/opt-L2-d64-h4-kv4-hd16-float32@facebook/opt-125m@main"


def test_a_state_space_model_is_refused_naming_its_type_and_why() -> None:
    mamba = MambaForCausalLM(
        MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=128, state_size=4)
    )
    with pytest.raises(UnsupportedModelError, match=r"'mamba'.*LinearAttentionLayer.*recurrent"):
        TransformersAdapter(mamba)


def test_an_unregistered_family_gets_kv_and_refuses_the_activation_codec() -> None:
    gpt2: Any = GPT2LMHeadModel(
        GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, bos_token_id=1, eos_token_id=2)
    )
    gpt2.eval()
    adapter = TransformersAdapter(gpt2)
    assert adapter.codec.name == "kv"
    assert "no architecture registered for 'gpt2'" in adapter.codec_reason
    with pytest.raises(UnsupportedModelError, match=r"not exact for this 'gpt2'.*codec='kv'"):
        TransformersAdapter(gpt2, codec="act")
    with adapter.capture() as capture:  # K/V: records nothing, so one manual path fits both
        full_cache(gpt2, [5, 6, 7])
    assert capture.tokens == 0


def test_a_registry_entry_that_does_not_match_the_model_is_refused_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Qwen2 has biases and no K norm: an entry claiming a per-head K norm is caught by
    # the module check
    monkeypatch.setitem(_ARCHITECTURES, "qwen2", Architecture(model_type="qwen2", k_norm="head"))
    with pytest.raises(ArchitectureMismatchError, match=r"'qwen2'.*no k_norm over 16"):
        TransformersAdapter(qwen2())
    TransformersAdapter(qwen2(), codec="kv")  # K/V needs no architecture
    # shapes that fit but the wrong projection: caught by re-projecting the probe
    monkeypatch.setitem(_ARCHITECTURES, "llama", Architecture(model_type="llama", k_proj="q_proj"))
    with pytest.raises(ArchitectureMismatchError, match="does not give the K the model cached"):
        TransformersAdapter(llama(), codec="act")
    # a rotary model described without rotary
    monkeypatch.setitem(_ARCHITECTURES, "llama", Architecture(model_type="llama", rotary="none"))
    with pytest.raises(ArchitectureMismatchError, match="rotary_emb"):
        TransformersAdapter(llama())


def test_register_architecture_adds_a_family(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(architectures, "_ARCHITECTURES", dict(architectures._ARCHITECTURES))
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, bos_token_id=1, eos_token_id=2)
    )
    register_architecture(
        Architecture(model_type="gpt2", layers="h", attention="attn", k_proj="c_attn")
    )
    assert "gpt2" in architecture_names()
    with pytest.raises(ArchitectureMismatchError, match=r"no nn\.Linear attn\.c_attn"):
        TransformersAdapter(gpt2)
    with pytest.raises(TypeError, match="register an Architecture"):
        register_architecture("gpt2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"invalid Architecture for 'gpt2'.*k_norm"):
        register_architecture(Architecture(model_type="gpt2", k_norm="qk"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty model_type"):
        register_architecture(Architecture(model_type=""))
    assert get_architecture("gpt2").k_proj == "c_attn"  # the refused ones changed nothing
    with pytest.raises(UnknownArchitectureError, match=r"'mamba'.*register_architecture"):
        get_architecture("mamba")


def test_extract_refuses_tokens_that_left_a_transformers_sliding_window() -> None:
    torch.manual_seed(0)
    cfg = tiny(MistralConfig, num_key_value_heads=2, intermediate_size=128, sliding_window=4)
    model: Any = MistralForCausalLM(cfg)
    model.eval()
    adapter = TransformersAdapter(model)
    assert adapter.sliding_windows == [4, 4]
    plain = full_cache(model, [5, 6, 7, 8, 9, 10])  # a DynamicCache keeps the last 3
    with pytest.raises(ValueError, match=r"no longer holds positions 0 \.\. 2"):
        adapter.extract(plain, start=0)
    assert adapter.extract(plain, start=3)["layers.1.k"].shape == (2, 3, 16)


async def test_sampling_is_seeded_and_stays_lossless(cache: TieredKVCache) -> None:
    model = qwen2()
    adapter = TransformersAdapter(model)
    sample = {"temperature": 0.9, "top_k": 40, "top_p": 0.95}
    answers = []
    for session in ("a", "b"):
        history: list[int] = []
        for query in queries(2):
            turn = await adapter.chat_turn(
                cache,
                session,
                query,
                max_new_tokens=8,
                history=history,
                generator=torch.Generator().manual_seed(3),
                **sample,  # type: ignore[arg-type]
            )
            history += query + list(turn.answer)
        answers.append(history)
        restored = await adapter.restore(cache, session, expected_tokens=len(history))
        assert_same_kv(restored, full_cache(model, history), atol=1e-5, rtol=1e-4)
    assert answers[0] == answers[1]  # the same seed, the same conversation
    greedy = await adapter.chat_turn(cache, "g", queries(1)[0], max_new_tokens=8)
    assert answers[0][5:13] != list(greedy.answer)  # it did sample


class ChatOnly:
    """An adapter that can chat but gives the engine no model to recompute with."""

    async def chat_turn(
        self,
        cache: TieredKVCache,
        session: str,
        query: list[int],
        *,
        max_new_tokens: int,
        history: list[int],
    ) -> ChatTurn:
        raise NotImplementedError


async def test_the_adapter_is_what_the_serving_engine_needs(cache: TieredKVCache) -> None:
    adapter = TransformersAdapter(opt())
    assert isinstance(adapter, ChatAdapter)
    assert isinstance(adapter, RecomputingAdapter)
    ServingEngine(adapter, cache, FCFS(), recompute=True)
    assert isinstance(ChatOnly(), ChatAdapter)
    assert not isinstance(ChatOnly(), RecomputingAdapter)
    ServingEngine(ChatOnly(), cache, FCFS())
    with pytest.raises(TypeError, match=r"ChatOnly needs an async recompute\(tokens"):
        ServingEngine(ChatOnly(), cache, FCFS(), recompute=True)


async def test_recompute_answers_from_the_tokens_alone_and_touches_no_cache(
    cache: TieredKVCache,
) -> None:
    model = llama()
    adapter = TransformersAdapter(model, codec="kv")
    history: list[int] = []
    for query in queries(2):
        turn = await adapter.chat_turn(cache, "s", query, max_new_tokens=4, history=history)
        history += query + list(turn.answer)
    before = cache.stats()
    query = queries(3)[2]
    answer = await adapter.recompute(history + query, max_new_tokens=4)
    assert list(answer) == recompute_greedy(model, history + query, 4)
    # the cached turn gives the same answer: the baseline differs only in what it prefills
    turn = await adapter.chat_turn(cache, "s", query, max_new_tokens=4, history=history)
    assert turn.answer == answer
    assert turn.restored_tokens == len(history)
    assert before.appends + 1 == cache.stats().appends
    assert before.loads + 1 == cache.stats().loads
    with pytest.raises(ValueError, match="at least 1"):
        await adapter.recompute(query, max_new_tokens=0)
    with pytest.raises(ValueError, match="no tokens to prefill"):
        await adapter.recompute([], max_new_tokens=2)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": 1.0, "top_k": 0}, "top_k must be at least 1"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 5}, "give a temperature > 0"),
    ],
)
async def test_bad_sampling_parameters_are_clear_errors(
    kw: dict[str, Any], why: str, cache: TieredKVCache
) -> None:
    adapter = TransformersAdapter(opt())
    with pytest.raises(ValueError, match=why):
        await adapter.chat_turn(cache, "s", [5, 6], max_new_tokens=2, **kw)
    assert "s" not in cache


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (lambda: opt(layers=3), "opt-L3-"),
        (lambda: opt(dtype=torch.bfloat16), "bfloat16"),
        (lambda: llama(), "llama-L2-"),
    ],
    ids=["layers", "dtype", "architecture"],
)
async def test_a_history_from_another_model_is_refused_and_nothing_is_used(
    other: Callable[[], Any], why: str, cache: TieredKVCache
) -> None:
    first = TransformersAdapter(opt())
    query = queries(1)[0]
    result = await first.chat_turn(cache, "s", query, max_new_tokens=3)
    history = query + list(result.answer)
    before = cache.channel["s"]
    adapter = TransformersAdapter(other())
    with pytest.raises(HistoryMismatchError, match=why) as info:
        await adapter.restore(cache, "s")
    assert "act/opt-L2-d64-h4-kv4-hd16-float32" in str(info.value)
    with pytest.raises(HistoryMismatchError):
        await adapter.chat_turn(cache, "s", query, max_new_tokens=3, history=history)
    after = cache.channel["s"]
    assert (after.tokens, after.turns, after.accesses) == (
        before.tokens,
        before.turns,
        before.accesses,
    )


async def test_the_same_shape_with_another_codec_is_refused(cache: TieredKVCache) -> None:
    await TransformersAdapter(opt(), codec="kv").chat_turn(cache, "s", [5, 6], max_new_tokens=2)
    with pytest.raises(HistoryMismatchError, match="stored as 'kv/opt"):
        await TransformersAdapter(opt(), codec="act").restore(cache, "s")


async def test_a_token_count_that_disagrees_is_refused(cache: TieredKVCache) -> None:
    adapter = TransformersAdapter(qwen2())
    query = queries(1)[0]
    result = await adapter.chat_turn(cache, "s", query, max_new_tokens=3)
    history = query + list(result.answer)
    with pytest.raises(HistoryMismatchError, match="holds 8 tokens, the conversation has 7"):
        await adapter.chat_turn(cache, "s", [9], max_new_tokens=2, history=history[:-1])
    with pytest.raises(HistoryMismatchError, match="holds 8 tokens, the conversation has 9"):
        await adapter.restore(cache, "s", expected_tokens=9)
    assert cache.channel["s"].tokens == 8
    assert cache.channel["s"].turns == 1


async def test_a_lost_history_is_recomputed_from_its_tokens(cache: TieredKVCache) -> None:
    model = llama()
    adapter = TransformersAdapter(model)
    q1, q2 = queries(2)
    first = await adapter.chat_turn(cache, "s", q1, max_new_tokens=4)
    history = q1 + list(first.answer)
    await cache.drop("s")  # as if evicted from the last tier
    with pytest.raises(SessionNotFoundError):
        await adapter.restore(cache, "s")
    second = await adapter.chat_turn(cache, "s", q2, max_new_tokens=4, history=history)
    assert second.restored_tokens == 0
    assert second.recomputed_tokens == len(history)
    assert list(second.answer) == recompute_greedy(model, history + q2, 4)
    assert cache.channel["s"].tokens == len(history) + len(q2) + 4


async def test_a_history_lost_to_eviction_is_never_silently_restarted() -> None:
    model = opt()
    adapter = TransformersAdapter(model)
    # one tier, room for the recomputed turn (9 + 5 + 4 tokens) but not for two 9-token turns
    segment = plan_segment("x", 0, adapter_layout(adapter, 18), token_dim=0, answer_tokens=4)
    q1, q2, q3 = queries(3)
    async with TieredKVCache([HostMemoryTier(segment.length)]) as cache:
        first = await adapter.chat_turn(cache, "alice", q1, max_new_tokens=4)
        await adapter.chat_turn(cache, "bob", q2, max_new_tokens=4)  # alice is evicted: lost
        assert "alice" not in cache
        assert cache.channel["alice"].tier is None
        with pytest.raises(SessionNotFoundError):
            await adapter.chat_turn(cache, "alice", q3, max_new_tokens=4)
        history = q1 + list(first.answer)
        again = await adapter.chat_turn(cache, "alice", q3, max_new_tokens=4, history=history)
    assert again.recomputed_tokens == len(history)
    assert list(again.answer) == recompute_greedy(model, history + q3, 4)


async def test_eos_ends_the_answer_and_is_stored(cache: TieredKVCache) -> None:
    model = opt()
    query = queries(1)[0]
    expected = recompute_greedy(model, query, 6)
    adapter = TransformersAdapter(model)
    result = await adapter.chat_turn(cache, "s", query, max_new_tokens=6, eos_token_id=expected[2])
    stop = expected.index(expected[2]) + 1
    assert list(result.answer) == expected[:stop]
    assert cache.channel["s"].tokens == len(query) + stop
    assert cache.channel["s"].prev_answer_tokens == stop


async def test_generate_then_store_and_restore(cache: TieredKVCache) -> None:
    """The manual path with ``model.generate``: feed the last token, store, restore."""
    model = qwen2()
    adapter = TransformersAdapter(model)
    history: list[int] = []
    for query in queries(2):
        prompt = torch.tensor([history + query])
        past = (
            await adapter.restore(cache, "s", expected_tokens=len(history))
            if history
            else DynamicCache(config=model.config)
        )
        kw = cache_argument(model)
        with torch.no_grad(), adapter.capture() as capture:
            out = model.generate(
                prompt,
                max_new_tokens=3,
                min_new_tokens=3,
                do_sample=False,
                return_dict_in_generate=True,
                **{kw: past},
            )
            answer = out.sequences[0, prompt.shape[1] :].tolist()
            # generate() filled ``past`` in place; it sampled the last token but never fed
            # it: feed it
            model(input_ids=out.sequences[:, -1:], use_cache=True, **{kw: past})
        await adapter.store(cache, "s", past, start=len(history), answer_tokens=3, capture=capture)
        history += query + answer
        assert cache.channel["s"].tokens == len(history)
    restored = await adapter.restore(cache, "s", expected_tokens=len(history))
    assert_same_kv(restored, full_cache(model, history), atol=1e-5, rtol=1e-4)


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(TransformersMissingError, match=r"pip install -e '\.\[transformers\]'"):
        TransformersAdapter(object())
    assert issubclass(TransformersMissingError, ImportError)


async def test_bad_arguments_are_clear_errors(cache: TieredKVCache) -> None:
    with pytest.raises(ValueError, match="codec must be"):
        TransformersAdapter(opt(), codec="zip")  # type: ignore[arg-type]
    model = opt()
    adapter = TransformersAdapter(model)
    model.train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        await adapter.chat_turn(cache, "s", [5, 6], max_new_tokens=2)
    model.eval()
    with pytest.raises(ValueError, match="at least 1"):
        await adapter.chat_turn(cache, "s", [5, 6], max_new_tokens=0)
    with pytest.raises(ValueError, match="query is empty"):
        await adapter.chat_turn(cache, "s", [], max_new_tokens=2)
    assert "s" not in cache
    model_cache = full_cache(model, [5, 6, 7])
    with pytest.raises(ValueError, match="needs the turn's activations"):
        adapter.extract(model_cache, start=0)
    with pytest.raises(ValueError, match="none after 3"):
        adapter.extract(model_cache, start=3)


@pytest.mark.cuda
@requires_cuda
async def test_chat_on_cuda_restores_through_device_tensors(cache: TieredKVCache) -> None:
    model = opt().cuda()
    adapter = TransformersAdapter(model)
    assert adapter.codec.name == "act"
    history: list[int] = []
    for query in queries(3):
        result = await adapter.chat_turn(cache, "s", query, max_new_tokens=4, history=history)
        assert list(result.answer) == recompute_greedy(model, history + query, 4)
        history += query + list(result.answer)
    restored = await adapter.restore(cache, "s", expected_tokens=len(history))
    assert layer_kv(restored)[0][0].device.type == "cuda"
    assert_same_kv(restored, full_cache(model, history), atol=1e-4, rtol=1e-3)


def mistral_sliding() -> Any:
    torch.manual_seed(0)
    cfg = tiny(MistralConfig, num_key_value_heads=2, intermediate_size=128, sliding_window=4)
    model: Any = MistralForCausalLM(cfg)
    return model.eval()


def count_streams(cache: TieredKVCache) -> list[str]:
    """Record the sessions ``cache.load_layerwise`` is called for (it still runs)."""
    calls: list[str] = []
    real = cache.load_layerwise

    def spy(session: str, *args: Any) -> Any:
        calls.append(session)
        return real(session, *args)

    cache.load_layerwise = spy  # type: ignore[method-assign,assignment]
    return calls


@pytest.mark.parametrize(
    ("arch", "codec"),
    [
        ("llama-mha", "kv"),
        ("llama-gqa", "kv"),
        ("qwen2", "act"),
        ("opt", "act"),
        ("mistral", "kv"),
        ("llama-gqa", "packed"),
        ("mistral", "packed"),
    ],
)
async def test_layerwise_restore_answers_like_recompute(
    arch: str, codec: str, ssd_dir: Path
) -> None:
    model = mistral_sliding() if arch == "mistral" else MODELS[arch]()
    adapter = TransformersAdapter(model, codec=CODECS[codec], layerwise=True)
    segment = plan_segment("x", 0, adapter_layout(adapter, 9), token_dim=0, answer_tokens=4)
    host = HostMemoryTier(segment.length * 5 // 2 // 4096 * 4096)
    histories: dict[str, list[int]] = {"alice": [], "bob": []}
    async with TieredKVCache([host, SSDTier(ssd_dir, 16 << 20)]) as cache:
        streamed = count_streams(cache)
        for qs in zip(*(queries(4, seed=s) for s in (1, 2)), strict=True):
            for (user, history), query in zip(histories.items(), qs, strict=True):
                from_ssd = cache.where(user) == "ssd"
                result = await adapter.chat_turn(
                    cache, user, query, max_new_tokens=4, history=history
                )
                assert list(result.answer) == recompute_greedy(model, history + query, 4)
                assert result.restored_tokens == len(history)
                assert result.recomputed_tokens == 0
                if from_ssd:
                    assert streamed[-1] == user
                history += query + list(result.answer)
                assert cache.channel[user].tokens == len(history)
        assert len(streamed) >= 3
        assert cache.stats().promotions > 0  # streamed into host memory on the way
        assert problems(cache) == []


async def test_a_damaged_streamed_history_is_recomputed_never_used(ssd_dir: Path) -> None:
    model = llama()
    adapter = TransformersAdapter(model, codec="kv", layerwise=True)
    q1, q2, q3 = queries(3)
    async with TieredKVCache([SSDTier(ssd_dir, 16 << 20)]) as cache:
        first = await adapter.chat_turn(cache, "s", q1, max_new_tokens=4)
        history = q1 + list(first.answer)
        path = ssd_dir / "segments" / segment_file_name(("s", 0))
        data = bytearray(path.read_bytes())
        data[-5000] ^= 0x10  # the last layer's bytes: found only when all has landed
        path.write_bytes(bytes(data))
        streamed = count_streams(cache)
        second = await adapter.chat_turn(cache, "s", q2, max_new_tokens=4, history=history)
        assert streamed == ["s"]
        assert second.restored_tokens == 0
        assert second.recomputed_tokens == len(history)
        assert list(second.answer) == recompute_greedy(model, history + q2, 4)
        assert cache.stats().corrupt == 1
        history += q2 + list(second.answer)
        path = ssd_dir / "segments" / segment_file_name(("s", 0))
        data = bytearray(path.read_bytes())
        data[100] ^= 0x10
        path.write_bytes(bytes(data))
        with pytest.raises(SessionNotFoundError):  # no history to recompute from
            await adapter.chat_turn(cache, "s", q3, max_new_tokens=4)
        assert problems(cache) == []


@pytest.mark.parametrize("go_first", [True, False], ids=["go-then-read", "read-then-go"])
async def test_serving_hooks_restore_before_the_go_ahead(ssd_dir: Path, go_first: bool) -> None:
    model = llama()
    adapter = TransformersAdapter(model, codec="kv", layerwise=True)
    q1, q2 = queries(2)
    async with TieredKVCache([SSDTier(ssd_dir, 16 << 20)]) as cache:
        first = await adapter.chat_turn(cache, "s", q1, max_new_tokens=4)
        history = q1 + list(first.answer)
        go = anyio.Event()
        seen: list[str] = []

        async def before_compute() -> None:
            seen.append("waiting")
            await go.wait()
            seen.append("go")

        def on_loaded() -> None:
            seen.append("loaded")
            go.set()  # read-then-go: the model is handed over only once all is in

        if go_first:
            go.set()
        turn = await adapter.chat_turn(
            cache,
            "s",
            q2,
            max_new_tokens=4,
            history=history,
            before_compute=before_compute,
            on_loaded=on_loaded,
        )
        assert list(turn.answer) == recompute_greedy(model, history + q2, 4)
        assert turn.restored_tokens == len(history)
        assert seen.count("loaded") == 1
        if not go_first:
            assert seen == ["waiting", "loaded", "go"]
        assert problems(cache) == []


async def test_a_turns_retention_hint_is_applied_once_it_is_stored(cache: TieredKVCache) -> None:
    """``chat_turn(..., hint=)``: the turn is stored, then the hint applied; the returned
    meta carries it. A pin past the cache's bound is refused, the turn and the rest kept."""
    import math

    from tieredkv import RetentionHint

    adapter = TransformersAdapter(opt())
    hint = RetentionHint(pin=True, priority=1, next_turn_in=5.0)
    turn = await adapter.chat_turn(cache, "s", [5, 6, 7], max_new_tokens=3, hint=hint)
    assert (turn.meta.pinned_until, turn.meta.priority) == (math.inf, 1)
    assert turn.meta.next_turn is not None
    assert cache.channel["s"] == turn.meta
    assert turn.history_tokens == 6
    cache.max_pinned_bytes = turn.meta.nbytes  # room for "s" alone
    other = await adapter.chat_turn(cache, "t", [8, 9], max_new_tokens=2, hint=hint)
    assert (other.meta.pinned_until, other.meta.priority, other.history_tokens) == (None, 1, 4)
    assert len(other.answer) == 2  # the turn was served and stored all the same


@pytest.mark.parametrize("codec", ["kv", "act"])
async def test_forks_regenerate_and_edit_answer_like_recompute_and_store_only_their_turn(
    codec: str, ssd_dir: Path
) -> None:
    model = opt()
    adapter = TransformersAdapter(model, codec=CODECS[codec])
    per_token = adapter.bytes_per_token
    system, q1, q2, edited, q3 = queries(5, length=6, seed=11)
    async with TieredKVCache([HostMemoryTier(1 << 20), SSDTier(ssd_dir, 16 << 20)]) as cache:
        # a system prompt every chat starts from, stored once under a key of its own
        await adapter.chat_turn(cache, "system", system, max_new_tokens=2)
        prompt = system + list(await adapter.recompute(system, max_new_tokens=2))
        chats: dict[str, list[int]] = {}
        for user, q in (("alice", q1), ("bob", q2)):
            turn = await adapter.chat_turn(
                cache, user, q, max_new_tokens=4, parent="system", history=prompt
            )
            assert list(turn.answer) == recompute_greedy(model, prompt + q, 4)
            assert turn.restored_tokens == len(prompt)
            assert turn.recomputed_tokens == 0
            meta = cache.channel[user]
            assert (meta.parent, meta.parent_tokens, meta.tokens) == (
                "system",
                len(prompt),
                len(prompt) + len(q) + 4,
            )
            # the fork owns its turn only; the prompt is listed, not copied
            assert meta.shared_bytes == cache.channel["system"].nbytes
            assert meta.owned_bytes == meta.nbytes - meta.shared_bytes
            assert (len(q) + 4) * per_token <= meta.owned_bytes < (len(q) + 4) * per_token + 8192
            chats[user] = prompt + q + list(turn.answer)
        # alice's second turn, then: regenerate it (fork at the end of the question) ...
        second = await adapter.chat_turn(
            cache, "alice", q3, max_new_tokens=4, history=chats["alice"]
        )
        question = len(chats["alice"]) + len(q3)
        regen = await adapter.chat_turn(
            cache,
            "alice/regen",
            [q3[-1]],
            max_new_tokens=4,
            parent="alice",
            parent_tokens=question - 1,
        )
        assert list(regen.answer) == list(second.answer)  # greedy: the same answer again
        assert list(regen.answer) == recompute_greedy(model, chats["alice"] + q3, 4)
        # ... and edit its first message (fork before it, inside the stored first turn)
        edit = await adapter.chat_turn(
            cache,
            "alice/edit",
            edited,
            max_new_tokens=4,
            parent="alice",
            parent_tokens=len(prompt),
        )
        assert list(edit.answer) == recompute_greedy(model, prompt + edited, 4)
        meta = cache.channel["alice/edit"]
        assert (meta.parent, meta.parent_tokens) == ("alice", len(prompt))
        # a fork point at the end of alice's inherited prompt: it lists the prompt only
        assert meta.shared_bytes == cache.channel["system"].nbytes
        # a fork's next turn restores its whole history
        edited_history = prompt + edited + list(edit.answer)
        after = await adapter.chat_turn(
            cache, "alice/edit", q2, max_new_tokens=4, history=edited_history
        )
        assert list(after.answer) == recompute_greedy(model, edited_history + q2, 4)
        assert problems(cache) == []


async def test_forks_over_a_shared_redis_tier_answer_like_recompute(
    redis_server: RedisServer,
) -> None:
    """Two replicas over one Redis server: A stores the system prompt, B forks a chat from
    it (referencing the prompt's turn in Redis, not copying it), and A takes that chat over
    from the shared tier and continues it: every answer is the one recomputing the
    conversation gives."""
    model = opt()
    adapter = TransformersAdapter(model)
    system, q1, q2 = queries(3, length=6, seed=17)
    prefix = new_prefix()

    def replica() -> TieredKVCache:
        shared = RedisTier(redis_server.url, 16 << 20, prefix=prefix, lease_ttl=0.5)
        return TieredKVCache([HostMemoryTier(1 << 20), shared], mode="inclusive")

    async with replica() as a, replica() as b:
        await adapter.chat_turn(a, "system", system, max_new_tokens=2)
        await a.flush()
        prompt = system + list(await adapter.recompute(system, max_new_tokens=2))
        turn = await adapter.chat_turn(b, "alice", q1, max_new_tokens=4, parent="system")
        assert list(turn.answer) == recompute_greedy(model, prompt + q1, 4)
        assert turn.restored_tokens == len(prompt)
        meta = b.channel["alice"]
        assert (meta.parent, meta.parent_tokens) == ("system", len(prompt))
        assert meta.shared_bytes == a.channel["system"].nbytes  # (listed, not copied)
        await b.flush()
        history = prompt + q1 + list(turn.answer)
        await a.load("alice")  # (A takes the chat over: the fork, read from Redis)
        after = await adapter.chat_turn(a, "alice", q2, max_new_tokens=4, history=history)
        assert after.restored_tokens == len(history)
        assert list(after.answer) == recompute_greedy(model, history + q2, 4)


async def test_a_turn_after_a_miss_that_kept_its_copies_stores_the_recomputed_history_alone(
    own_redis_server: RedisServer,
) -> None:
    """A replica over Redis stores a chat, then the server stops answering for longer
    than the replica's liveness: its next turn's restore cannot prove its copy current (a
    miss that keeps the copy), so the turn recomputes the caller's history. The server
    answers again while the model runs (a forward hook resumes it): the stored history
    is the recomputed one, the old copy's tokens not in front of it (they used to be: a
    history of both, twice the conversation's tokens), and the next turn restores it."""
    model = llama()
    adapter = TransformersAdapter(model)
    q1, q2, q3 = queries(3)
    server = own_redis_server
    shared = RedisTier(
        server.url, 16 << 20, prefix=new_prefix(), lease_ttl=2.0, timeout=0.3, liveness=0.6
    )
    async with TieredKVCache([HostMemoryTier(1 << 20), shared], mode="inclusive") as cache:
        first = await adapter.chat_turn(cache, "s", q1, max_new_tokens=4)
        await cache.flush()
        history = q1 + list(first.answer)
        paused = [True]

        def resume(*_: Any) -> None:
            if paused[0]:
                paused[0] = False
                server.resume()

        server.pause()
        handle = model.register_forward_pre_hook(resume)
        try:
            await anyio.sleep(1.0)  # (past the replica's liveness: its copy is unproven)
            turn = await adapter.chat_turn(cache, "s", q2, max_new_tokens=4, history=history)
        finally:
            handle.remove()
            resume()
        assert turn.recomputed_tokens == len(history)
        assert cache.stats().unproven == 1
        assert list(turn.answer) == recompute_greedy(model, history + q2, 4)
        history += q2 + list(turn.answer)
        assert cache.channel["s"].tokens == len(history)
        await cache.flush()
        third = await adapter.chat_turn(cache, "s", q3, max_new_tokens=4, history=history)
        assert third.restored_tokens == len(history)
        assert list(third.answer) == recompute_greedy(model, history + q3, 4)


async def test_a_fork_of_a_lost_parent_is_recomputed_from_its_history(cache: TieredKVCache) -> None:
    model = llama()
    adapter = TransformersAdapter(model)
    q1, q2 = queries(2)
    first = await adapter.chat_turn(cache, "s", q1, max_new_tokens=4)
    history = q1 + list(first.answer)
    await cache.drop("s")
    with pytest.raises(SessionNotFoundError):
        await adapter.chat_turn(cache, "f", q2, max_new_tokens=4, parent="s")
    turn = await adapter.chat_turn(cache, "f", q2, max_new_tokens=4, parent="s", history=history)
    assert turn.recomputed_tokens == len(history)
    assert list(turn.answer) == recompute_greedy(model, history + q2, 4)
    meta = cache.channel["f"]
    assert meta.parent is None
    assert meta.shared_bytes == 0
    assert meta.tokens == len(history) + len(q2) + 4


async def test_bad_forks_are_refused_before_anything_runs(cache: TieredKVCache) -> None:
    adapter = TransformersAdapter(llama())
    q1, q2 = queries(2)
    await adapter.chat_turn(cache, "s", q1, max_new_tokens=4)
    with pytest.raises(ValueError, match="already stored"):
        await adapter.chat_turn(cache, "s", q2, max_new_tokens=4, parent="s")
    with pytest.raises(ValueError, match="needs parent"):
        await adapter.chat_turn(cache, "f", q2, max_new_tokens=4, parent_tokens=3)
    with pytest.raises(HistoryMismatchError, match="fewer than the 99"):
        await adapter.chat_turn(cache, "f", q2, max_new_tokens=4, parent="s", parent_tokens=99)
    with pytest.raises(HistoryMismatchError, match="the conversation has 4"):
        await adapter.chat_turn(
            cache, "f", q2, max_new_tokens=4, parent="s", parent_tokens=5, history=q1[:4]
        )
    assert "f" not in cache.channel
