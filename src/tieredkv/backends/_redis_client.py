"""A Redis tier's connection to its server: the client, the Lua steps, the server's clock.

A tier built from a URL builds its own client: a blocking pool of ``max_connections``
connections (a caller waits ``timeout`` for one), every connect and reply bounded by
``timeout``, and a command retried on a dropped connection (up to 3 times, 50 ms to 1 s
apart), as after a server restart: every command the tier sends is idempotent. A client
passed in is used as it is, with its own retry settings, and never closed by the tier.

Every failure of the server or of the network leaves this module as a
:class:`~tieredkv.errors.TierIOError` naming the tier, the server (without its password)
and what was being done; a call on a closed tier raises
:class:`~tieredkv.errors.ClosedError`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import anyio

from .._fork import check_process
from .._urls import redacted
from .._version import __version__
from ..errors import ClosedError, TierIOError
from . import _redis_scripts as lua

try:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError, RedisError, ResponseError
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "RedisTier needs the redis client (the redis extra: pip install -e '.[redis]' in a "
        "checkout, or pip install redis)"
    ) from _exc

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = [
    "Client",
    "Connection",
    "Handed",
    "Joined",
    "NoScriptError",
    "RedisCluster",
    "RedisError",
    "driver_options",
    "fields",
    "pipelined",
    "redacted",
    "refused_as_damaged",
    "text",
    "to_int",
]

RedisCluster = aioredis.RedisCluster
Client: TypeAlias = "aioredis.Redis | aioredis.RedisCluster"
"""The clients a tier works with (the modules beside this one import the client library
only through this one, which says how to install it)."""

_SCRIPTS = ("take", "acquire", "ensure", "commit", "drop", "reclaim", "release", "settle")


def text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def refused_as_damaged(reply: Any) -> bool:
    """Whether a ``{-1, now, fence, dmg}`` refusal says the replica that took the
    conversation over then found its history damaged."""
    return len(reply) > 3 and to_int(reply[3], 0) > 0


def to_int(value: object, default: int = -1) -> int:
    try:
        return int(value)  # type: ignore[call-overload,no-any-return]
    except (TypeError, ValueError):
        return default


def fields(reply: Sequence[Any] | Mapping[Any, Any]) -> dict[bytes, bytes]:
    """A manifest's fields, from ``HGETALL`` (a dict) or a Lua script (a flat list)."""
    pairs = (
        reply.items()
        if isinstance(reply, Mapping)
        else ((reply[i], reply[i + 1]) for i in range(0, len(reply) - 1, 2))
    )
    return {k: v for k, v in pairs if isinstance(k, bytes) and isinstance(v, bytes)}


