"""Redis / Valkey: a capacity tier that several replicas share, as one replicated log per
conversation.

Needs the optional extra ``tieredkv[redis]`` (the maintained asyncio client,
``redis.asyncio``); Valkey speaks the same protocol. Layout under the key ``prefix``, for a
conversation whose key hashes (BLAKE2b-128, hex) to ``H``::

    prefix:{H}:m                 the conversation's manifest (a hash: see _redis_manifest)
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
import contextlib
import functools
import hashlib
import logging
import re
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from .._version import __version__
from ..errors import (
    ClosedError,
    CommitDelayedError,
    CorruptSegmentError,
    HistoryConflictError,
    LeaseHeldError,
    StaleWriterError,
    TierIOError,
)
from ..payload import (
    ALIGN,
    PREFIX,
    SegmentHeader,
    authenticated_head,
    derive_key,
    parse_header,
)
from . import _redis_scripts as lua
from ._redis_manifest import (
    Damaged,
    Entry,
    Manifest,
    encode_entry,
    parse,
    sign,
    verify_segment_read,
)
from .base import Consumer, SegmentKey, Spans, TierStats, check_read, deliver
from .shared import SharedState, SharedTier
from .shared import plain_header as plain

try:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError, RedisError
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("RedisTier needs the redis client: pip install 'tieredkv[redis]'") from _exc

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ["RedisTier", "conversation_tag", "driver_options"]

_log = logging.getLogger("tieredkv.redis")

_MIN_VALUE = 64 << 10
_LEASE_MARGIN = 0.9
"""A replica counts its lease as ending after this share of ``lease_ttl`` from the moment
it sent the request that set it (the server counts from when it ran it, later): a margin
for the two clocks' rates."""
_RESOLVE_TIMEOUT = 2.0
"""At most this long (and at most ``timeout``) to learn whether a commit whose reply was lost
was made."""


@dataclass
class _Writer:
    token: int
    lease_until: float
    """By this process's monotonic clock: until then no other replica can commit."""


@dataclass
class _Attempt:
    """A segment written whose commit's outcome this tier has not learned yet."""

    entry: Entry
    mid: str
    header: SegmentHeader


@dataclass
class _Counters:
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    corrupt: int = 0
    missing: int = 0
    refused: int = 0
    conflicts: int = 0
    lost: int = 0


def conversation_tag(session: str) -> str:
    """The hash tag of a conversation's keys: BLAKE2b-128 of its key, in hex."""
    return hashlib.blake2b(session.encode("utf-8"), digest_size=16).hexdigest()


def _redacted(url: str) -> str:
    """``url`` without its password."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _int(value: object, default: int = -1) -> int:
    try:
        return int(value)  # type: ignore[call-overload,no-any-return]
    except (TypeError, ValueError):
        return default


def _fields(reply: Sequence[Any] | Mapping[Any, Any]) -> dict[bytes, bytes]:
    """A manifest's fields, from ``HGETALL`` (a dict) or a Lua script (a flat list)."""
    pairs = (
        reply.items()
        if isinstance(reply, Mapping)
        else ((reply[i], reply[i + 1]) for i in range(0, len(reply) - 1, 2))
    )
    return {k: v for k, v in pairs if isinstance(k, bytes) and isinstance(v, bytes)}


