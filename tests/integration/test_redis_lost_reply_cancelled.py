"""A Redis commit whose reply is lost, and the write cancelled while it asks the server
whether the commit was made.

The write's own deadline has passed (0.5 s) and it is asking the server again (for up to
2 s) when the caller cuts it short, after 1 s, the four ways a caller does: an anyio scope,
asyncio's ``timeout``, ``wait_for`` and ``task.cancel()``. The cancellation must end the
write at once (not be swallowed by the asking loop's own timeouts), leave the tier as if
the write had not been made locally, and the tier must learn the outcome afterwards: the
commit was made, another replica reads it, and the same write then succeeds at once.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.test_redis_lost_reply import (
    SECRET,
    TIMEOUT,
    _body,
    _tier,
    arm,
    check_made_and_learned,
    relaying,
)
from tests.integration.test_redis_pipelined import _cut_short
from tests.redis_server import RedisServer, new_prefix, redis_server
from tests.segments import SegmentFactory, read_back

__all__ = ["SECRET", "redis_server"]  # fixtures used below


@pytest.mark.parametrize("kind", ["anyio", "asyncio.timeout", "wait_for", "task.cancel"])
async def test_a_write_cancelled_while_it_asks_whether_its_commit_was_made(
    redis_server: RedisServer, seg: SegmentFactory, kind: str
) -> None:
    s = seg(tokens=64, seed=5)
    prefix = new_prefix()
    async with (
        relaying(redis_server.port) as relay,
        _tier(relay.port, prefix, "A") as a,
        _tier(redis_server.port, prefix, "B") as b,
    ):
        await arm(relay, a, seg, s)
        began = time.monotonic()
        # cut short 1 s in: past the write's 0.5 s deadline, inside its 2 s of asking
        await _cut_short(kind, lambda: a.write(s.key, s.view))
        assert time.monotonic() - began < 1.0 + TIMEOUT + 0.5, "the cancellation waited"
        await relay.heal()
        await check_made_and_learned(a, b, s)  # (it was made)
        assert _body(await read_back(a, s)) == _body(s.data)
