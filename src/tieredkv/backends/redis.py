"""Redis / Valkey: a capacity tier that several replicas share.

Needs the optional extra ``tieredkv[redis]`` (the maintained asyncio client,
``redis.asyncio``); Valkey speaks the same protocol. Layout under the key ``prefix``, for a
conversation whose key hashes (BLAKE2b-128, hex) to ``H``::

    prefix:{H}:m                 the conversation's manifest (a hash, see below)
    prefix:{H}:lease             the writer lease: the owning replica's id, with an expiry
    prefix:{H}:<seq>:<nonce>:<i> part i of segment seq (values of ``value_size`` bytes)

The hash tag ``{H}`` keeps all of a conversation's keys in one Redis Cluster slot, so the
Lua steps below run on one node. Hashing the session key keeps any key (``}``, NUL, 10 kB
of text) out of the key syntax; the key itself is in the manifest and in every segment's
header. ``nonce`` is new for every write, so a rewritten segment never mixes parts of two
versions.

The manifest holds, per segment, ``e:<seq>`` (length, parts, and the segment's header
bytes, so a replica learns tokens and answer lengths without reading the body) and
``k:<seq>`` (``nonce:parts``); plus ``session``, ``fence`` (the fencing token of the
current writer) and ``gen`` (bumped by every change).

Write: the parts are written with a short expiry (pipelined), then one Lua script checks
the writer's fencing token, checks that every part is still there, makes the parts
permanent and adds the segment to the manifest, all at once. A reader goes through the
manifest, so it never sees a segment before all its parts are written; a writer that dies
half-way leaves only parts that expire. Read: the parts are fetched (pipelined, the next
batch in flight while the previous one is copied), then the segment's header and body
hash are checked (:func:`tieredkv.payload.verify_segment`) before it is served. A missing
part (the server evicted it under ``maxmemory``, or restarted without persistence) or a
failed check takes the conversation's segments out of the manifest and raises
:class:`~tieredkv.errors.CorruptSegmentError`: the cache counts the session lost from this
tier and recomputes, never serving part of it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import secrets
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from ..errors import (
    ClosedError,
    CorruptSegmentError,
    LeaseHeldError,
    StaleWriterError,
    TierIOError,
)
from ..payload import ALIGN, PREFIX, SegmentHeader, parse_header, verify_segment
from .base import SegmentKey, TierStats
from .shared import SharedTier

try:
    import redis.asyncio as aioredis
    from redis.exceptions import NoScriptError, RedisError
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("RedisTier needs the redis client: pip install 'tieredkv[redis]'") from _exc

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ["RedisTier", "conversation_tag", "driver_options"]

_MIN_VALUE = 64 << 10
_PUBLISH = """
local fence = redis.call('HGET', KEYS[1], 'fence')
if fence ~= ARGV[2] then return {-1, fence or ''} end
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {-2, KEYS[i]} end
end
for i = 3, #KEYS do redis.call('PERSIST', KEYS[i]) end
local old = redis.call('HGET', KEYS[1], 'k:' .. ARGV[1])
if old and old ~= ARGV[4] then
  local nonce, n = string.match(old, '^(%w+):(%d+)$')
  for i = 0, tonumber(n) - 1 do
    redis.call('UNLINK', ARGV[5] .. ':' .. ARGV[1] .. ':' .. nonce .. ':' .. i)
  end
end
redis.call('HSET', KEYS[1], 'e:' .. ARGV[1], ARGV[3], 'k:' .. ARGV[1], ARGV[4],
           'session', ARGV[8])
local gen = redis.call('HINCRBY', KEYS[1], 'gen', 1)
local holder = redis.call('GET', KEYS[2])
if not holder or holder == ARGV[6] then
  redis.call('SET', KEYS[2], ARGV[6], 'PX', ARGV[7])
end
return {0, gen}
"""
"""KEYS: manifest, lease, parts...; ARGV: seq, token, entry, nonce:parts, base, owner,
lease ms, session. Returns {0, gen}, {-1, current fence} or {-2, missing part}."""

_ACQUIRE = """
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] and ARGV[3] ~= '1' then
  return {-1, holder, redis.call('PTTL', KEYS[2])}
end
local now = redis.call('TIME')
local token = math.max(tonumber(redis.call('HGET', KEYS[1], 'fence') or '0') + 1,
                       tonumber(now[1]) * 1000000 + tonumber(now[2]))
