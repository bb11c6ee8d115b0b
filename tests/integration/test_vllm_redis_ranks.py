"""The vLLM connector's workers over one real ``redis-server``: each rank of a
tensor-parallel (or pipeline-parallel) engine holds its own shard of a conversation, under
Redis keys of its own, so no rank is ever served another's.

Before, every rank's Redis tier used the same keys: a conversation's two shards collided
(the second rank's append met the first's writer lease), and after a restart a rank whose
own tiers never held the conversation loaded the other rank's shard from Redis. No vLLM
engine starts here: the worker side (:class:`WorkerStore`) moves real paged-KV blocks.
"""

from __future__ import annotations

import torch

from tests.redis_server import RedisServer, redis_server
from tieredkv.integrations.vllm.config import parse_config
from tieredkv.integrations.vllm.keys import fingerprint
from tieredkv.integrations.vllm.ops import LoadOp, SaveOp
from tieredkv.integrations.vllm.worker import WorkerStore, redis_prefix

__all__ = ["redis_server"]

BS = 4
FP = fingerprint(
    model="m", identity="id:m", dtype="float32", kv_dtype="auto", block_size=BS, layout="L2"
)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
TOKENS = tuple(range(100, 112))  # 3 blocks


def paged(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(16, 2, BS, 8, generator=g) for name in LAYERS}


def worker(server: RedisServer, rank: int, kv: dict[str, torch.Tensor]) -> WorkerStore:
    config = parse_config({"redis_url": server.url, "host_bytes": 1 << 20, "redis_timeout": 5})
    store = WorkerStore(config, FP, BS, rank=rank)
    store.open(kv)
    return store


def test_each_rank_stores_and_loads_only_its_own_shard(redis_server: RedisServer) -> None:
    assert len({redis_prefix(rank) for rank in range(4)}) == 4
    assert redis_prefix(0) == "tieredkv"  # a single worker's keys, as before
    shards = {rank: paged(seed=rank) for rank in (0, 1)}
    for rank, kv in shards.items():  # each rank stores its shard of one conversation
        store = worker(redis_server, rank, kv)
        try:
            store.save(SaveOp("r1", "vllm-S", (3, 5, 6), 0, 3, TOKENS, answer_tokens=4))
            store.wait_idle()
            assert [ok for _, ok in store.finished_saves()] == [True], rank
        finally:
            store.close()
    for rank, kv in shards.items():  # restarted with empty host memory: from Redis only
        fresh = {name: torch.zeros_like(layer) for name, layer in kv.items()}
        store = worker(redis_server, rank, fresh)
        try:
            assert store.load_sync(LoadOp("r2", "vllm-S", (9, 10, 11), 0, 3, TOKENS, sync=True))
            for name, layer in fresh.items():
                assert torch.equal(layer[[9, 10, 11]], kv[name][[3, 5, 6]]), (rank, name)
        finally:
            store.close()
