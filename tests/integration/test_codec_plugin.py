"""A codec the transformers adapter has never heard of serves it as the shipped ones do.

The adapter asks a codec what it needs (:class:`~tieredkv.codecs.Codec`: whether it needs
activations, whether it decodes in place, how to decode one layer); nothing in it names a
codec class. :class:`tests.packed_codec.PackedKV` stores each layer's K and V stacked in
one tensor and decodes by copy; the multi-turn lossless and layer-wise tests of
``test_transformers_adapter.py`` run it too. Here: the model cache it restores holds
exactly the stored bytes, streamed or not, and a codec that cannot serve is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tests.integration.test_transformers_adapter import (
    count_streams,
    layer_kv,
    mistral_sliding,
    queries,
)
from tests.invariants import problems
from tests.packed_codec import PackedKV
from tieredkv import SSDTier, TieredKVCache
from tieredkv.codecs import Codec
from tieredkv.integrations.transformers import TransformersAdapter, UnsupportedModelError


def test_the_packed_codec_is_a_codec() -> None:
    assert isinstance(PackedKV(), Codec)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
async def test_an_unknown_codec_restores_exactly_the_stored_bytes(
    layerwise: bool, ssd_dir: Path
) -> None:
    model = mistral_sliding()  # sliding-window layers: restored to the window they keep
    adapter = TransformersAdapter(model, codec=PackedKV(), layerwise=layerwise)
    assert adapter.codec_id.startswith("packed/")
    assert adapter.codec_reason == "packed: as given"
    assert adapter.token_dim == 2
    history: list[int] = []
    async with TieredKVCache([SSDTier(ssd_dir, 16 << 20)]) as cache:
        streamed = count_streams(cache)
        for query in queries(3):
            turn = await adapter.chat_turn(cache, "s", query, max_new_tokens=4, history=history)
            history += query + list(turn.answer)
        assert streamed == (["s", "s"] if layerwise else [])
        stored = await cache.load("s")
        restored = await adapter.restore(cache, "s", expected_tokens=len(history))
        for i, (k, v) in enumerate(layer_kv(restored)):
            packed = stored[f"layers.{i}.kv"]
            assert packed.shape[2] == len(history)
            window = k.shape[-2]  # a sliding layer exposes its last tokens
            assert torch.equal(k[0], packed[0][:, len(history) - window :])
            assert torch.equal(v[0], packed[1][:, len(history) - window :])
        assert problems(cache) == []


class NeedsActivations(PackedKV):
    name = "needs-act"
    needs_activations = True


class OldProtocol:
    """A codec written before the protocol had ``decodes_in_place`` and ``decode_layer``."""

    name = "old"
    needs_activations = False

    def __getattr__(self, name: str) -> Any:
        if name in ("decodes_in_place", "decode_layer"):
            raise AttributeError(name)
        return getattr(PackedKV(), name)


def test_a_codec_the_model_cannot_serve_or_an_incomplete_one_is_refused() -> None:
    torch.manual_seed(0)  # GPT-2 fuses its Q/K/V projection: it cannot be re-projected
    gpt2: Any = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128))
    gpt2.eval()
    with pytest.raises(UnsupportedModelError, match="'needs-act' needs activations"):
        TransformersAdapter(gpt2, codec=NeedsActivations())
    with pytest.raises(ValueError, match=r"it lacks decode_layer, decodes_in_place"):
        TransformersAdapter(gpt2, codec=OldProtocol())