token = string.format('%d', token)
redis.call('HSET', KEYS[1], 'fence', token, 'session', ARGV[4])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {token}
"""
"""KEYS: manifest, lease; ARGV: owner, lease ms, force (1/0), session. The token is above
the last one and at least the server's clock in microseconds, so it keeps growing even if
the server evicts or loses the manifest that holds the last one."""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
"""KEYS: lease; ARGV: owner. Ends the lease if this replica holds it."""

_DELETE = """
local function drop(seq)
  local old = redis.call('HGET', KEYS[1], 'k:' .. seq)
  if not old then return end
  local nonce, n = string.match(old, '^(%w+):(%d+)$')
  for i = 0, tonumber(n) - 1 do
    redis.call('UNLINK', ARGV[2] .. ':' .. seq .. ':' .. nonce .. ':' .. i)
  end
  redis.call('HDEL', KEYS[1], 'e:' .. seq, 'k:' .. seq)
end
if redis.call('HGET', KEYS[1], 'k:' .. ARGV[1]) ~= ARGV[3] then return 0 end
if ARGV[4] == 'damaged' then
  for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
    local seq = string.match(field, '^k:(%d+)$')
    if seq then drop(seq) end
  end
else
  local fence = redis.call('HGET', KEYS[1], 'fence')
  if fence and fence ~= ARGV[4] then return -1 end
  drop(ARGV[1])
end
redis.call('HINCRBY', KEYS[1], 'gen', 1)
return 1
"""
"""KEYS: manifest; ARGV: seq, base, nonce:parts, token or 'damaged'. A segment is deleted
only in the version this replica knows; a plain delete only by the current writer (else it
is left to that writer: -1); 'damaged' takes every segment of the conversation out."""


class _Entry(msgspec.Struct, array_like=True, frozen=True):
    """One published segment, as stored in the manifest's ``e:<seq>`` field."""

    length: int
    nonce: str
    parts: int
    value_size: int
    head: bytes
    """The segment's prefix and header bytes."""

    @property
    def kfield(self) -> str:
        return f"{self.nonce}:{self.parts}"


_encode_entry = msgspec.msgpack.Encoder().encode
_decode_entry = msgspec.msgpack.Decoder(_Entry).decode


def conversation_tag(session: str) -> str:
    """The hash tag of a conversation's keys: BLAKE2b-128 of its key, in hex."""
    return hashlib.blake2b(session.encode("utf-8"), digest_size=16).hexdigest()


