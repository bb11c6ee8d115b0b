"""The in-place model cache and the buffer pool behind the adapter's restores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, MambaConfig, Qwen2Config
from transformers.cache_utils import DynamicSlidingWindowLayer

from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.integrations.inplace import (
    BufferPool,
    InPlaceLayer,
    InPlaceSlidingLayer,
    in_place_cache,
    layer_windows,
)
from tieredkv.integrations.transformers import TransformersAdapter

from .test_transformers_adapter import llama


def kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, tokens, 4, generator=g), torch.randn(1, 2, tokens, 4, generator=g)


def test_updates_land_in_the_buffer_and_equal_concatenation() -> None:
    layer = InPlaceLayer(16)
    reference = DynamicCache()
    for step, tokens in enumerate((5, 1, 1, 3)):
        k, v = kv(tokens, step)
        keys, values = layer.update(k, v)
        ref_k, ref_v = reference.update(k, v, 0)
        assert torch.equal(keys, ref_k)
        assert torch.equal(values, ref_v)
        if step == 0:
            pointer = keys.data_ptr()
        assert keys.data_ptr() == pointer  # no reallocation within the capacity
    assert layer.get_seq_length() == 10
    assert layer.capacity == 16


def test_growing_past_the_capacity_keeps_every_position() -> None:
    layer = InPlaceLayer(4)
    parts = [kv(3, s) for s in range(5)]
    for k, v in parts:
        layer.update(k, v)
    assert layer.capacity >= 15
    torch.testing.assert_close(layer.keys, torch.cat([k for k, _ in parts], dim=-2), rtol=0, atol=0)
    torch.testing.assert_close(
        layer.values, torch.cat([v for _, v in parts], dim=-2), rtol=0, atol=0
    )


def test_a_filled_buffer_is_adopted_and_crop_and_release_work() -> None:
    keys, values = torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4)
    keys[..., :3, :] = 1.0
    layer = InPlaceLayer(keys=keys, values=values, length=3)
    assert layer.get_seq_length() == 3
    assert layer.keys is not None
    assert torch.equal(layer.keys, keys[..., :3, :])
    k, v = kv(2, 0)
    layer.update(k, v)
    assert torch.equal(keys[..., 3:5, :], k)  # written into the caller's buffer
    layer.crop(-4)
    assert layer.get_seq_length() == 1
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)
    buffers = layer.release()
    assert [b.shape for b in buffers] == [(2, 8, 4), (2, 8, 4)]
    assert layer.get_seq_length() == 0
    assert layer.capacity == 0


def test_mismatched_buffers_are_refused() -> None:
    with pytest.raises(ValueError, match="both"):
        InPlaceLayer(keys=torch.zeros(1, 2, 8, 4))
    with pytest.raises(ValueError, match="head_dim"):
        InPlaceLayer(keys=torch.zeros(1, 2, 8, 4), values=torch.zeros(1, 3, 8, 4))
    uneven = InPlaceLayer(keys=torch.zeros(1, 2, 8, 4), values=torch.zeros(1, 2, 6, 4), length=2)
    assert uneven.capacity == 6  # pooled buffers may differ in length: the shorter counts
    k, v = kv(5, 1)
    uneven.update(k, v)  # 7 > 6: both grow
    assert uneven.capacity >= 7
    assert uneven.keys is not None
    assert torch.equal(uneven.keys[..., 2:, :], k)
    with pytest.raises(ValueError, match="does not fit"):
        InPlaceLayer(keys=torch.zeros(1, 2, 8, 4), values=torch.zeros(1, 2, 8, 4), length=9)


def test_sliding_layer_is_transformers_sliding_layer_with_every_position_kept() -> None:
    window = 4
    layer = InPlaceSlidingLayer(window, 2)
    reference = DynamicSlidingWindowLayer(window)
    parts = [kv(t, s) for s, t in enumerate((5, 1, 1, 3, 1))]
    length = 0
    for k, v in parts:
        assert layer.get_mask_sizes(k.shape[-2]) == reference.get_mask_sizes(k.shape[-2])
        got, want = layer.update(k, v), reference.update(k, v)
        length += k.shape[-2]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)  # what attention reads
        for mine, theirs in ((layer.keys, reference.keys), (layer.values, reference.values)):
            assert mine is not None
            assert theirs is not None
            assert torch.equal(mine, theirs)  # what the cache holds
        assert layer.get_seq_length() == reference.get_seq_length() == length
    everything = torch.cat([k for k, _ in parts], dim=-2)
    assert torch.equal(layer.tokens(2)[0], everything[..., 2:, :])  # kept past the window
    assert layer.is_sliding
    assert layer.get_max_length() == window
    # releases before 5.24 pass the query's cache positions instead of its length
    assert layer.get_mask_sizes(torch.arange(11, 14)) == layer.get_mask_sizes(3) == (6, 8)
    with pytest.raises(ValueError, match="at least 1"):
        InPlaceSlidingLayer(0)


def test_layer_windows_follow_the_config_and_refuse_other_caches() -> None:
    full = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2)
    assert layer_windows(full) == [None, None]
    sliding = Qwen2Config(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )
    assert layer_windows(sliding) == [None, 8]
    cache = in_place_cache(sliding, [InPlaceLayer(), InPlaceSlidingLayer(8)])
    assert cache.is_sliding == [False, True]
    with pytest.raises(ValueError, match="has 2 layers, got 1"):
        in_place_cache(sliding, [InPlaceLayer()])
    mamba = MambaConfig(num_hidden_layers=2, hidden_size=32)
    with pytest.raises(TypeError) as info:
        layer_windows(mamba)
    assert info.value.args == (0, "LinearAttentionLayer")


def test_pool_reuses_fitting_buffers_only() -> None:
    pool = BufferPool(1 << 20, quantum=16)
    assert pool.capacity_for(10) == 16
    assert pool.capacity_for(40) == 64
    cpu = torch.device("cpu")
    a = pool.take((2, 10, 4), 1, torch.float32, cpu)
    assert a.shape == (2, 16, 4)
    pool.give([a])
    assert pool.nbytes == a.nbytes
    assert pool.take((2, 12, 4), 1, torch.float32, cpu) is a  # fits
    pool.give([a])
    assert pool.take((2, 12, 4), 1, torch.float64, cpu) is not a  # other dtype
    assert pool.take((3, 12, 4), 1, torch.float32, cpu) is not a  # other heads
    assert pool.take((2, 17, 4), 1, torch.float32, cpu) is not a  # too short
    big = torch.empty(2, 400, 4)
    pool.give([big])
    assert pool.take((2, 14, 4), 1, torch.float32, cpu) is a  # the tight one
    assert pool.take((2, 14, 4), 1, torch.float32, cpu) is not big  # far too large


def test_pool_keeps_whole_buffers_within_its_budget() -> None:
    pool = BufferPool(4096)
    whole = torch.empty(512)  # 2 KiB
    pool.give([torch.empty(8, 64)[:4], whole])  # a partial view is never kept
    assert pool.nbytes == whole.nbytes
    pool.give([torch.empty(768)])  # 3 KiB: over budget, the largest goes
    assert pool.nbytes == whole.nbytes
    pool.clear()
    assert pool.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        BufferPool(-1)


async def test_recycled_buffers_answer_like_fresh_ones(tmp_path: Path) -> None:
    """Turns of three conversations, interleaved, with and without recycling, answer the
    same; and the second turn on restores into a buffer the previous turn gave back."""
    model = llama()
    answers: list[list[tuple[int, ...]]] = []
    for recycle in (0, 64 << 20):
        adapter = TransformersAdapter(model, codec="kv", recycle_bytes=recycle)
        histories: dict[str, list[int]] = {u: [] for u in ("a", "b", "c")}
        got: list[tuple[int, ...]] = []
        g = torch.Generator().manual_seed(3)
        tiers = [HostMemoryTier(8 << 20), SSDTier(tmp_path / str(recycle), 64 << 20)]
        async with TieredKVCache(tiers) as cache:
            for _ in range(3):
                for user, history in histories.items():
                    query = torch.randint(3, 128, (7,), generator=g).tolist()
                    result = await adapter.chat_turn(
                        cache, user, query, max_new_tokens=5, history=history
                    )
                    history += query + list(result.answer)
                    got.append(result.answer)
                    pool = adapter._pool
                    if recycle:
                        assert pool is not None
                        assert pool.nbytes > 0
                    else:
                        assert pool is None
        answers.append(got)
    assert answers[0] == answers[1]