class Connection:
    """The client of one tier (``name``) and what it learned of the server.

    :param server: a URL (checked here) or a ready client
    :param client_options: for the pool a URL's client is built with (none with a client)
    """

    def __init__(
        self,
        server: str | Client,
        *,
        name: str,
        timeout: float,
        max_connections: int,
        client_options: dict[str, Any],
    ) -> None:
        if isinstance(server, str):
            if not server.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(
                    f"tier {name!r}: {redacted(server)!r} is not a redis://, rediss:// or "
                    f"unix:// URL"
                )
            self.url = redacted(server)
        elif client_options:
            raise ValueError(
                f"tier {name!r}: client options {sorted(client_options)} apply to a URL; "
                f"configure the client you pass instead"
            )
        else:
            self.url = repr(server)
        self.name = name
        self.timeout = timeout
        self._server = server
        self._client_options = client_options
        self._max_connections = max_connections
        self.client: Client | None = None
        """Set once :meth:`open` has connected, ``None`` again once closed."""
        self.opened_in: int | None = None
        """The process that connected (a child it forks must not use its connections)."""
        self.scripts: dict[str, AsyncScript] = {}
        self.skew = 0.0
        """Server clock minus this process's monotonic clock, ms: a lower bound."""

    @property
    def cluster(self) -> bool:
        """Whether the server is a Redis Cluster (a client given for one)."""
        return isinstance(self._server, RedisCluster)

    async def open(self) -> None:
        """Build the client (or check the one given), learn the server's clock, register
        the Lua steps.

        :raises TierIOError: the server cannot be reached
        :raises ValueError: the client given decodes replies to ``str``
        """
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
                timeout=self.timeout,
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
                **options,
            )
            client: Client = aioredis.Redis.from_pool(pool)
        else:
            client = self._server
            if client.get_connection_kwargs().get("decode_responses"):
                raise ValueError(
                    f"tier {self.name!r}: the client decodes replies to str "
                    f"(decode_responses=True); pass one that returns bytes"
                )
        try:
            seconds, micros = await client.time()
            self.clock(int(seconds) * 1000 + int(micros) // 1000)
        except (RedisError, OSError) as exc:
            if isinstance(self._server, str):
                await client.aclose()
            raise TierIOError(
                self.name,
                f"connect to {self.url} (check that the server runs and is reachable, and "
                f"the URL, TLS settings and password)",
                f"{type(exc).__name__}: {exc}",
            ) from exc
        self.scripts = {
            name: client.register_script(getattr(lua, name.upper())) for name in _SCRIPTS
        }
        self.client = client
        self.opened_in = os.getpid()

    async def close(self, manifests: Sequence[str], owner: str) -> None:
        """Release ``owner``'s leases of the conversations whose manifests are named (at
        once, not after ``lease_ttl``; best effort), then close a client this tier built."""
        client = self.client
        if client is None:
            return
        self.client = None
        if self.opened_in != os.getpid():  # a forked child's copy: the parent's connections
            return  # and leases (nothing sent, nothing closed; it cannot be opened again)
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(RedisError, OSError), anyio.fail_after(self.timeout):
                for m in manifests:
                    await self.scripts["release"](keys=[m], args=[owner])
            if isinstance(self._server, str):
                await client.aclose()
        self.opened_in = None  # closed: a child forked from now on may open it

    def check_open(self) -> Client:
        if self.client is None:
            raise ClosedError(f"tier {self.name!r}")
        check_process(f"tier {self.name!r}", self.opened_in)
        return self.client

    def io_error(self, action: str, exc: BaseException) -> TierIOError:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        hint = None
        if "used memory > 'maxmemory'" in str(exc):  # (redis-py's OutOfMemoryError)
            hint = (
                "the server is out of memory and evicts nothing to make room (its "
                "maxmemory-policy is noeviction, or nothing is evictable): raise its "
                "maxmemory or choose an evicting policy such as allkeys-lru; until then "
                "writes keep failing"
            )
        return TierIOError(self.name, f"{action} on {self.url}", detail, hint=hint)

    def clock(self, server_ms: object) -> None:
        """Learn the server's clock from a reply received just now."""
        ms = to_int(server_ms, 0)
        if ms > 0:
            self.skew = ms - time.monotonic() * 1000

    def deadline(self, start: float) -> int:
        """The server's time (ms, a lower bound) at ``timeout`` after ``start`` (this
        process's monotonic clock): when a writer that started then stops waiting."""
        return round((start + self.timeout) * 1000 + self.skew)

    async def call(
        self, script: str, keys: list[str], args: Sequence[str | int | bytes], action: str
    ) -> Any:
        """Run one of the Lua steps (:mod:`._redis_scripts`) and learn the server's clock
        from its reply.

        :raises TierIOError: the server failed or went away (``action`` says what failed)
        """
        check_process(f"tier {self.name!r}", self.opened_in)
        try:
            reply = await self.scripts[script](keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise self.io_error(action, exc) from exc
        self.clock(reply[1])
        return reply

    async def manifest(self, name: str) -> dict[bytes, bytes]:
        """The fields of the manifest ``name`` (none: there is none).

        :raises TierIOError: the server failed or went away
        """
        try:
            return fields(await self.check_open().hgetall(name))
        except (RedisError, OSError) as exc:
            raise self.io_error("look up a conversation", exc) from exc


class Joined:
    """One argument of a command sent as the concatenation of ``pieces`` (buffers), without
    joining them: a segment's value made of its header and its tensors' own bytes.
    :func:`pipelined` sends it; redis-py's own commands do not take it."""

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: Sequence[memoryview | bytes]) -> None:
        self.pieces = pieces
        self.nbytes = sum(len(p) for p in pieces)


_SMALL = 16 << 10
"""Pieces of a :class:`Joined` at most this long are copied into the command's framing
(one send for many small pieces) rather than sent on their own."""


def _pack(conn: Any, command: Sequence[Any]) -> list[bytes | memoryview]:
    """``command`` in the Redis protocol: redis-py's own packing, or, for a command with a
    :class:`Joined` argument, the same framing with that argument's pieces sent as they
    are (every other argument encoded by the connection's encoder, as redis-py does)."""
    if not any(isinstance(arg, Joined) for arg in command):
        packed: list[bytes | memoryview] = conn.pack_command(*command)
        return packed
    out: list[bytes | memoryview] = []
    buff = b"*%d\r\n" % len(command)
    for arg in command:
        pieces = arg.pieces if isinstance(arg, Joined) else None
        if pieces is None:
            arg = conn.encoder.encode(arg)
            pieces = (arg,)
        buff += b"$%d\r\n" % sum(len(p) for p in pieces)
        for piece in pieces:
            if len(piece) <= _SMALL:
                buff += piece
            else:
                out += (buff, piece)
                buff = b""
        buff += b"\r\n"
    out.append(buff)
    return out


def _packed(conn: Any, commands: Sequence[Sequence[Any]]) -> list[bytes | memoryview]:
    """``commands`` packed (:func:`_pack`), small framing chunks of consecutive commands
    joined (as redis-py's ``pack_commands`` joins them)."""
    packed: list[bytes | memoryview] = []
    for command in commands:
        for chunk in _pack(conn, command):
            last = packed[-1] if packed else None
            if (
                isinstance(chunk, bytes)
                and isinstance(last, bytes)
                and len(last) + len(chunk) <= 4 * _SMALL
            ):
                packed[-1] = last + chunk
            else:
                packed.append(chunk)
    return packed


class Handed:
    """Whether :func:`pipelined` began to send its commands (``any``): until then the
    server can have run none of them, whatever stopped it (it could not connect, a
    deadline ran out while it tried)."""

    __slots__ = ("any",)

    def __init__(self) -> None:
        self.any = False


async def pipelined(
    client: aioredis.Redis,
    commands: Sequence[Sequence[Any]],
    then: Callable[[], Awaitable[Sequence[Sequence[Any]]]] | None = None,
    handed: Handed | None = None,
) -> list[Any]:
    """Send ``commands`` in one go on one of ``client``'s pooled connections and read their
    replies (an error reply as its exception): what redis-py's pipeline does, retries on a
    connection error included, but without its copies of large arguments.

    ``then``, when given, is awaited once ``commands`` are handed to the connection (which
    sends them meanwhile); the commands it returns follow them, and their replies follow
    theirs. A retry awaits it again: it returns the same commands each time.

    The pipeline hands the packed commands to the stream writer's ``writelines``, and on
    Python 3.11 asyncio's socket transport joins them into one ``bytes``, slices off what
    the first ``send`` took and buffers the rest: every value copied three times. Here each
    piece (a value stays the memoryview it was given) goes through the writer's ``write``,
    whose slice of a memoryview is a view and which buffers only what the socket does not
    take at once (``benchmarks/_redis_transport.py``). A connection a send or read did not
    finish (an error, a cancellation) is disconnected before it goes back to the pool, so
    no later command follows a half-written one. An argument may be a :class:`Joined`:
    its pieces go out one after another as one value. ``handed``, when given, is marked
    as an attempt begins to send.
    """
    pool = client.connection_pool
    try:
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    except TypeError:  # redis < 5.3 names the command (later ones warn when it is named)
        conn = await pool.get_connection("PIPELINE")  # type: ignore[no-untyped-call]

    async def attempt() -> list[Any]:
        writer = None
        try:
            if not conn.is_connected:
                await conn.connect()
            await conn.check_health()
            writer = getattr(conn, "_writer", None)  # (private: redis-py's own otherwise)
            sent = list(commands)
            await send(writer, commands, drain=then is None)
            if then is not None:
                more = await then()
                sent += more
                await send(writer, more, drain=True)
            replies: list[Any] = []
            for _ in sent:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:  # an error reply, read whole
                    replies.append(exc)
            return replies
        except BaseException:
            with anyio.CancelScope(shield=True):
                if writer is not None:  # what it still buffers is half a command: dropped
                    writer.transport.abort()
                await conn.disconnect(nowait=True)
            raise

    async def send(writer: Any, commands: Sequence[Sequence[Any]], drain: bool) -> None:
        """Hand ``commands`` to the connection; with ``drain``, wait until the socket has
        taken them (without, they go out while the caller awaits something else)."""
        packed = _packed(conn, commands)
        if handed is not None:
            handed.any = True
        if writer is None:
            await conn.send_packed_command(packed, check_health=False)
            return
        try:
            for piece in packed:
                writer.write(piece)
            if drain:
                await writer.drain()
        except OSError as exc:  # (what send_packed_command raises: retried)
            raise RedisConnectionError(f"Error while writing to socket. {exc}") from exc

    async def failed(error: Exception) -> None:
        with anyio.CancelScope(shield=True):
            await conn.disconnect()

    try:
        replies: list[Any] = await conn.retry.call_with_retry(attempt, failed)
        return replies
    finally:
        with anyio.CancelScope(shield=True):
            await pool.release(conn)


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
        from redis import utils as redis_utils

        # typed in some redis-py releases, not in others: one cast serves both
        get_lib_version = cast(Callable[[], str], redis_utils.get_lib_version)
        version = get_lib_version()
        return {"lib_name": f"redis-py(tieredkv_v{__version__})", "lib_version": version}
    return {"driver_info": DriverInfo().add_upstream_driver("tieredkv", __version__)}