class RedisTier(SharedTier):
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
        has ended
    :param part_ttl: seconds a written but uncommitted part lives (a writer that dies
        half-way leaves nothing longer than this)
    :param read_batch: values fetched per round trip while reading
    :param recover: whether :meth:`open` returns every conversation under ``prefix`` (as a
        persistent tier does); ``False`` leaves them to :meth:`refresh`
    :param owner: this replica's id in leases (default: a random one per tier)
    :param secret: authenticate every value and manifest with this secret (at least 16
        bytes, the same on every replica; keep it out of the server): a client of the
        server without it can neither forge, alter nor shorten a history
    :param client_options: passed to the client's connection pool (``password``,
        ``username``, ``ssl_ca_certs``, ``ssl_certfile``, ...), with a URL only

    A tier built from a URL retries a command on a dropped connection (up to 3 times,
    50 ms to 1 s apart), as after a server restart: every command it sends is idempotent.
    A client passed in keeps its own retry settings.
    """

    kind = "redis"

    def __init__(
        self,
        server: str | aioredis.Redis | aioredis.RedisCluster,
        capacity: int,
        *,
        name: str = "redis",
        prefix: str = "tieredkv",
        value_size: int = 4 << 20,
        timeout: float = 10.0,
        max_connections: int = 32,
        lease_ttl: float = 30.0,
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
        if timeout <= 0 or lease_ttl <= 0 or part_ttl <= 0 or read_batch <= 0:
            raise ValueError(
                f"tier {name!r}: timeout, lease_ttl, part_ttl and read_batch must be positive"
            )
        if isinstance(server, str):
            if not server.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(
                    f"tier {name!r}: {_redacted(server)!r} is not a redis://, rediss:// or "
                    f"unix:// URL"
                )
            self.url = _redacted(server)
        elif client_options:
            raise ValueError(
                f"tier {name!r}: client options {sorted(client_options)} apply to a URL; "
                f"configure the client you pass instead"
            )
        else:
            self.url = repr(server)
        self.name = name
        self.prefix = prefix
        self.value_size = value_size
        self.owner = owner or uuid.uuid4().hex
        self._key = None if secret is None else derive_key(secret)
        self._server = server
        self._client_options = client_options
        self._capacity = capacity
        self._timeout = timeout
        self._max_connections = max_connections
        self._lease_ttl = lease_ttl
        self._lease_ms = round(lease_ttl * 1000)
        self._part_ms = round(part_ttl * 1000)
        self._batch = read_batch
        self._recover = recover
        self._client: aioredis.Redis | aioredis.RedisCluster | None = None
        self._scripts: dict[str, AsyncScript] = {}
        self._index: dict[SegmentKey, Entry] = {}
        """The committed segments this cache counts (and may read)."""
        self._reserved: dict[SegmentKey, int] = {}
        self._known: dict[str, Manifest] = {}
        """Per conversation, the manifest as this tier last committed or read it."""
        self._writers: dict[str, _Writer] = {}
        self._attempts: dict[SegmentKey, _Attempt] = {}
        self._stale: set[str] = set()
        """Conversations whose manifest must be read again before this tier commits."""
        self._skew = 0.0
        """Server clock minus this process's monotonic clock, ms: a lower bound."""
        self._used = 0
        self._counters = _Counters()

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
    def authenticated(self) -> bool:
        """Whether values and manifests are written and checked with a MAC."""
        return self._key is not None

    @property
    def missing(self) -> int:
        """Segments found with a value gone (server eviction or restart), never served."""
        return self._counters.missing

    def _check_open(self) -> aioredis.Redis | aioredis.RedisCluster:
        if self._client is None:
            raise ClosedError(f"tier {self.name!r}")
        return self._client

    def _base(self, session: str) -> str:
        return f"{self.prefix}:{{{conversation_tag(session)}}}"

    def _parts(self, key: SegmentKey, entry: Entry) -> list[str]:
        base = f"{self._base(key[0])}:{key[1]}:{entry.nonce}"
        return [f"{base}:{i}" for i in range(entry.parts)]

    def _io_error(self, action: str, exc: BaseException) -> TierIOError:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return TierIOError(self.name, f"{action} on {self.url}", detail)

    def _clock(self, server_ms: object) -> None:
        """Learn the server's clock from a reply received just now."""
        ms = _int(server_ms, 0)
        if ms > 0:
            self._skew = ms - time.monotonic() * 1000

    def _where(self, session: str) -> str:
        return f"{self.url} {self._base(session)}"

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self) -> list[SegmentHeader]:
        if self._client is not None:
            return []
        if isinstance(self._server, str):
            # the client looks its version up in package metadata (file I/O) for each
            # connection unless told: once, in a worker thread
            options = {**await anyio.to_thread.run_sync(driver_options), **self._client_options}
            options.setdefault(
                "retry",
                Retry(ExponentialBackoff(cap=1.0, base=0.05), 3, (RedisConnectionError,)),
            )
            pool = aioredis.BlockingConnectionPool.from_url(
                self._server,
                max_connections=self._max_connections,
                timeout=self._timeout,
                socket_timeout=self._timeout,
                socket_connect_timeout=self._timeout,
                **options,
            )
            client: aioredis.Redis | aioredis.RedisCluster = aioredis.Redis.from_pool(pool)
        else:
            client = self._server
            if client.get_connection_kwargs().get("decode_responses"):
                raise ValueError(
                    f"tier {self.name!r}: the client decodes replies to str "
                    f"(decode_responses=True); pass one that returns bytes"
                )
        try:
            seconds, micros = await client.time()
            self._clock(int(seconds) * 1000 + int(micros) // 1000)
        except (RedisError, OSError) as exc:
            if isinstance(self._server, str):
                await client.aclose()
            raise TierIOError(
                self.name,
                f"connect to {self.url} (check that the server runs and is reachable, and "
                f"the URL, TLS settings and password)",
                f"{type(exc).__name__}: {exc}",
            ) from exc
        self._scripts = {
            name: client.register_script(getattr(lua, name.upper()))
            for name in ("take", "acquire", "ensure", "commit", "drop", "release")
        }
        self._client = client
        if not self._recover:
            return []
        try:
            return await self._scan()
        except BaseException:
            await self.aclose()
            raise

    async def _scan(self) -> list[SegmentHeader]:
        client = self._check_open()
        headers: list[SegmentHeader] = []
        try:
            async for name in client.scan_iter(match=f"{self.prefix}:{{*}}:m", count=1000):
                fields = _fields(await client.hgetall(name))
                try:
                    m = parse(fields, None, self._key, f"{self.url} {_text(name)}")
                except Damaged as exc:
                    self._counters.corrupt += 1
                    _log.warning("%s: manifest %s is damaged: %s", self.name, _text(name), exc)
                    continue
                if m is None or f"{self._base(m.session)}:m" != _text(name):
                    continue
                self._absorb(m)
                headers.extend(m.headers)
        except (RedisError, OSError) as exc:
            raise self._io_error("list conversations", exc) from exc
        return headers

    def _absorb(self, m: Manifest) -> None:
        """Make ``m`` what this tier knows of its conversation, and index its segments."""
        self._known[m.session] = m
        self._stale.discard(m.session)
        self._forget(m.session)
        for seq, entry in enumerate(m.entries):
            self._index[(m.session, seq)] = entry
            self._used += entry.length

    def _forget(self, session: str) -> None:
        """Drop this tier's index entries for ``session`` (not the server's data)."""
        for seq in [k[1] for k in self._index if k[0] == session]:
            self._used -= self._index.pop((session, seq)).length

    async def aclose(self) -> None:
        client = self._client
        if client is None:
            return
        self._client = None
        manifests = [f"{self._base(session)}:m" for session in self._writers]
        self._index.clear()
        self._reserved.clear()
        self._writers.clear()
        self._known.clear()
        self._attempts.clear()
        self._stale.clear()
        self._used = 0
        with anyio.CancelScope(shield=True):
            # hand the conversations this replica wrote over at once, not after lease_ttl
            with contextlib.suppress(RedisError, OSError), anyio.fail_after(self._timeout):
                for m in manifests:
                    await self._scripts["release"](keys=[m], args=[self.owner])
            if isinstance(self._server, str):
                await client.aclose()

    async def __aenter__(self) -> RedisTier:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- sharing -------------------------------------------------------------------------
    async def refresh(self, session: str, *, take: bool = False) -> SharedState:
        self._check_open()
        manifest = f"{self._base(session)}:m"
        writer = self._writers.get(session)
        sent = time.monotonic()
        token: int | None = None
        try:
            if take:
                reply = await self._scripts["take"](
                    keys=[manifest],
                    args=[self.owner, self._lease_ms, str(writer.token) if writer else ""],
                )
                self._clock(reply[1])
                fields = _fields(reply[2]) if int(reply[0]) != -1 else {}
                if int(reply[0]) == 0:
                    token = _int(reply[3])
            else:
                fields = _fields(await self._check_open().hgetall(manifest))
        except (RedisError, OSError) as exc:
            raise self._io_error("look up a conversation", exc) from exc
        return self._settle(session, fields, token, sent)

    def _settle(
        self, session: str, fields: dict[bytes, bytes], token: int | None, sent: float
    ) -> SharedState:
        """Compare the manifest just read with what this tier knew; index it."""
        prev = self._known.get(session)
        try:
            m = parse(fields, session, self._key, self._where(session)) if fields else None
        except Damaged as exc:
            self._counters.corrupt += 1
            _log.warning("%s: the manifest of %.80r is damaged: %s", self.name, session, exc)
            self._drop_view(session, keep_writer=True)  # (its writer may still discard it)
            return SharedState(status="damaged")
        if m is None:
            self._drop_view(session, keep_writer=True)
            if prev is not None and prev.n:
                self._counters.lost += 1
                return SharedState(status="lost")
            return SharedState(status="absent")
        self._reconcile(session, m)
        if token is not None and m.fence == token:
            self._writers[session] = _Writer(token, sent + _LEASE_MARGIN * self._lease_ttl)
        elif (w := self._writers.get(session)) is not None and m.fence != w.token:
            self._drop_writer(session, w)  # another replica took it over
        if prev is not None and prev.id == m.id and m.v < prev.v:
            # an older version than this tier committed or read: the server lost data
            self._counters.lost += 1
            self._known[session] = m
            self._forget(session)
            return SharedState(status="lost")
        self._absorb(m)
        same = prev is not None and (prev.id, prev.v) == (m.id, m.v)
        return SharedState(status="current" if same else "changed", headers=tuple(m.headers))

    def _reconcile(self, session: str, m: Manifest) -> None:
        """Settle the writes of ``session`` whose outcome was unknown, from its manifest."""
        for key in [k for k in self._attempts if k[0] == session]:
            attempt = self._attempts[key]
            if attempt.mid != m.id or key[1] < m.n:
                del self._attempts[key]  # committed (the entry names it) or never will be

    def _drop_view(self, session: str, *, keep_writer: bool = False) -> None:
        self._known.pop(session, None)
        self._stale.discard(session)
        self._forget(session)
        if not keep_writer:
            self._writers.pop(session, None)

    async def lookup(self, session: str) -> list[SegmentHeader]:
        state = await self.refresh(session)
        return list(state.headers)

    async def acquire(self, session: str, *, force: bool = False) -> int:
        self._check_open()
        prev = self._known.get(session)
        new_id = secrets.token_hex(16)
        sent = time.monotonic()
        try:
            reply = await self._scripts["acquire"](
                keys=[f"{self._base(session)}:m"],
                args=[
                    self.owner,
                    self._lease_ms,
                    "1" if force else "0",
                    session,
                    prev.id if prev else "",
                    str(prev.v) if prev else "",
                    new_id,
                ],
            )
        except (RedisError, OSError) as exc:
            raise self._io_error("take a conversation's lease", exc) from exc
        self._clock(reply[1])
        code = int(reply[0])
        if code == -1:
            raise LeaseHeldError(self.name, session, _text(reply[2]), max(0, _int(reply[3])) / 1000)
        if code == -2:
            self._counters.conflicts += 1
            raise HistoryConflictError(
                self.name,
                session,
                f"the shared tier holds version {_int(reply[3])} of its history "
                f"({_int(reply[4])} turn(s)), which this replica has not read",
            )
        token = _int(reply[2])
        if _int(reply[5]) == 0 and (prev is None or prev.n == 0):
            # an empty history (this call may have created it): known as a whole
            self._known[session] = Manifest(
                session=session, id=_text(reply[3]), v=_int(reply[4]), fence=token
            )
        self._writers[session] = _Writer(token, sent + _LEASE_MARGIN * self._lease_ttl)
        return token

    async def ensure_writer(self, session: str) -> int:
        """Make sure this replica may append to ``session``; return its fencing token.

        Takes the lease if this replica holds no token for ``session`` (a new conversation,
        or one whose lease has expired) and knows its current history; confirms a token it
        holds with the server and renews its lease.

        :raises StaleWriterError: another replica took the conversation over since
        :raises LeaseHeldError: this replica holds no token and another one's lease is live
        :raises HistoryConflictError: this replica holds no token and has not read the
            current history, or the server lost the history this replica committed
        :raises TierIOError: if the server cannot be reached
        """
        self._check_open()
        writer = self._writers.get(session)
        if writer is None:
            return await self.acquire(session)
        sent = time.monotonic()
        try:
            reply = await self._scripts["ensure"](
                keys=[f"{self._base(session)}:m"],
                args=[self.owner, self._lease_ms, writer.token],
            )
        except (RedisError, OSError) as exc:
            raise self._io_error("check a conversation's writer", exc) from exc
        self._clock(reply[1])
        code = int(reply[0])
        if code == -4:  # no manifest: the server restarted empty or evicted it
            self._drop_writer(session, writer)
            prev = self._known.get(session)
            if prev is None or not prev.n:
                self._known.pop(session, None)
                return await self.acquire(session)  # nothing was committed yet: start again
            raise self._lost(session)
        if code == -1:
            self._drop_writer(session, writer)
            self._counters.refused += 1
            raise StaleWriterError(self.name, session, writer.token, _int(reply[2]))
        writer.lease_until = sent + _LEASE_MARGIN * self._lease_ttl
        return writer.token

    def _drop_writer(self, session: str, writer: _Writer) -> None:
        """This replica is not ``session``'s writer any more, if ``writer`` still says it is
        (another call may have changed that while this one waited for the server)."""
        if self._writers.get(session) is writer:
            del self._writers[session]

    def _lost(self, session: str) -> HistoryConflictError:
        """The server lost the history of ``session`` that this tier committed."""
        self._drop_view(session)
        self._counters.lost += 1
        return HistoryConflictError(
            self.name,
            session,
            "the server lost the history this replica committed (it restarted without "
            "persistence or evicted it)",
        )

    def token(self, session: str) -> int | None:
        """This replica's fencing token for ``session`` (``None``: it is not the writer)."""
        writer = self._writers.get(session)
        return None if writer is None else writer.token

    def may_serve_local(self, session: str) -> bool:
        writer = self._writers.get(session)
        return writer is not None and time.monotonic() < writer.lease_until

    async def discard(self, session: str) -> bool:
        self._check_open()
        writer = self._writers.get(session)
        self._forget(session)
        if writer is None:
            return False
        new_id = secrets.token_hex(16)
        try:
            reply = await self._scripts["drop"](
                keys=[f"{self._base(session)}:m"],
                args=["discard", writer.token, "", self._base(session), new_id],
            )
        except (RedisError, OSError) as exc:
            raise self._io_error("discard a conversation", exc) from exc
        self._clock(reply[1])
        if int(reply[0]) < 0:
            self._drop_view(session)
            return False
        self._known.pop(session, None)
        if int(reply[0]) == 1:  # an empty history, under a new incarnation id
            self._known[session] = Manifest(
                session=session, id=new_id, v=_int(reply[2]), fence=writer.token
            )
        return True

    # -- space ---------------------------------------------------------------------------
    def reserve(self, key: SegmentKey, length: int) -> bool:
        self._check_open()
        if key in self._reserved or key in self._index:
            raise ValueError(f"tier {self.name!r} already holds or reserves segment {key[1]}")
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

    # -- data ----------------------------------------------------------------------------
    async def write(self, key: SegmentKey, data: memoryview) -> None:
        """Write a segment's parts, then commit it as the conversation's next segment (one
        Lua step).

        :raises StaleWriterError: another replica took the conversation over since this one
            became its writer (nothing is stored)
        :raises LeaseHeldError: this replica holds no lease and another replica's is live
        :raises HistoryConflictError: the shared history is not the one this replica
            extends (another replica appended, it never read it, the server lost it)
        :raises CommitDelayedError: this replica took the conversation over from one whose
            lease is live; the same write succeeds after ``retry_in`` seconds
        :raises TierIOError: the server failed or went away; nothing is visible unless the
            commit ran before the write's deadline and its reply was lost (the tier then
            learns it from the manifest, and the same write later succeeds at once)
        """
        self._check_open()
        length = self._reserved.get(key)
        if length is None:
            raise ValueError(f"segment {key[1]} has no reservation in tier {self.name!r}")
        if len(data) != length:
            raise ValueError(f"reserved {length} bytes, asked to write {len(data)}")
        session, seq = key
        hlen = PREFIX.unpack_from(data, 0)[1] if len(data) >= PREFIX.size else 0
        head_len = min(len(data), PREFIX.size + hlen)
        header, _ = parse_header(data[:head_len], f"segment {seq} to write")
        if (header.session, header.seq) != key or header.length != length:
            raise ValueError(f"the bytes to write are not segment {seq} of this session")
        known = self._known.get(session)
        if known is not None and seq < known.n and plain(known.headers[seq]) == plain(header):
            self._commit_local(key, known.entries[seq])  # committed already (written back)
            return
        for attempt in range(2):
            if session in self._stale:  # a commit of this tier's moved the version on
                await self._reload(session)
            if session not in self._writers:
                await self.acquire(session)
            known = self._known.get(session)
            if known is None:
                self._counters.conflicts += 1
                raise HistoryConflictError(
                    self.name, session, "this replica has not read its shared history"
                )
            if seq != known.n:
                self._counters.conflicts += 1
                raise HistoryConflictError(
                    self.name,
                    session,
                    f"the shared history has {known.n} turn(s), this is turn {seq}",
                )
            try:
                await self._commit(key, data, header, head_len, known)
                return
            except _Vanished:
                if attempt or known.n:
                    raise self._lost(session) from None
                self._drop_view(session)  # nothing was committed yet: start the log again

    def _commit_local(self, key: SegmentKey, entry: Entry) -> None:
        del self._reserved[key]
        self._index[key] = entry
        self._attempts.pop(key, None)

    async def _commit(
        self,
        key: SegmentKey,
        data: memoryview,
        header: SegmentHeader,
        head_len: int,
        known: Manifest,
    ) -> None:
        client = self._check_open()
        session, seq = key
        writer = self._writers[session]
        length = len(data)
        vs = self.value_size
        prior = self._attempts.get(key)
        if prior is not None and prior.mid == known.id and plain(prior.header) == plain(header):
            entry = prior.entry  # the same segment again: the same parts (a retry)
        else:
            if self._key is not None:
                head = await anyio.to_thread.run_sync(
                    authenticated_head, data, self._key, bytes.fromhex(known.id)
                )
            else:
                head = bytes(data[:head_len])
            entry = Entry(
                length=length,
                nonce=secrets.token_hex(8),
                parts=-(-length // vs),
                value_size=vs,
                head=head,
            )
        self._attempts[key] = _Attempt(entry, known.id, header)
        # the values: the first ones carry the (authenticated) head in place of data's
        cover = -(-len(entry.head) // vs)
        first = bytearray(data[: cover * vs])
        first[: len(entry.head)] = entry.head
        views = [memoryview(first)[at : at + vs] for at in range(0, len(first), vs)]
        views += [data[at : at + vs] for at in range(cover * vs, length, vs)]
        parts = self._parts(key, entry)
        manifest = f"{self._base(session)}:m"
        mac = (
            b""
            if self._key is None
            else sign(session, known.id, known.v + 1, [*known.entries, entry], self._key)
        )
        start = time.monotonic()
        deadline = round((start + self._timeout) * 1000 + self._skew)
        keys = [manifest, *parts]
        args: list[str | int | bytes] = [
            seq,
            writer.token,
            encode_entry(entry),
            entry.kfield,
            known.id,
            known.v,
            deadline,
            mac,
            self.owner,
            self._lease_ms,
        ]
        commit = self._scripts["commit"]
        try:
            with anyio.fail_after(self._timeout):
                # one round trip: the values, then the commit, which the server runs after
                # them and which checks that they all arrived
                # (a Cluster client refuses scripts in pipelines: two round trips there)
                cluster = isinstance(client, aioredis.RedisCluster)
                async with client.pipeline(transaction=False) as pipe:
                    for part, view in zip(parts, views, strict=True):
                        pipe.set(part, view, px=self._part_ms, nx=True)
                    if not cluster:
                        pipe.evalsha(commit.sha, len(keys), *keys, *args)
                    results = await pipe.execute(raise_on_error=False)
                for failed in results[: len(parts)]:  # a value refused (out of memory)
                    if isinstance(failed, Exception):
                        raise failed  # (the commit step found it missing: nothing committed)
                reply = await commit(keys=keys, args=args) if cluster else results[-1]
                if isinstance(reply, NoScriptError):  # the server lost its script cache
                    reply = await commit(keys=keys, args=args)
                elif isinstance(reply, Exception):
                    raise reply
        except (RedisError, OSError) as exc:
            if not await self._resolve(key, entry):
                raise self._io_error(f"write segment {seq} ({length:,} bytes)", exc) from exc
            reply = [1, 0, -1]  # committed after all: its reply was lost
        finally:
            # the client may keep the command's arguments: let go of the caller's buffer
            for view in views:
                view.release()
        self._clock(reply[1])
        await self._after_commit(key, entry, known, writer, reply, start)

    async def _resolve(self, key: SegmentKey, entry: Entry) -> bool:
        """Whether a commit whose reply did not come was made (``False`` also when that
        cannot be learned now: the attempt stays recorded, and a retry or a refresh
        settles it)."""
        client = self._client
        if client is None:
            return False
        with (
            contextlib.suppress(RedisError, OSError),
            anyio.fail_after(min(_RESOLVE_TIMEOUT, self._timeout)),
        ):
            got = await client.hget(f"{self._base(key[0])}:m", f"k:{key[1]}")
            return _text(got) == entry.kfield if got is not None else False
        return False

    async def _after_commit(
        self,
        key: SegmentKey,
        entry: Entry,
        known: Manifest,
        writer: _Writer,
        reply: Sequence[Any],
        start: float,
    ) -> None:
        """Settle a commit's reply (``known`` and ``writer``: what the commit was made
        with; another call may have replaced them meanwhile)."""
        session, seq = key
        code = int(reply[0])
        if code >= 0:
            v = _int(reply[2])
            if v == known.v + 1 and self._known.get(session) is known:
                head, _ = parse_header(entry.head, "a committed segment")
                known.entries.append(entry)
                known.headers.append(head)
                known.v = v
            else:  # the version moved on, or another call changed the view: read it again
                self._stale.add(session)  # (before the next commit)
            writer.lease_until = start + _LEASE_MARGIN * self._lease_ttl
            self._commit_local(key, entry)
            self._counters.writes += 1
            self._counters.bytes_written += entry.length
            return
        if code in (-1, -2, -4):
            self._attempts.pop(key, None)  # refused for good: its parts are gone
        if code == -1:
            self._drop_writer(session, writer)
            self._counters.refused += 1
            raise StaleWriterError(self.name, session, writer.token, _int(reply[2]))
        if code == -2:
            if self._known.get(session) is known:
                del self._known[session]
            self._counters.conflicts += 1
            raise HistoryConflictError(
                self.name,
                session,
                f"the shared tier holds version {_int(reply[3])} of its history "
                f"({_int(reply[4])} turn(s)), not version {known.v} ({known.n} turn(s)) that "
                f"this replica extends",
            )
        if code == -3:
            raise CommitDelayedError(self.name, session, max(0, _int(reply[2])) / 1000)
        if code == -4:
            raise _Vanished
        if code == -5:
            raise TierIOError(
                self.name,
                f"write segment {seq} on {self.url}",
                "the server ran the commit after the writer had stopped waiting for it, and "
                "refused it (nothing was committed; the write may be retried)",
            )
        raise TierIOError(
            self.name,
            f"write segment {seq} on {self.url}",
            "a part was evicted before the segment was committed (the server is out of "
            "memory: raise its maxmemory or this tier's part_ttl)",
        )

    async def _reload(self, session: str) -> None:
        """Read ``session``'s manifest again into what this tier knows (not its index).

        :raises TierIOError: the server cannot be reached (it stays to be read again)
        """
        try:
            fields = _fields(await self._check_open().hgetall(f"{self._base(session)}:m"))
        except (RedisError, OSError) as exc:
            raise self._io_error("look up a conversation", exc) from exc
        self._stale.discard(session)
        try:
            m = parse(fields, session, self._key, self._where(session)) if fields else None
        except Damaged:
            m = None
        if m is None:
            self._known.pop(session, None)
        else:
            self._reconcile(session, m)
            self._known[session] = m

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
            incarnations=[self._incarnation(key[0]) for key in keys],
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

    def _incarnation(self, session: str) -> bytes | None:
        known = self._known.get(session)
        return None if known is None or self._key is None else bytes.fromhex(known.id)

    async def _fetch(
        self, client: aioredis.Redis | aioredis.RedisCluster, batch: list[tuple[int, str, int, int]]
    ) -> list[bytes | None]:
        async with client.pipeline(transaction=False) as pipe:
            for _, part, _, _ in batch:
                pipe.get(part)
            values: list[bytes | None] = await pipe.execute()
        return values

    async def _take_out(self, key: SegmentKey, missing: bool) -> None:
        """Count a damaged segment and take its conversation out of service, here and (if
        the manifest is still the version that was read) in the server."""
        self._counters.corrupt += 1
        if missing:
            self._counters.missing += 1
        session = key[0]
        known = self._known.get(session)
        self._drop_view(session, keep_writer=True)
        if known is None:
            return
        with anyio.CancelScope(shield=True):
            # if the server is failing too, the parts are checked again on every read
            with contextlib.suppress(RedisError, OSError), anyio.fail_after(self._timeout):
                await self._scripts["drop"](
                    keys=[f"{self._base(session)}:m"],
                    args=[
                        "damaged",
                        known.v,
                        known.id,
                        self._base(session),
                        secrets.token_hex(16),
                    ],
                )

    async def delete(self, key: SegmentKey) -> None:
        """Stop counting a segment in this cache. Never removes it from the server: other
        replicas may be reading it (see :meth:`discard`)."""
        self._check_open()
        entry = self._index.pop(key, None)
        if entry is not None:
            self._used -= entry.length

    def contains(self, key: SegmentKey) -> bool:
        return key in self._index

    def length(self, key: SegmentKey) -> int:
        return self._index[key].length

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
            notes=(
                f"server {self.url}, prefix {self.prefix!r}, values of {self.value_size:,} bytes"
                + (", authenticated" if self._key is not None else ""),
                f"{c.missing} segment(s) found with a value gone (evicted or lost by the "
                f"server), {c.refused} stale write(s) refused",
                f"{c.conflicts} write(s) refused for another history, {c.lost} history(ies) "
                f"found lost by the server",
            ),
        )


class _Vanished(Exception):
    """The manifest is gone (COMMIT's -4)."""


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


@functools.cache
def driver_options() -> dict[str, Any]:
    """Client options naming the client in ``CLIENT SETINFO`` (redis-py, used by tieredkv).

    The tier passes them to the clients it builds; pass them to a client you build yourself
    (``redis.asyncio.Redis.from_url(url, **driver_options())``), or its connections look
    the client's version up in package metadata, on the event loop. The first call reads
    that metadata: make it before the event loop runs, or in a worker thread.
    """
    try:
        from redis.driver_info import DriverInfo  # redis >= 8
    except ImportError:
        from redis.utils import get_lib_version

        version: str = get_lib_version()  # type: ignore[no-untyped-call]
        return {"lib_name": f"redis-py(tieredkv_v{__version__})", "lib_version": version}
    return {"driver_info": DriverInfo().add_upstream_driver("tieredkv", __version__)}
