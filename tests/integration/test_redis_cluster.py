"""RedisTier on a three-node Redis Cluster (started here): the hash-tag layout at work.

Each conversation's keys carry the hash tag ``{H}``, so its values, manifest and lease sit
in one slot and the Lua steps (publish, acquire, delete) run on one node. Conversations
spread over the three nodes; every one reads back byte for byte, through a
``redis.asyncio.RedisCluster`` client that the tier is given.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis
import redis.asyncio as aioredis
import torch

from tests.redis_server import RedisServer, require_redis_server
from tests.segments import SegmentFactory, read_back, store
from tieredkv import TieredKVCache
from tieredkv.backends.redis import RedisTier, conversation_tag, driver_options
from tieredkv.payload import plan_segment


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """Three cluster-enabled servers, joined into one cluster with all slots assigned."""
    require_redis_server()
    nodes: list[RedisServer] = []
    try:
        for i in range(3):
            d = tmp_path / f"node{i}"
            d.mkdir()
            node = RedisServer(d, extra=("--cluster-enabled", "yes"))
            node.start()
            nodes.append(node)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        with nodes[0].client() as c:
            for _ in range(200):  # the nodes agree on the slots within a moment
                if c.cluster("info").get("cluster_state") == "ok":
                    break
                time.sleep(0.05)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.slow  # starts a three-node cluster: CI runs it
async def test_conversations_spread_over_nodes_each_in_one_slot(
    cluster: list[RedisServer], seg: SegmentFactory
) -> None:
    """Eight conversations of two segments (split into several values each) through a
    RedisCluster client: byte-exact reads, a second replica finds them, and every key of a
    conversation lives on one node, with the conversations on more than one node."""
    options = await anyio.to_thread.run_sync(driver_options)
    client = aioredis.RedisCluster(host="127.0.0.1", port=cluster[0].port, **options)
    sessions = [f"user-{i}" for i in range(8)]
    segs = [seg(session=s, seq=j, tokens=600 * (j + 1), seed=j) for s in sessions for j in (0, 1)]
    try:
        async with RedisTier(client, 64 << 20, prefix="c", value_size=64 << 10) as a:
            for s in segs:
                await store(a, s)
            for s in segs:
                assert await read_back(a, s) == s.data
            async with RedisTier(client, 64 << 20, prefix="c", recover=False) as b:
                for s in segs[::2]:
                    assert [h.seq for h in await b.lookup(s.key[0])] == [0, 1]
                for s in segs:
                    assert await read_back(b, s) == s.data
    finally:
        await client.aclose()
    homes: dict[str, set[int]] = {s: set() for s in sessions}
    for i, node in enumerate(cluster):
        with redis.Redis(host="127.0.0.1", port=node.port) as c:
            for key in c.scan_iter(match="c:{*"):  # (the conversations' keys)
                tag = key.decode().split("{")[1].split("}")[0]
                session = next(s for s in sessions if conversation_tag(s) == tag)
                homes[session].add(i)
    assert all(len(nodes) == 1 for nodes in homes.values()), homes
    assert len(set.union(*homes.values())) > 1


@pytest.mark.slow  # starts a three-node cluster: CI runs it
async def test_a_cluster_tier_joins_pieces_and_a_cache_appends_through_it(
    cluster: list[RedisServer],
) -> None:
    """A Cluster client keeps redis-py's pipeline, which takes each value whole: the tier
    does not take a segment as pieces (``writes_pieces`` is false), ``write_pieces`` joins
    them and stores exactly the serialized segment, and a cache appends through the staged
    copy and loads its turns byte for byte."""
    gen = torch.Generator().manual_seed(9)
    turns = [
        {
            n: torch.randint(0, 255, (40 * (i + 1), 4096), dtype=torch.uint8, generator=gen)
            for n in ("k", "v")
        }
        for i in range(2)
    ]
    plan = plan_segment("pieces", 0, turns[0], token_dim=0, answer_tokens=1)
    serialized = bytearray(plan.length)
    plan.write_into(memoryview(serialized))
    options = await anyio.to_thread.run_sync(driver_options)
    client = aioredis.RedisCluster(host="127.0.0.1", port=cluster[0].port, **options)
    try:
        async with RedisTier(client, 64 << 20, prefix="p", value_size=64 << 10) as tier:
            assert not tier.writes_pieces
            pieces = plan.pieces()
            assert pieces is not None
            assert len(pieces) > 1
            assert tier.reserve(("pieces", 0), plan.length)
            await tier.write_pieces(("pieces", 0), pieces)
            out = bytearray(plan.length)
            await tier.read([("pieces", 0)], [memoryview(out)])
            assert out == serialized
        shared = RedisTier(client, 64 << 20, prefix="q", value_size=64 << 10)
        async with TieredKVCache([shared]) as cache:
            for i, t in enumerate(turns):
                await cache.append("chat", t, answer_tokens=i + 1)
            got = await cache.load("chat")
        for n in ("k", "v"):
            assert torch.equal(got[n], torch.cat([t[n] for t in turns]))
    finally:
        await client.aclose()
