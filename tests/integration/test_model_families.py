"""Every supported model family, both codecs where offered, through real tiers (host + SSD).

Each model is a tiny random-weight model built from its config (nothing is downloaded),
with weights sharp enough (``initializer_range=0.2``) that an error in a restored K or V
reaches the logits, and random attention biases (they start at zero, which would hide a
re-projection that forgot them). Per model, two conversations of three turns share a host
tier that holds about two and a half turns, so some histories are served from the SSD
tier. Every greedy answer must equal, token for token, (a) what the model answers
recomputing the conversation from its tokens with no cache, and (b) what an uninterrupted
transformers session (one ``DynamicCache`` kept across the turns) answers; the K/V
restored at the end must equal that session's cache, sliding-window layers included.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
from transformers import DynamicCache

from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.integrations.architectures import (
    KV_ONLY_FAMILIES,
    architecture_names,
    supported_models_table,
)
from tieredkv.integrations.transformers import (
    TransformersAdapter,
    UnsupportedModelError,
    cache_argument,
)
from tieredkv.payload import plan_segment

QUERY, ANSWER, TURNS = 5, 6, 3
WINDOW = 8  # sliding window of the models that have one: the conversations outgrow it


def _config(cls: Any, **kw: Any) -> Any:
    base: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "initializer_range": 0.2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    base.update(kw)
    return cls(**base)


def _gqa(cls: Any, **kw: Any) -> Any:
    return _config(cls, num_key_value_heads=2, intermediate_size=128, **kw)


def _gpt(cls: Any, **kw: Any) -> Any:
    return cls(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=128,
        n_positions=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


FAMILIES: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]] = {
    "llama": (T.LlamaForCausalLM, lambda: _gqa(T.LlamaConfig)),
    "mistral": (T.MistralForCausalLM, lambda: _gqa(T.MistralConfig, sliding_window=WINDOW)),
    "mixtral": (
        T.MixtralForCausalLM,
        lambda: _gqa(
            T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW
        ),
    ),
    "qwen2": (T.Qwen2ForCausalLM, lambda: _gqa(T.Qwen2Config)),
    "qwen3": (T.Qwen3ForCausalLM, lambda: _gqa(T.Qwen3Config, head_dim=16)),
    "qwen3_moe": (
        T.Qwen3MoeForCausalLM,
        lambda: _gqa(
            T.Qwen3MoeConfig,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
    ),
    "phi3": (T.Phi3ForCausalLM, lambda: _gqa(T.Phi3Config, partial_rotary_factor=0.5)),
    "gemma": (T.GemmaForCausalLM, lambda: _gqa(T.GemmaConfig, head_dim=16)),
    "gemma2": (
        T.Gemma2ForCausalLM,
        lambda: _gqa(T.Gemma2Config, head_dim=16, sliding_window=WINDOW),
    ),
    "gemma3_text": (
        T.Gemma3ForCausalLM,
        lambda: _gqa(
            T.Gemma3TextConfig, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2
        ),
    ),
    "gpt2": (T.GPT2LMHeadModel, lambda: _gpt(T.GPT2Config)),
    "gpt_neox": (
        T.GPTNeoXForCausalLM,
        lambda: _config(T.GPTNeoXConfig, intermediate_size=128, rotary_pct=0.5),
    ),
    "gptj": (T.GPTJForCausalLM, lambda: _gpt(T.GPTJConfig, rotary_dim=8)),
    "falcon": (
        T.FalconForCausalLM,
        lambda: _config(T.FalconConfig, new_decoder_architecture=True, num_kv_heads=2),
    ),
    "olmo": (T.OlmoForCausalLM, lambda: _gqa(T.OlmoConfig, clip_qkv=1.5)),
    "olmo2": (T.Olmo2ForCausalLM, lambda: _gqa(T.Olmo2Config)),
    "starcoder2": (
        T.Starcoder2ForCausalLM,
        lambda: _gqa(T.Starcoder2Config, sliding_window=WINDOW),
    ),
    "stablelm": (
        T.StableLmForCausalLM,
        lambda: _gqa(T.StableLmConfig, partial_rotary_factor=0.25, use_qkv_bias=True),
    ),
    "cohere": (T.CohereForCausalLM, lambda: _gqa(T.CohereConfig)),
    "granite": (T.GraniteForCausalLM, lambda: _gqa(T.GraniteConfig)),
    "opt": (T.OPTForCausalLM, lambda: _config(T.OPTConfig, ffn_dim=128)),
    # dynamic RoPE: frequencies follow the sequence length once it passes the 16 positions
    "llama-dynamic-rope": (
        T.LlamaForCausalLM,
        lambda: _gqa(
            T.LlamaConfig,
            max_position_embeddings=16,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
}

_BIASES = tuple(
    f"{name}.bias"
    for name in ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value")
)


def build(family: str) -> Any:
    """The family's tiny model, seeded, with random attention biases, in eval mode."""
    model_cls, config = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_BIASES):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def _codecs(family: str) -> list[str]:
    model_type = FAMILIES[family][1]().model_type
    rope = "dynamic" in family
    return ["kv", "act"] if model_type in architecture_names() and not rope else ["kv"]


