"""A Redis tier's read path: a conversation's committed segments, fetched pipelined and
verified before they are served.

The parts are fetched in batches of ``read_batch`` values, the next batch in flight while
the previous one is copied (in a worker thread) into the caller's buffers; each segment's
bytes must start with the header bytes its committed entry records and pass its CRC and
body hash (and, with a secret, both MACs: :func:`~.redis_manifest.verify_segment_read`).
A value gone (the server evicted it, or restarted without persistence) or a failed check
takes the conversation out of the manifest, in the version that was read, never a later
one, and raises :class:`~tieredkv.errors.CorruptSegmentError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from ..errors import CorruptSegmentError
from ._redis_client import Client, RedisError
from ._redis_state import Replica
from .base import Consumer, SegmentKey, Spans, check_read, deliver
from .redis_manifest import Entry, verify_segment_read

__all__ = ["Reads"]


class Reads(Replica):
    """``read`` (the one vectored read of the Tier protocol) for a Redis tier."""

    async def read(
        self,
        keys: Sequence[SegmentKey],
        into: Sequence[memoryview] | None = None,
        *,
        spans: Sequence[Spans] | None = None,
        consume: Consumer | None = None,
        order: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Read several committed segments, in order, fetching their values pipelined (see
        :meth:`~tieredkv.backends.base.Tier.read`; each segment's spans are handed to
        ``consume`` once all of it is in and verified).

        Stops at the first segment that fails; the ones before it are complete. A segment
        with a value gone, or that fails its checks, takes its conversation out of the
        manifest and is raised as :class:`~tieredkv.errors.CorruptSegmentError`.

        :raises TierIOError: the server failed or went away
        """
        client = self._check_open()
        entries: list[Entry] = []
        for key in keys:
            entry = self._index.get(key)
            if entry is None:
                raise KeyError(key)
            entries.append(entry)
        check_read([entry.length for entry in entries], into, spans, order)
        if not entries:
            return
        if into is None:
            into = [memoryview(bytearray(entry.length)) for entry in entries]
        items = list(zip(keys, into, strict=True))
        # (item, redis key, start, end) for every value, in order
        plan = [
            (i, part, p * entry.value_size, min(entry.length, (p + 1) * entry.value_size))
            for i, ((key, _), entry) in enumerate(zip(items, entries, strict=True))
            for p, part in enumerate(self._parts(key, entry))
        ]
        batches = [plan[at : at + self._batch] for at in range(0, len(plan), self._batch)]
        check = _Check(
            outs=[out for _, out in items],
            keys=list(keys),
            entries=entries,
            incarnations=[self._incarnation(key) for key in keys],
            key=self._key,
            url=self.url,
        )
        failure: tuple[int, str, bool] | None = None
        loop = asyncio.get_running_loop()
        ahead: asyncio.Task[list[bytes | None]] | None = None
        try:
            values = await self._fetch(client, batches[0])
            for b, batch in enumerate(batches):
                if b + 1 < len(batches):  # the next batch in flight while this one is copied
                    ahead = loop.create_task(self._fetch(client, batches[b + 1]))
                failure = await anyio.to_thread.run_sync(check.absorb, batch, values)
                if failure is not None:
                    break
                values, ahead = (await ahead if ahead is not None else []), None
        except (RedisError, OSError) as exc:
            raise self._io_error(f"read segment {keys[check.done][1]}", exc) from exc
        finally:
            with anyio.CancelScope(shield=True):
                await _reap(ahead)
        for out in check.outs[: check.done]:
            self._counters.reads += 1
            self._counters.bytes_read += len(out)
        if consume is not None and check.done:
            delivered = check.outs[: check.done]

            def hand_over() -> None:
                for i, out in enumerate(delivered):
                    deliver(consume, spans, i, out)

            await anyio.to_thread.run_sync(hand_over)
        if failure is not None:
            bad, detail, missing = failure
            await self._take_out(keys[bad], missing)
            raise CorruptSegmentError(f"{self._where(keys[bad][0])}", detail)

    def _incarnation(self, key: SegmentKey) -> bytes | None:
        """The manifest id segment ``key`` was committed in (with a secret: it is in the
        segment's authenticated header)."""
        mid = self._origin.get(key)
        return None if mid is None or self._key is None else bytes.fromhex(mid)

    async def _fetch(
        self, client: Client, batch: list[tuple[int, str, int, int]]
    ) -> list[bytes | None]:
        async with client.pipeline(transaction=False) as pipe:
            for _, part, _, _ in batch:
                pipe.get(part)
            values: list[bytes | None] = await pipe.execute()
        return values

    async def _take_out(self, key: SegmentKey, missing: bool) -> None:
        """Count a damaged segment and take every conversation that lists it (its owner's,
        and the forks that inherit it) out of service, here and (where the manifest is
        still the version that was read) in the server."""
        self._counters.corrupt += 1
        if missing:
            self._counters.missing += 1
        for session in sorted(self._holders.get(key, set()) | {key[0]}):
            known = self._known.get(session)
            self._drop_view(session, keep_writer=True)
            if known is None:
                continue
            with anyio.CancelScope(shield=True):
                # if the server is failing too, the parts are checked again on every read
                with contextlib.suppress(RedisError, OSError), anyio.fail_after(self._timeout):
                    await self._conn.scripts["drop"](
                        keys=[self._manifest(session)],
                        args=[
                            "damaged",
                            known.v,
                            known.id,
                            self._base(session),
                            secrets.token_hex(16),
                        ],
                    )
                    w = self._writers.get(session)
                    if w is not None:  # the history it knew is gone by this tier's own
                        w.history = False  # hand: its next commit starts one afresh


async def _reap(task: asyncio.Task[Any] | None) -> None:
    """Cancel a fetch started ahead and wait for it; its outcome no longer matters."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: never "Task exception was never retrieved"


@dataclass
class _Check:
    """Copies fetched values into the output buffers (in a worker thread) and verifies
    each segment whose last value arrived."""

    outs: list[memoryview]
    keys: list[SegmentKey]
    entries: list[Entry]
    incarnations: list[bytes | None]
    key: bytes | None
    url: str
    done: int = 0

    def absorb(
        self, batch: list[tuple[int, str, int, int]], values: list[bytes | None]
    ) -> tuple[int, str, bool] | None:
        """Returns the failure (item, detail, value missing), or ``None``."""
        for (i, part, start, end), value in zip(batch, values, strict=True):
            if value is None:
                return i, f"value {part} is gone (evicted or lost by the server)", True
            if len(value) != end - start:
                return i, f"value {part} is {len(value)} bytes, expected {end - start}", False
            out = self.outs[i]
            out[start:end] = value
            if end < len(out):
                continue
            try:
                verify_segment_read(
                    out,
                    self.keys[i],
                    self.entries[i],
                    self.incarnations[i],
                    self.key,
                    f"{self.url} {part}",
                )
            except CorruptSegmentError as exc:
                return i, exc.detail, False
            self.done = i + 1
        return None
