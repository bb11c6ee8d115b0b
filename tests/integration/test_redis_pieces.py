"""A cache's append over a RedisTier sends the segment's header and the caller's tensors'
own bytes (``SegmentPlan.pieces``) instead of a serialized copy, against a real
redis-server: the server holds exactly the segment ``write_into`` would have serialized,
a tensor changed after its hash was taken is refused on read (never served as a mix), a
tensor that is not its own bytes is serialized as before, and an append cancelled mid-send
leaves a whole history and a usable connection."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import numpy as np
import pytest
import torch

from tests.cancellation import CANCELS, cancellable
from tests.redis_server import RedisServer, new_prefix, own_redis_server, redis_server
from tieredkv import TieredKVCache
from tieredkv.backends.base import Seal, SegmentKey
from tieredkv.backends.redis import RedisTier
from tieredkv.errors import CorruptSegmentError
from tieredkv.payload import SegmentPlan, parse_header, plan_segment, verify_segment

__all__ = ["own_redis_server", "redis_server"]  # fixtures used below

MiB = 1 << 20


class _Seen(RedisTier):
    """A RedisTier that notes the address and length of every piece it is handed."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.seen: list[dict[int, int]] = []

    async def write_pieces(
        self,
        key: SegmentKey,
        pieces: Sequence[memoryview],
        seal: Seal | None = None,
    ) -> None:
        self.seen.append(
            {int(np.frombuffer(p, dtype=np.uint8).ctypes.data): len(p) for p in pieces if len(p)}
        )
        await super().write_pieces(key, pieces, seal)


def _turn(seed: int, tokens: int = 64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"l{i}.{w}": torch.randint(
            -(2**15), 2**15, (tokens, 8, 128), dtype=torch.int16, generator=gen
        )
        for i in range(4)
        for w in "kv"
    }


async def _stored(tier: RedisTier, key: SegmentKey) -> bytes:
    buf = bytearray(tier.length(key))
    await tier.read([key], [memoryview(buf)])
    return bytes(buf)


async def test_an_append_sends_the_tensors_own_bytes_and_stores_the_serialized_segment(
    redis_server: RedisServer,
) -> None:
    tier = _Seen(redis_server.url, 256 * MiB, prefix=new_prefix(), value_size=64 << 10)
    turns = [_turn(1), _turn(2, tokens=3)]
    async with TieredKVCache([tier]) as cache:
        for t in turns:
            await cache.append("chat", t, answer_tokens=1)
        assert len(tier.seen) == 2
        for seen, t in zip(tier.seen, turns, strict=True):
            for x in t.values():  # each tensor went out from its own memory
                assert seen.get(x.data_ptr()) == x.nbytes
        for seq, t in enumerate(turns):
            data = await _stored(tier, ("chat", seq))
            header = verify_segment(memoryview(data), "stored")
            plan = plan_segment(
                "chat", seq, t, token_dim=0, answer_tokens=1, created=header.created
            )
            serialized = bytearray(plan.length)
            plan.write_into(memoryview(serialized))
            assert data == bytes(serialized)
        out = await cache.load("chat")
    for name in turns[0]:
        assert torch.equal(out[name], torch.cat([t[name] for t in turns]))


async def test_a_tensor_changed_after_its_hash_is_refused_on_read(
    redis_server: RedisServer,
) -> None:
    """The pieces are hashed, then the caller changes a tensor before they are sent: the
    server holds the changed bytes under the old hash, and a read refuses them."""
    tensors = _turn(3)
    plan = plan_segment("s", 0, tensors, token_dim=0, answer_tokens=1)
    async with RedisTier(redis_server.url, 64 * MiB, prefix=new_prefix()) as tier:
        pieces = plan.pieces()
        assert pieces is not None
        tensors["l2.v"][5, 1, 7] += 1
        assert tier.reserve(("s", 0), plan.length)
        await tier.write_pieces(("s", 0), pieces)
        with pytest.raises(CorruptSegmentError, match="checksum"):
            await _stored(tier, ("s", 0))