CASES = [pytest.param(f, c, id=f"{f}-{c}") for f in FAMILIES for c in _codecs(f)]


def queries(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (QUERY,), generator=g).tolist() for _ in range(TURNS)]


def step(model: Any, cache: Any, ids: list[int]) -> int:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True, **{cache_argument(model): cache})
    return int(out.logits[0, -1].argmax())


def live_session(model: Any, turns: list[list[int]]) -> tuple[list[list[int]], DynamicCache]:
    """The conversation on one uninterrupted transformers cache: each turn prefills its
    query, decodes greedily and feeds the last answer token, as the adapter does."""
    cache = DynamicCache(config=model.config)
    answers: list[list[int]] = []
    for query in turns:
        answer = [step(model, cache, query)]
        while len(answer) < ANSWER:
            answer.append(step(model, cache, answer[-1:]))
        step(model, cache, answer[-1:])
        answers.append(answer)
    return answers, cache


def recompute(model: Any, tokens: list[int]) -> list[int]:
    """Greedy answer computed from the tokens alone, with no cache at all."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(ANSWER):
            logits = model(input_ids=torch.tensor([tokens + out]), use_cache=False).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def state(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too, such as RoPE frequencies)."""
    found = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    found.update({f"b:{n}": b.clone() for n, b in model.named_buffers()})
    return found