def _redacted(url: str) -> str:
    """``url`` without its password."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)


class RedisTier(SharedTier):
    """Segments in Redis or Valkey, shared by every cache configured with the same server
    and ``prefix``.

    :param server: a ``redis://``, ``rediss://`` (TLS) or ``unix://`` URL (user and password
        may be in it), or a ready ``redis.asyncio`` client (``Redis`` or ``RedisCluster``),
        which the tier uses as is and does not close
    :param capacity: the byte budget for this tier's segments, as this cache counts them
        (what it wrote, recovered at open or discovered through :meth:`lookup`)
    :param name: the tier's name in metadata and events
    :param prefix: the first part of every key; deployments sharing a server use different
        prefixes (or share conversations, with the same models)
    :param value_size: bytes per Redis value; a segment is split into values of this size
        (a multiple of 4096, at least 64 KiB)
    :param timeout: seconds to connect and to wait for a reply
    :param max_connections: connections in the pool (a caller waits ``timeout`` for one)
    :param lease_ttl: seconds a writer lease lasts after the conversation's last write
    :param part_ttl: seconds a written but unpublished part lives (a writer that dies
        half-way leaves nothing longer than this)
    :param read_batch: values fetched per round trip while reading
    :param recover: whether :meth:`open` returns every conversation under ``prefix`` (as a
        persistent tier does); ``False`` leaves them to :meth:`lookup`
    :param owner: this replica's id in leases (default: a random one per tier)
    :param client_options: passed to the client's connection pool (``password``,
        ``username``, ``ssl_ca_certs``, ``ssl_certfile``, ...), with a URL only
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
        self._server = server
        self._client_options = client_options
        self._capacity = capacity
        self._timeout = timeout
        self._max_connections = max_connections
        self._lease_ms = round(lease_ttl * 1000)
        self._part_ms = round(part_ttl * 1000)
        self._batch = read_batch
        self._recover = recover
        self._client: aioredis.Redis | aioredis.RedisCluster | None = None
        self._scripts: dict[str, AsyncScript] = {}
        self._index: dict[SegmentKey, _Entry] = {}
        self._reserved: dict[SegmentKey, int] = {}
        self._tokens: dict[str, int] = {}
        self._used = 0
        self._counters: dict[str, int] = dict.fromkeys(
            ("bytes_read", "bytes_written", "reads", "writes", "corrupt", "missing", "refused"),
            0,
        )

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
    def missing(self) -> int:
        """Segments found with a value gone (server eviction or restart), never served."""
        return self._counters["missing"]

    def _check_open(self) -> aioredis.Redis | aioredis.RedisCluster:
        if self._client is None:
            raise ClosedError(f"tier {self.name!r}")
        return self._client

    def _base(self, session: str) -> str:
        return f"{self.prefix}:{{{conversation_tag(session)}}}"

    def _parts(self, key: SegmentKey, entry: _Entry) -> list[str]:
        base = f"{self._base(key[0])}:{key[1]}:{entry.nonce}"
        return [f"{base}:{i}" for i in range(entry.parts)]

    def _io_error(self, action: str, exc: BaseException) -> TierIOError:
        return TierIOError(self.name, f"{action} on {self.url}", f"{type(exc).__name__}: {exc}")

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self) -> list[SegmentHeader]:
        if self._client is not None:
            return []
        if isinstance(self._server, str):
            # the client looks its version up in package metadata (file I/O) for each
            # connection unless told: once, in a worker thread
            options = {**await anyio.to_thread.run_sync(driver_options), **self._client_options}
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
            await client.ping()
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
            "publish": client.register_script(_PUBLISH),
            "acquire": client.register_script(_ACQUIRE),
            "delete": client.register_script(_DELETE),
            "release": client.register_script(_RELEASE),
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
                manifest = await client.hgetall(name)
                headers.extend(self._absorb_manifest(manifest, None))
        except (RedisError, OSError) as exc:
            raise self._io_error("list conversations", exc) from exc
        return headers

    def _absorb_manifest(
        self, manifest: Mapping[bytes | str, bytes | str], session: str | None
    ) -> list[SegmentHeader]:
        """Index the manifest's segments (replacing what was known of the conversation);
        return their headers, in ``seq`` order, or ``[]`` if they are not 0, 1, ... ."""
        raw = manifest.get(b"session")
        if not isinstance(raw, bytes):
            return []
        key = raw.decode("utf-8", "replace")
        if session is not None and key != session:
            return []  # a BLAKE2b-128 collision: not this conversation
        found: dict[int, tuple[_Entry, SegmentHeader]] = {}
        for field, value in manifest.items():
            if not isinstance(field, bytes) or not field.startswith(b"e:"):
                continue
            seq = int(field[2:])
            where = f"{self.url} {self._base(key)} segment {seq}"
            try:
                entry = _decode_entry(value if isinstance(value, bytes) else b"")
                header, _ = parse_header(entry.head, where)
            except (msgspec.DecodeError, CorruptSegmentError):
                self._counters["corrupt"] += 1
                return []
            if (header.session, header.seq) != (key, seq) or header.length != entry.length:
                self._counters["corrupt"] += 1
                return []
            found[seq] = (entry, header)
        self._forget(key)
        if sorted(found) != list(range(len(found))):
            self._counters["corrupt"] += 1
            return []
        for seq in range(len(found)):
            entry = found[seq][0]
            self._index[(key, seq)] = entry
            self._used += entry.length
        return [found[seq][1] for seq in range(len(found))]

    def _forget(self, session: str) -> None:
        """Drop this tier's index entries for ``session`` (not the server's data)."""
        for seq in [k[1] for k in self._index if k[0] == session]:
            self._used -= self._index.pop((session, seq)).length

    async def aclose(self) -> None:
        client = self._client
        if client is None:
            return
        self._client = None
        leases = [f"{self._base(session)}:lease" for session in self._tokens]
        self._index.clear()
        self._reserved.clear()
        self._tokens.clear()
        self._used = 0
        with anyio.CancelScope(shield=True):
            # hand the conversations this replica wrote over at once, not after lease_ttl
            with contextlib.suppress(RedisError, OSError):
                for lease in leases:
                    await self._scripts["release"](keys=[lease], args=[self.owner])
            if isinstance(self._server, str):
                await client.aclose()

    async def __aenter__(self) -> RedisTier:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- sharing -------------------------------------------------------------------------
    async def lookup(self, session: str) -> list[SegmentHeader]:
        client = self._check_open()
        try:
            manifest = await client.hgetall(f"{self._base(session)}:m")
        except (RedisError, OSError) as exc:
            raise self._io_error("look up a conversation", exc) from exc
        if not manifest:
            self._forget(session)
            return []
        return self._absorb_manifest(manifest, session)

    async def acquire(self, session: str, *, force: bool = False) -> int:
        self._check_open()
        base = self._base(session)
        try:
            reply = await self._scripts["acquire"](
                keys=[f"{base}:m", f"{base}:lease"],
                args=[self.owner, self._lease_ms, "1" if force else "0", session],
            )
        except (RedisError, OSError) as exc:
            raise self._io_error("take a conversation's lease", exc) from exc
        if int(reply[0]) < 0:
            holder = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            raise LeaseHeldError(self.name, session, holder, max(0, int(reply[2])) / 1000)
        token = int(reply[0])
        self._tokens[session] = token
        return token

    async def ensure_writer(self, session: str) -> int:
        """Make sure this replica may append to ``session``; return its fencing token.

        Takes the lease if this replica holds no token for ``session`` (a new conversation,
        or one whose lease has expired); checks with the server that a token it holds is
        still the conversation's current one.

        :raises StaleWriterError: another replica took the conversation over since
        :raises LeaseHeldError: this replica holds no token and another one's lease is live
        :raises TierIOError: if the server cannot be reached
        """
        client = self._check_open()
        token = self._tokens.get(session)
        if token is None:
            return await self.acquire(session)
        try:
            current = await client.hget(f"{self._base(session)}:m", "fence")
        except (RedisError, OSError) as exc:
            raise self._io_error("check a conversation's writer", exc) from exc
        if current is None or int(current) != token:
            self._tokens.pop(session, None)
            if current is None:  # the manifest is gone (evicted, or the server restarted)
                return await self.acquire(session)
            self._counters["refused"] += 1
            raise StaleWriterError(self.name, session, token, int(current))
        return token

    def token(self, session: str) -> int | None:
        """This replica's fencing token for ``session`` (``None``: it is not the writer)."""
        return self._tokens.get(session)

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
        """Write a segment's parts, then publish it in the manifest (one Lua step).

        :raises StaleWriterError: another replica took the conversation over since this one
            acquired it (nothing is stored)
        :raises LeaseHeldError: this replica holds no lease and another replica's is live
        :raises TierIOError: the server failed or went away (nothing becomes visible)
        """
        client = self._check_open()
        length = self._reserved.get(key)
        if length is None:
            raise ValueError(f"segment {key[1]} has no reservation in tier {self.name!r}")
        if len(data) != length:
            raise ValueError(f"reserved {length} bytes, asked to write {len(data)}")
        session, seq = key
        # the manifest keeps the header: a replica learns tokens and answer lengths from it
        hlen = PREFIX.unpack_from(data, 0)[1] if len(data) >= PREFIX.size else 0
        head_len = min(len(data), PREFIX.size + hlen)
        header, _ = parse_header(data[:head_len], f"segment {seq} to write")
        if (header.session, header.seq) != key or header.length != length:
            raise ValueError(f"the bytes to write are not segment {seq} of this session")
        token = self._tokens.get(session)
        if token is None:
            token = await self.acquire(session)
        vs = self.value_size
        views = [data[at : at + vs] for at in range(0, length, vs)]
        entry = _Entry(
            length=length,
            nonce=secrets.token_hex(8),
            parts=len(views),
            value_size=vs,
            head=bytes(data[:head_len]),
        )
        parts = self._parts(key, entry)
        base = self._base(session)
        keys = [f"{base}:m", f"{base}:lease", *parts]
        args: list[str | int | bytes] = [seq, token, _encode_entry(entry), entry.kfield, base]
        args += [self.owner, self._lease_ms, session]
        publish = self._scripts["publish"]
        try:
            # one round trip: the values, then the publish step, which the server runs
            # after them and which checks that they all arrived
            # (a Cluster client refuses scripts in pipelines: two round trips there)
            cluster = isinstance(client, aioredis.RedisCluster)
            async with client.pipeline(transaction=False) as pipe:
                for part, view in zip(parts, views, strict=True):
                    pipe.set(part, view, px=self._part_ms)
                if not cluster:
                    pipe.evalsha(publish.sha, len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
            for failed in results[: len(parts)]:  # a value refused (out of memory)
                if isinstance(failed, Exception):
                    raise failed  # (the publish step found it missing: nothing published)
            reply = await publish(keys=keys, args=args) if cluster else results[-1]
            if isinstance(reply, NoScriptError):  # the server lost its script cache
                reply = await publish(keys=keys, args=args)
            elif isinstance(reply, Exception):
                raise reply
        except (RedisError, OSError) as exc:
            raise self._io_error(f"write segment {seq} ({length:,} bytes)", exc) from exc
        finally:
            # the client may keep the command's arguments: let go of the caller's buffer
            for view in views:
                view.release()
        status = int(reply[0])
        if status == -1:
            self._tokens.pop(session, None)
            current = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            if not current:
                raise TierIOError(
                    self.name,
                    f"write segment {seq} on {self.url}",
                    "the server evicted the conversation's manifest during the write (it is "
                    "out of memory: raise its maxmemory)",
                )
            self._counters["refused"] += 1
            raise StaleWriterError(self.name, session, token, int(current))
        if status == -2:
            raise TierIOError(
                self.name,
                f"write segment {seq} on {self.url}",
                "a part was evicted before the segment was published (the server is out of "
                "memory: raise its maxmemory or this tier's part_ttl)",
            )
        del self._reserved[key]
        self._index[key] = entry
        self._counters["writes"] += 1
        self._counters["bytes_written"] += length

    async def read_into(self, key: SegmentKey, out: memoryview) -> None:
        await self.read_many_into([(key, out)])

    async def read_many_into(self, items: Sequence[tuple[SegmentKey, memoryview]]) -> None:
        """Read several committed segments, in order, fetching their values pipelined.

        Stops at the first segment that fails; the ones before it are complete. A segment
        with a value gone, or that fails its checks, takes its conversation out of the
        manifest and is raised as :class:`~tieredkv.errors.CorruptSegmentError`.
        """
        client = self._check_open()
        entries: list[_Entry] = []
        for key, out in items:
            entry = self._index.get(key)
            if entry is None:
                raise KeyError(key)
            if len(out) != entry.length:
                raise ValueError(f"segment is {entry.length} bytes, the buffer {len(out)}")
            entries.append(entry)
        # (item, redis key, start, end) for every value, in order
        plan = [
            (i, part, p * entry.value_size, min(entry.length, (p + 1) * entry.value_size))
            for i, ((key, _), entry) in enumerate(zip(items, entries, strict=True))
            for p, part in enumerate(self._parts(key, entry))
        ]
        batches = [plan[at : at + self._batch] for at in range(0, len(plan), self._batch)]
        outs = [out for _, out in items]
        keys = [key for key, _ in items]
        done = 0
        failure: tuple[int, str, bool] | None = None
        try:
            values = await self._fetch(client, batches[0])
            for b, batch in enumerate(batches):
                ahead: list[list[bytes | None]] = []
                async with anyio.create_task_group() as tg:
                    if b + 1 < len(batches):
                        tg.start_soon(self._fetch_into, client, batches[b + 1], ahead)
                    done, failure = await anyio.to_thread.run_sync(
                        _absorb, batch, values, outs, keys, done, self.url
                    )
                    if failure is not None:
                        tg.cancel_scope.cancel()
                if failure is not None:
                    break
                values = ahead[0] if ahead else []
        except (RedisError, OSError) as exc:
            raise self._io_error(f"read segment {keys[done][1]}", exc) from exc
        for out in outs[:done]:
            self._counters["reads"] += 1
            self._counters["bytes_read"] += len(out)
        if failure is not None:
            bad, detail, missing = failure
            await self._take_out(keys[bad], entries[bad], missing)
            raise CorruptSegmentError(f"{self.url} {self._base(keys[bad][0])}", detail)

    async def _fetch(
        self, client: aioredis.Redis | aioredis.RedisCluster, batch: list[tuple[int, str, int, int]]
    ) -> list[bytes | None]:
        async with client.pipeline(transaction=False) as pipe:
            for _, part, _, _ in batch:
                pipe.get(part)
            values: list[bytes | None] = await pipe.execute()
        return values

    async def _fetch_into(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        batch: list[tuple[int, str, int, int]],
        into: list[list[bytes | None]],
    ) -> None:
        into.append(await self._fetch(client, batch))

    async def _take_out(self, key: SegmentKey, entry: _Entry, missing: bool) -> None:
        """Count a damaged segment and take its conversation out of service, here and
        (if the manifest still names this version of it) in the server."""
        self._counters["corrupt"] += 1
        if missing:
            self._counters["missing"] += 1
        self._forget(key[0])
        with anyio.CancelScope(shield=True):
            # if the server is failing too, the parts are checked again on every read
            with contextlib.suppress(RedisError, OSError):
                await self._scripts["delete"](
                    keys=[f"{self._base(key[0])}:m"],
                    args=[key[1], self._base(key[0]), entry.kfield, "damaged"],
                )

    async def delete(self, key: SegmentKey) -> None:
        """Remove a segment from this tier.

        Only the conversation's current writer (the replica holding its fencing token)
        deletes it from the server; any other replica just stops counting it, leaving the
        conversation to its writer.
        """
        self._check_open()
        entry = self._index.get(key)
        if entry is None:
            return
        token = self._tokens.get(key[0])
        if token is not None:
            try:
                await self._scripts["delete"](
                    keys=[f"{self._base(key[0])}:m"],
                    args=[key[1], self._base(key[0]), entry.kfield, token],
                )
            except (RedisError, OSError) as exc:
                raise self._io_error(f"delete segment {key[1]}", exc) from exc
        if self._index.pop(key, None) is not None:
            self._used -= entry.length

    def contains(self, key: SegmentKey) -> bool:
        return key in self._index

    def length(self, key: SegmentKey) -> int:
        return self._index[key].length

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity=self._capacity,
            used=self._used,
            segments=len(self._index),
            bytes_read=self._counters["bytes_read"],
            bytes_written=self._counters["bytes_written"],
            reads=self._counters["reads"],
            writes=self._counters["writes"],
            corrupt=self._counters["corrupt"],
            notes=(
                f"server {self.url}, prefix {self.prefix!r}, values of {self.value_size:,} bytes",
                f"{self._counters['missing']} segment(s) found with a value gone (evicted or "
                f"lost by the server), {self._counters['refused']} stale write(s) refused",
            ),
        )