class _Sealing:
    """A plan's seal (``SegmentPlan.seal`` in a worker thread) that first waits until the
    server holds the segment's last value, and may then have every other connection of
    the server killed; counts its calls."""

    def __init__(self, server: RedisServer, prefix: str, plan: SegmentPlan, kill: bool) -> None:
        self.server, self.prefix, self.plan, self.kill = server, prefix, plan, kill
        self.pieces: Sequence[memoryview] = ()
        self.calls = 0

    def _body_sent(self) -> bool:
        """Whether the server holds the segment's last value (the head is in the first)."""
        last = -(-self.plan.length // (64 << 10)) - 1
        with self.server.client() as probe:
            return bool(probe.keys(f"{self.prefix}:*:0:*:{last}"))

    async def __call__(self) -> None:
        self.calls += 1
        with anyio.fail_after(10):  # (the body's values were sent before the seal began)
            while not self._body_sent():  # noqa: ASYNC110 (the server is polled, not an event)
                await anyio.sleep(0.01)
        if self.kill:  # (the head and the commit then go out on a dead connection)
            with self.server.client() as probe:
                probe.client_kill_filter(_type="normal", skipme=True)
        await anyio.to_thread.run_sync(self.plan.seal, self.pieces)


@pytest.mark.parametrize("kill", [False, True], ids=["sent", "connection-killed-after-body"])
async def test_the_body_goes_out_while_the_head_is_sealed(
    redis_server: RedisServer, kill: bool
) -> None:
    """A large segment's pieces are handed over unsealed (its prefix names no real hash
    yet), with what seals them: the tier sends every value the head is not in before it
    seals, and the head and the commit after. The server holds exactly the serialized
    segment. Where the connection dies after the body went out, the tier's retry sends the
    values again and the head with the same seal, computed once."""
    tensors = _turn(9)  # 1 MiB: 16 values of 64 KiB, the head in the first
    plan = plan_segment("s", 0, tensors, token_dim=0, answer_tokens=1)
    serialized = bytearray(plan.length)
    plan.write_into(memoryview(serialized))
    prefix = new_prefix()
    async with RedisTier(redis_server.url, 64 * MiB, prefix=prefix, value_size=64 << 10) as tier:
        pieces = plan.pieces(sealed=False)
        assert pieces is not None
        assert parse_header(pieces[0], "unsealed")[1] == 0  # (parses; names no hash yet)
        seal = _Sealing(redis_server, prefix, plan, kill)
        seal.pieces = pieces
        assert tier.reserve(("s", 0), plan.length)
        await tier.write_pieces(("s", 0), pieces, seal)
        assert seal.calls == 1
        assert await _stored(tier, ("s", 0)) == bytes(serialized)
        assert tier.stats().writes == 1


async def test_tensors_that_are_not_their_bytes_are_serialized_as_before(
    redis_server: RedisServer,
) -> None:
    tier = _Seen(redis_server.url, 64 * MiB, prefix=new_prefix())
    base = _turn(4, tokens=128)
    strided = {n: t[::2] for n, t in base.items()}  # (64 tokens, every other one)
    async with TieredKVCache([tier]) as cache:
        await cache.append("chat", strided, answer_tokens=1)
        assert tier.seen == []
        out = await cache.load("chat")
    for name, t in strided.items():
        assert torch.equal(out[name], t)


async def test_with_a_secret_the_pieces_are_joined_and_authenticated(
    redis_server: RedisServer,
) -> None:
    tensors = _turn(5)
    plan = plan_segment("s", 0, tensors, token_dim=0, answer_tokens=1)
    serialized = bytearray(plan.length)
    plan.write_into(memoryview(serialized))
    secret = b"0123456789abcdef0123"
    async with RedisTier(redis_server.url, 64 * MiB, prefix=new_prefix(), secret=secret) as tier:
        assert not tier.writes_pieces
        pieces = plan.pieces()
        assert pieces is not None
        assert tier.reserve(("s", 0), plan.length)
        await tier.write_pieces(("s", 0), pieces)
        data = await _stored(tier, ("s", 0))
    h = parse_header(data, "stored")[0]
    assert h.authenticated
    assert data[h.body_offset :] == bytes(serialized)[h.body_offset :]


@pytest.mark.parametrize("kind", CANCELS)
async def test_an_append_cancelled_mid_send_leaves_a_whole_history(
    own_redis_server: RedisServer, kind: str
) -> None:
    """The server is paused while a 32 MiB turn's pieces are sent, and the append is
    cancelled there; the server runs again a second later. The cache never abandons a
    write under way (no piece is sent after the append returns): the write finishes and
    commits the turn, which no replica can take back (others may serve it already), so
    the append completes in this cache too, and a ``task.cancel()`` (or an asyncio
    ``timeout`` or ``wait_for`` running out) then reaches the caller, while an anyio
    scope, which the write is shielded from, sees the append complete (the turn is
    large: its pieces go out unsealed while its head is hashed). The history loaded has
    both turns whole, this replica goes on appending to it, and the same connection pool
    serves it exactly."""
    big = _turn(6, tokens=2048)  # 8 x 4 MiB
    first = _turn(7)
    tier = RedisTier(
        own_redis_server.url, 512 * MiB, prefix=new_prefix(), liveness=1.0, max_connections=1
    )
    async with TieredKVCache([tier]) as cache:
        await cache.append("chat", first, answer_tokens=1)
        own_redis_server.pause()

        async def resume() -> None:
            await anyio.sleep(2.0)
            own_redis_server.resume()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(resume)
                completed, _ = await cancellable(
                    kind, 1.0, lambda: cache.append("chat", big, answer_tokens=1)
                )
                assert not completed or kind == "anyio"
        finally:
            own_redis_server.resume()
        with anyio.fail_after(60):
            out = await cache.load("chat")
            whole = all(torch.equal(out[n], torch.cat([first[n], t])) for n, t in big.items())
            assert (cache.stats().cancelled, whole) == (0, True)
            meta = cache.channel.get("chat")
            assert meta is not None
            assert meta.turns == 2
            third = _turn(8)
            await cache.append("chat", third, answer_tokens=1)  # (no conflict: it is turn 2)
            out = await cache.load("chat")
    for name, t in big.items():
        assert torch.equal(out[name], torch.cat([first[name], t, third[name]]))


class _SlowSeal(RedisTier):
    """A RedisTier whose seal of each unsealed segment takes a second longer (a sleep in a
    worker thread before the real seal, which runs in one too: neither can be cancelled)."""

    async def write_pieces(
        self, key: SegmentKey, pieces: Sequence[memoryview], seal: Seal | None = None
    ) -> None:
        async def slow() -> None:
            assert seal is not None
            await anyio.to_thread.run_sync(time.sleep, 1.0)
            await seal()

        await super().write_pieces(key, pieces, None if seal is None else slow)


@pytest.mark.parametrize("kind", CANCELS)
async def test_an_append_cancelled_while_its_head_is_sealed_is_committed_whole(
    redis_server: RedisServer, kind: str
) -> None:
    """A 32 MiB turn's body goes out while its head is sealed, and the append is cancelled
    during the seal (each way users cancel). The seal is awaited, never abandoned, and the
    write under way is finished: the turn is committed whole, this replica's history holds
    it (the cancellation reaches the caller after it; an anyio scope sees the append
    complete), another replica loads the same, and the conversation goes on."""
    big, first, third = _turn(6, tokens=2048), _turn(7), _turn(8)
    prefix = new_prefix()
    tier = _SlowSeal(redis_server.url, 512 * MiB, prefix=prefix)
    async with TieredKVCache([tier]) as cache:
        await cache.append("chat", first, answer_tokens=1)
        completed, _ = await cancellable(
            kind, 0.5, lambda: cache.append("chat", big, answer_tokens=1)
        )
        assert not completed or kind == "anyio"
        with anyio.fail_after(60):
            out = await cache.load("chat")
            expected = {n: torch.cat([first[n], big[n]]) for n in first}
            assert all(torch.equal(out[n], expected[n]) for n in first)
            assert cache.stats().cancelled == 0
            await cache.append("chat", third, answer_tokens=1)
            out = await cache.load("chat")
            await cache.flush()
    whole = {n: torch.cat([expected[n], third[n]]) for n in first}
    assert all(torch.equal(out[n], whole[n]) for n in first)
    async with TieredKVCache([RedisTier(redis_server.url, 512 * MiB, prefix=prefix)]) as b:
        other = await b.load("chat")
    assert all(torch.equal(other[n], whole[n]) for n in first)