@pytest.mark.parametrize(("family", "codec"), CASES)
async def test_three_turn_chat_equals_recompute_and_the_live_session(
    family: str, codec: str, ssd_dir: Path
) -> None:
    users = {"alice": queries(1), "bob": queries(2)}
    base = build(family)
    # one model per conversation and per reference: a dynamic-RoPE model's frequencies
    # depend on the longest sequence it last saw, so models are not shared
    live = {u: live_session(copy.deepcopy(base), qs) for u, qs in users.items()}
    models = {u: copy.deepcopy(base) for u in users}
    adapters = {u: TransformersAdapter(m, codec=codec) for u, m in models.items()}  # type: ignore[arg-type]
    adapter = adapters["alice"]
    assert adapter.codec.name == codec
    assert adapter.codec_id == adapters["bob"].codec_id
    turn_tokens = QUERY + ANSWER
    segment = plan_segment(
        "x", 0, _zeros(adapter, turn_tokens), token_dim=adapter.token_dim, answer_tokens=ANSWER
    )
    host = HostMemoryTier(max(4096, segment.length * 5 // 2 // 4096 * 4096))
    histories: dict[str, list[int]] = {u: [] for u in users}
    dynamic = "dynamic" in family
    recompute_differs = False
    async with TieredKVCache([host, SSDTier(ssd_dir, 16 << 20)]) as cache:
        for turn in range(TURNS):
            for user, qs in users.items():
                history = histories[user]
                result = await adapters[user].chat_turn(
                    cache, user, qs[turn], max_new_tokens=ANSWER, history=history
                )
                answer = list(result.answer)
                assert answer == live[user][0][turn], f"{user} turn {turn}: not the live answer"
                expected = recompute(copy.deepcopy(base), history + qs[turn])
                if dynamic:
                    # transformers' own dynamic RoPE rotates a key with the frequencies of
                    # the step that computed it, so a session decoding past the position
                    # limit and a recompute of the same tokens disagree: the live session
                    # is the reference there
                    recompute_differs |= answer != expected
                else:
                    assert answer == expected, f"{user} turn {turn}: not the recomputed answer"
                assert result.restored_tokens == len(history)
                history += qs[turn] + answer
                assert result.history_tokens == len(history)
        assert cache.stats().tiers[1].bytes_read > 0  # some histories came from the SSD
        assert recompute_differs == dynamic  # the histories did pass the position limit
        for user, history in histories.items():
            before = state(models[user])
            restored = await adapters[user].restore(cache, user, expected_tokens=len(history))
            assert_same_kv(restored, live[user][1])
            assert_unchanged(before, models[user])  # re-projection leaves the model alone


def assert_unchanged(before: dict[str, torch.Tensor], model: Any) -> None:
    after = state(model)
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert torch.equal(t, after[name]), f"{name} changed"


def _zeros(adapter: TransformersAdapter, tokens: int) -> dict[str, torch.Tensor]:
    dtype = getattr(torch, adapter.spec.dtype)
    return {
        name: torch.zeros(tuple(tokens if d == -1 else d for d in shape), dtype=dtype)
        for name, shape in adapter.codec.layout(adapter.spec).items()
    }


def assert_same_kv(restored: Any, live: DynamicCache) -> None:
    """Every layer's K and V as the live session's cache holds them (sliding-window layers:
    the last ``window - 1`` positions), within fp32 rounding."""
    assert restored.get_seq_length() == live.get_seq_length()
    live_layers: list[Any] = list(live.layers)
    for i, (a, b) in enumerate(zip(restored.layers, live_layers, strict=True)):
        assert a.is_sliding == b.is_sliding, f"layer {i}"
        assert a.keys.shape == b.keys.shape, f"layer {i}"
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)


def test_the_suite_covers_every_family_of_the_issue() -> None:
    wanted = {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "phi3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "gpt2",
        "gpt_neox",
        "gptj",
        "falcon",
        "olmo",
        "olmo2",
        "starcoder2",
        "stablelm",
        "cohere",
        "granite",
        "opt",
    }
    assert wanted <= set(FAMILIES)
    assert wanted <= set(architecture_names()) | set(KV_ONLY_FAMILIES)
    sliding = {f for f in FAMILIES if any(w is not None for w in _windows(f))}
    assert sliding == {"mistral", "mixtral", "gemma2", "gemma3_text", "starcoder2"}


def _windows(family: str) -> list[int | None]:
    from tieredkv.integrations.inplace import layer_windows

    return layer_windows(FAMILIES[family][1]())


def test_longrope_gets_the_kv_codec_and_says_why() -> None:
    torch.manual_seed(0)
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
    }
    model: Any = T.LlamaForCausalLM(_gqa(T.LlamaConfig, rope_parameters=rope))
    model.eval()
    adapter = TransformersAdapter(model)
    assert adapter.codec.name == "kv"
    assert "'longrope'" in adapter.codec_reason
    with pytest.raises(UnsupportedModelError, match="RoPE type 'longrope'"):
        TransformersAdapter(model, codec="act")


def test_dynamic_rope_gets_the_kv_codec_and_says_why() -> None:
    model = build("llama-dynamic-rope")
    with torch.no_grad():  # 40 positions: past the 16 of the config, the frequencies grow
        model(input_ids=torch.arange(40).view(1, -1), use_cache=False)
    before = state(model)
    adapter = TransformersAdapter(model)
    assert_unchanged(before, model)  # the construction's probe put the frequencies back
    assert adapter.codec.name == "kv"
    assert "'dynamic'" in adapter.codec_reason
    with pytest.raises(UnsupportedModelError, match=r"RoPE type 'dynamic'.*codec='kv'"):
        TransformersAdapter(model, codec="act")


def test_the_supported_models_page_shows_the_registry() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "reference" / "supported-models.md"
    text = page.read_text()
    begin, end = "<!-- generated: supported_models_table() -->\n", "<!-- end generated -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == supported_models_table(), (
        "docs/reference/supported-models.md is out of date: paste supported_models_table() "
        "between its markers"
    )
    for family in set(FAMILIES) - {"llama-dynamic-rope"}:
        assert f"| `{family}` |" in table