@functools.cache
def driver_options() -> dict[str, Any]:
    """Client options naming the client in ``CLIENT SETINFO`` (redis-py, used by tieredkv).

    The tier passes them to the clients it builds; pass them to a client you build yourself
    (``redis.asyncio.Redis.from_url(url, **driver_options())``), or its connections look
    the client's version up in package metadata, on the event loop. The first call reads
    that metadata: make it before the event loop runs, or in a worker thread.
    """
    from .. import __version__

    try:
        from redis.driver_info import DriverInfo  # redis >= 8
    except ImportError:
        from redis.utils import get_lib_version

        version: str = get_lib_version()  # type: ignore[no-untyped-call]
        return {"lib_name": f"redis-py(tieredkv_v{__version__})", "lib_version": version}
    return {"driver_info": DriverInfo().add_upstream_driver("tieredkv", __version__)}


def _absorb(
    batch: list[tuple[int, str, int, int]],
    values: list[bytes | None],
    outs: list[memoryview],
    keys: list[SegmentKey],
    done: int,
    url: str,
) -> tuple[int, tuple[int, str, bool] | None]:
    """Copy a batch of fetched values into the output buffers (in a worker thread) and
    verify each segment whose last value arrived; returns (segments complete, failure)."""
    for (i, part, start, end), value in zip(batch, values, strict=True):
        if value is None:
            return done, (i, f"value {part} is gone (evicted or lost by the server)", True)
        if len(value) != end - start:
            return done, (i, f"value {part} is {len(value)} bytes, expected {end - start}", False)
        out = outs[i]
        out[start:end] = value
        if end == len(out):
            try:
                header = verify_segment(out, f"{url} {part}")
            except CorruptSegmentError as exc:
                return done, (i, exc.detail, False)
            if (header.session, header.seq) != keys[i]:
                return done, (i, "the header names another segment", False)
            done = i + 1
    return done, None
