"""Redis / Valkey: a capacity tier that several replicas share, as one replicated log per
conversation.

Needs the optional extra ``tieredkv[redis]`` (the maintained asyncio client,
``redis.asyncio``); Valkey speaks the same protocol. Layout under the key ``prefix``, for a
conversation whose key hashes (BLAKE2b-128, hex) to ``H``::

    prefix:{H}:m                 the conversation's manifest (a hash: see redis_manifest)
    prefix:{H}:<seq>:<nonce>:<i> part i of segment seq (values of ``value_size`` bytes)

The hash tag ``{H}`` keeps all of a conversation's keys in one Redis Cluster slot, so the
Lua steps run on one node. Hashing the session key keeps any key (``}``, NUL, 10 kB of
text) out of the key syntax; the key itself is in the manifest and in every segment's
header. The nonce is new for every segment written, so parts of two writes never mix, and
a part is visible only through the committed manifest entry that names it.

**Commit.** The parts are written with a short expiry (``SET NX PX``, pipelined), then one
Lua step (:data:`~._redis_scripts.COMMIT`) commits the segment if, all at once: the
writer's fencing token is the manifest's, the manifest is the version (incarnation id and
version number) the writer last committed or read and ``seq`` is its next segment, no
takeover delay is pending, every part is still there, and the server's clock has not
passed the write's deadline. The deadline is the time, in the server's clock, after which
the writer stops waiting: the writer learns the server's clock from every reply (a lower
bound of it), so a request the server runs only after a stall or a lost connection is
refused by the server itself and can never commit behind the writer's back. A retried
commit of the same segment (same nonce) is recognized and succeeds once. A refused
commit unlinks its own parts; a writer that dies half-way leaves parts that expire after
``part_ttl``.

**Writers.** One writer per conversation: the holder of the manifest's fencing token. A
replica that loads a conversation takes it over (:meth:`RedisTier.refresh` with ``take``,
in the same Lua step that reads the manifest); one that appends to a conversation it holds
no token for gets one only if the history is the one it knows (a replica that never loaded
a conversation cannot write into it). A takeover of a lease that is still live delays the
new writer's first commit until that lease has ended, so a replica holding a live lease
knows, by its own clock, that no other replica can have committed since: that is what
lets it serve its local copy while the server cannot be reached
(:meth:`RedisTier.may_serve_local`).

**Reads.** The parts are fetched (pipelined, the next batch in flight while the previous
one is copied); each segment's bytes must start with the header bytes its committed entry
records, and pass its CRC and body hash (:func:`tieredkv.payload.verify_segment`). A
missing part (the server evicted it under ``maxmemory``, or restarted without persistence)
or a failed check takes the conversation out of the manifest (in the version that was
read, never a later one) and raises :class:`~tieredkv.errors.CorruptSegmentError`.

**Forks.** A fork's manifest references the segments it inherits (see
:mod:`.redis_manifest`): the commit of its first turn records the fork in each referenced
segment's reference set and checks that the segment's values are all there, in the same
Lua step, under the fork's fencing token; a drop keeps a segment whose reference set is
not empty, and the last fork to leave it deletes it. A read of a fork reads the owner's
values and checks them against the referenced entry. Forks need one server (the
references cross slots): :attr:`RedisTier.forks` is false for a Cluster. The cache's
retirement markers stay in this tier's index (the reference sets keep a dropped parent's
segments on the server).

**Authentication.** With a ``secret`` every segment is written with a keyed MAC of its
header and body and the manifest's incarnation id, and the manifest with a keyed MAC of
its whole history (session, id, version, every entry), all checked on every read: a
client of the server without the secret can neither forge nor alter a value or an entry,
nor remove an entry (:mod:`tieredkv.payload` holds the MAC code the SSD tier uses too).

**Deletion.** :meth:`RedisTier.delete` only stops this cache counting a segment; a
conversation leaves the server for everyone only through :meth:`RedisTier.discard` by its
writer (the cache's ``drop``) or a damaged read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any

import anyio

from .._fork import check_process
from ..errors import HistoryConflictError, InvalidArgumentError
from ..payload import ALIGN, SegmentHeader, derive_key
from ._redis_client import Client, Connection, RedisError, driver_options, text
from ._redis_client import fields as manifest_fields
from ._redis_commit import Commits
from ._redis_read import Reads
from .base import SegmentKey, TierStats
from .redis_manifest import Damaged, conversation_tag, parse
from .shared import SharedTier

__all__ = ["RedisTier", "conversation_tag", "driver_options"]

_log = logging.getLogger("tieredkv.redis")

_MIN_VALUE = 64 << 10


class RedisTier(Reads, Commits, SharedTier):
    """Segments in Redis or Valkey, shared by every cache configured with the same server
    and ``prefix``.

    :param server: a ``redis://``, ``rediss://`` (TLS) or ``unix://`` URL (user and password
        may be in it), or a ready ``redis.asyncio`` client (``Redis`` or ``RedisCluster``),
        which the tier uses as is and does not close
    :param capacity: the byte budget for this tier's segments, as this cache counts them
        (what it wrote, recovered at open or discovered through :meth:`refresh`)
    :param name: the tier's name in metadata and events
    :param prefix: the first part of every key; deployments sharing a server use different
        prefixes (or share conversations, with the same models)
    :param value_size: bytes per Redis value; a segment is split into values of this size
        (a multiple of 4096, at least 64 KiB)
    :param timeout: seconds to connect, to wait for a reply, and for a segment's write to
        commit (after that the server refuses to commit it)
    :param max_connections: connections in the pool (a caller waits ``timeout`` for one)
    :param lease_ttl: seconds a writer lease lasts after the replica's last commit, load or
        append check. While it lasts the replica may serve its copy when the server cannot
        be reached, and a replica that takes the conversation over commits only after it
        has ended, or once the replica that held it is gone (see ``liveness``)
    :param liveness: seconds a replica counts as alive after its last heartbeat (it beats
        every third of this). A replica serves its own copy through an outage only while
        its last heartbeat may still be alive, so a takeover of a replica that is gone
        waits about this long, not the rest of its lease: the longest a conversation
        stalls when its replica dies (at most ``lease_ttl``). After the server restarted
        empty, a conversation's first commit waits until it has been up this long; on a
        server that evicts keys no replica serves its own copy through an outage (see
        docs/how-to/share-kv-with-redis.md)
    :param part_ttl: seconds a written but uncommitted part lives (a writer that dies
        half-way leaves nothing longer than this)
    :param read_batch: values fetched per round trip while reading
    :param recover: whether :meth:`open` returns every conversation under ``prefix`` (as a
        persistent tier does); ``False`` leaves them to :meth:`refresh`
    :param owner: this replica's id in leases (default: a random one per tier)
    :param secret: authenticate every value and manifest with this secret (at least 16
        bytes, the same on every replica; keep it out of the server): a client of the
        server without it can neither forge, alter nor shorten a history; replicas
        with one mark the prefix (``<prefix>:auth``), and a replica without one is
        refused on a marked prefix, and commits only to a prefix unmarked for three
        times ``liveness`` (after an empty restart of the server, its commits wait that
        long: see the how-to on sharing KV through Redis)
    :param client_options: passed to the client's connection pool (``password``,
        ``username``, ``ssl_ca_certs``, ``ssl_certfile``, ...), with a URL only

    A tier built from a URL retries a command on a dropped connection (up to 3 times,
    50 ms to 1 s apart), as after a server restart: every command it sends is idempotent.
    A client passed in keeps its own retry settings.

    The class composes its concerns: the connection (:mod:`._redis_client`), the writer
    leases (:mod:`._redis_lease`), the commit path (:mod:`._redis_commit`) and the read
    path (:mod:`._redis_read`), over the view of the server they share
    (:mod:`._redis_state`); this module keeps the tier's lifecycle and its space.
    """

    kind = "redis"

    def __init__(
        self,
        server: str | Client,
        capacity: int,
        *,
        name: str = "redis",
        prefix: str = "tieredkv",
        value_size: int = 4 << 20,
        timeout: float = 10.0,
        max_connections: int = 32,
        lease_ttl: float = 30.0,
        liveness: float = 3.0,
        part_ttl: float = 300.0,
        read_batch: int = 4,
        recover: bool = True,
        owner: str | None = None,
        secret: bytes | None = None,
        **client_options: Any,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tier needs a non-empty name, not {name!r}")
        if capacity <= 0:
            raise ValueError(f"tier {name!r}: capacity must be positive, not {capacity}")
        if value_size < _MIN_VALUE or value_size % ALIGN:
            raise ValueError(
                f"tier {name!r}: value_size must be a multiple of {ALIGN} of at least "
                f"{_MIN_VALUE}, not {value_size}"
            )
        if not prefix or any(c in prefix for c in "{}*?[]\\"):
            raise ValueError(
                f"tier {name!r}: prefix {prefix!r} must be non-empty and free of {{}}*?[]\\"
            )
        if timeout <= 0 or lease_ttl <= 0 or part_ttl <= 0 or read_batch <= 0 or liveness <= 0:
            raise ValueError(
                f"tier {name!r}: timeout, lease_ttl, liveness, part_ttl and read_batch must be "
                f"positive"
            )
        conn = Connection(
            server,
            name=name,
            timeout=timeout,
            max_connections=max_connections,
            client_options=client_options,
        )
        super().__init__(
            conn,
            name=name,
            prefix=prefix,
            value_size=value_size,
            owner=owner or uuid.uuid4().hex,
            key=None if secret is None else derive_key(secret),
            capacity=capacity,
            lease_ttl=lease_ttl,
            liveness=min(liveness, lease_ttl),
            part_ttl=part_ttl,
            read_batch=read_batch,
            recover=recover,
        )
        self._heart: asyncio.Task[None] | None = None
        """The heartbeat (:meth:`beat_forever`) while open."""
        self._stop_heart: anyio.Event | None = None

    # -- properties ----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    @property
    def persistent(self) -> bool:
        """Segments outlive this process (they live in the server)."""
        return True

    @property
    def forks(self) -> bool:
        """Whether the tier takes forks: on one server, not a Cluster (a fork's references
        name keys in its parent's slot, which its commit step updates)."""
        return not self._conn.cluster

    @property
    def authenticated(self) -> bool:
        """Whether values and manifests are written and checked with a MAC."""
        return self._key is not None

    @property
    def missing(self) -> int:
        """Segments found with a value gone (server eviction or restart), never served."""
        return self._counters.missing

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self) -> list[SegmentHeader]:
        check_process(f"tier {self.name!r}", self._conn.opened_in)
        if self._conn.client is not None:
            return []
        await self._conn.open()
        try:
            await self._check_secret()
            if self._key is None and not self._conn.cluster:
                await self._wait_settled()
            elif self._key is None and await self._wait_for_marks():
                await self._check_secret()  # (marked again meanwhile: refused)
            await self.beat()
            self._stop_heart = stop = anyio.Event()
            self._heart = asyncio.get_running_loop().create_task(self.beat_forever(stop))
            self._heart.add_done_callback(self._heart_ended)
            return await self._scan() if self._recover else []
        except BaseException:
            await self.aclose()
            raise

    def _heart_ended(self, task: asyncio.Task[None]) -> None:
        """Log a heartbeat task that ended with an exception (a bug: a failed heartbeat is
        not one), at once rather than when the task is collected: without heartbeats this
        replica's liveness runs out, and loads of what it writes count as misses."""
        if not task.cancelled() and task.exception() is not None:
            _log.error(
                "%s: the heartbeat stopped; loads of the conversations this replica writes "
                "will count as misses once its liveness runs out (reopen the tier)",
                self.name,
                exc_info=task.exception(),
            )

    async def _check_secret(self) -> None:
        """With a secret, mark the prefix authenticated (``<prefix>:auth``, a value derived
        from the secret); refuse a prefix marked with another secret, or (without a secret
        here) marked at all: a replica without the fleet's secret would write what the
        others refuse to serve, denying them the conversations it touches.

        :raises InvalidArgumentError: the secret (or its absence) is not the prefix's
        """
        client = self._check_open()
        marker = self._marker
        mine = None if self._key is None else self._mark
        try:
            if mine is not None:
                await self._put_mark(client)
            found = await client.get(marker)
        except (RedisError, OSError) as exc:
            raise self._io_error("check the prefix's secret", exc) from exc
        if found is None and mine is None:
            return
        if mine is None:
            raise InvalidArgumentError(
                f"tier {self.name!r}: prefix {self.prefix!r} on {self.url} is authenticated "
                f"(its replicas use secret=); give this replica the same secret"
            )
        if found is not None and text(found) != mine:
            raise InvalidArgumentError(
                f"tier {self.name!r}: prefix {self.prefix!r} on {self.url} is authenticated "
                f"with another secret; give every replica of the prefix the same secret"
            )

    async def _wait_for_marks(self) -> bool:
        """A server that restarted empty lost the prefix's mark; the replicas with the
        secret put it back with their next heartbeat (every third of ``liveness``) or
        commit. On a server up for less than the settling period (thrice ``liveness``),
        wait until it has been up that long (whether it waited), so that a tier without
        the secret does not open on an authenticated prefix in the moments after such a
        restart (its writes would be refused by every other replica, as damaged).

        :raises TierIOError: the server cannot be reached
        """
        try:
            with anyio.fail_after(self._timeout):
                info = await self._check_open().info("server")
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._io_error("check the prefix's secret", exc) from exc
        up = info.get("uptime_in_seconds") if isinstance(info, dict) else None
        settle = self._settle_ms / 1000
        if not isinstance(up, int | float) or up >= settle:
            return False
        await anyio.sleep(settle - up)  # (up is rounded down: long enough)
        return True

    async def _wait_settled(self) -> None:
        """Without a secret, on one server: wait until the prefix has been unmarked for the
        settling period (thrice ``liveness``; the ``SETTLE`` step), so that this replica
        neither opens on a prefix whose mark a server that restarted empty forgot a moment
        ago nor has its first commits wait (see the ``COMMIT`` step).

        :raises InvalidArgumentError: the prefix is marked (authenticated)
        :raises TierIOError: the server cannot be reached
        """
        while True:
            reply = await self._conn.call(
                "settle", [], [self._marker, self._settle_ms], "check the prefix's secret"
            )
            if int(reply[0]) == 0:
                return
            if int(reply[0]) == 1:
                await self._check_secret()  # (raises, unless the mark went meanwhile)
                continue
            await anyio.sleep(max(1, int(reply[2])) / 1000)

    async def _scan(self) -> list[SegmentHeader]:
        client = self._check_open()
        headers: list[SegmentHeader] = []
        try:
            async for name in client.scan_iter(match=f"{self.prefix}:{{*}}:m", count=1000):
                fields = manifest_fields(await client.hgetall(name))
                try:
                    m = parse(fields, None, self._key, f"{self.url} {text(name)}", self.prefix)
                except Damaged as exc:
                    self._counters.corrupt += 1
                    _log.warning("%s: manifest %s is damaged: %s", self.name, text(name), exc)
                    continue
                if m is None or self._manifest(m.session) != text(name):
                    continue
                self._absorb(m, inherited=False)  # (its parent's: through the parent's)
                self._adopted[m.session] = m  # (the cache's index starts from it)
                headers.extend(m.headers)
        except (RedisError, OSError) as exc:
            raise self._io_error("list conversations", exc) from exc
        return headers

    async def aclose(self) -> None:
        if self._conn.client is None:
            return
        manifests = [self._manifest(session) for session in self._writers]
        if self._conn.opened_in != os.getpid():  # a forked child's copy: its heartbeat
            self._heart = None  # task and leases are the parent's
        if self._heart is not None:
            assert self._stop_heart is not None
            self._stop_heart.set()  # (it ends after the heartbeat under way, if any)
            await asyncio.wait([self._heart], timeout=self._timeout + 1)
            if not self._heart.done():  # pragma: no cover - a heartbeat that did not end
                self._heart.cancel()
            self._heart = None
        self._index.clear()
        self._markers.clear()
        self._holders.clear()
        self._origin.clear()
        self._committed.clear()
        self._reserved.clear()
        self._writers.clear()
        self._known.clear()
        self._adopted.clear()
        self._attempts.clear()
        self._stale.clear()
        self._used = 0
        # hand the conversations this replica wrote over at once, not after lease_ttl
        await self._conn.close(manifests, self.owner)

    async def __aenter__(self) -> RedisTier:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- space ---------------------------------------------------------------------------
    def reserve(self, key: SegmentKey, length: int) -> bool:
        self._check_open()
        if key in self._reserved or key in self._markers or key in self._committed:
            state = (
                "reserves"
                if key in self._reserved
                else "holds the retirement marker of"
                if key in self._markers
                else "holds (committed by this replica)"
            )
            raise ValueError(
                f"tier {self.name!r} already {state} segment {key[1]} of {key[0]!r:.80}"
            )
        if key in self._index:
            # a segment this replica read, not committed: of a history it did not take in
            # under the key (another replica's, listed by a fork it knows, or one it let
            # go of): the server would refuse it
            raise HistoryConflictError(
                self.name,
                key[0],
                f"turn {key[1]} of another history under this key is stored in the shared "
                f"tier (a fork lists it)",
            )
        if length % ALIGN:
            raise ValueError(f"segment length {length} is not a multiple of {ALIGN}")
        if self._used + length > self._capacity:
            return False
        self._reserved[key] = length
        self._used += length
        return True

    def release(self, key: SegmentKey) -> None:
        length = self._reserved.pop(key, None)
        if length is not None:
            self._used -= length

    async def delete(self, key: SegmentKey) -> None:
        """Stop counting a segment in this cache. Never removes it from the server: other
        replicas may be reading it (see :meth:`discard`)."""
        self._check_open()
        self._unhold(key)
        length = self._markers.pop(key, None)
        if length is not None:
            self._used -= length

    def contains(self, key: SegmentKey) -> bool:
        return key in self._index or key in self._markers

    def length(self, key: SegmentKey) -> int:
        marker = self._markers.get(key)
        return self._index[key].length if marker is None else marker

    def stats(self) -> TierStats:
        c = self._counters
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity=self._capacity,
            used=self._used,
            segments=len(self._index),
            bytes_read=c.bytes_read,
            bytes_written=c.bytes_written,
            reads=c.reads,
            writes=c.writes,
            corrupt=c.corrupt,
            reachable=self._conn.client is not None and self._beating,
            notes=(
                f"server {self.url}, prefix {self.prefix!r}, values of {self.value_size:,} bytes"
                + (", authenticated" if self._key is not None else ""),
                f"{c.missing} segment(s) found with a value gone (evicted or lost by the "
                f"server), {c.refused} stale write(s) refused",
                f"{c.conflicts} write(s) refused for another history, {c.lost} history(ies) "
                f"found lost by the server",
            ),
        )
