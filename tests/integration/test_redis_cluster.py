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

from tests.redis_server import RedisServer, require_redis_server
from tests.segments import SegmentFactory, read_back, store
from tieredkv.backends.redis import RedisTier, conversation_tag, driver_options


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
