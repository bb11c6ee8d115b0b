"""A Redis tier's writer leases and fencing tokens, and its view of each conversation's
manifest: :meth:`~tieredkv.backends.shared.SharedTier.refresh` (a load's takeover in the
same Lua step that reads the manifest), ``acquire``, ``ensure_writer`` and ``discard``.

One writer per conversation: the holder of the manifest's fencing token. A replica that
holds no token gets one only if the history is the one it knows; a takeover of a live lease
delays the new writer's first commit until that lease has ended (server-side), which is
what lets a replica that holds a live lease serve its own copy while the server is away.

A replica also keeps a liveness key alive (:meth:`Leases.beat`, every third of
``liveness``), and serves its own copy only while its last heartbeat could still be alive
on the server. So a takeover need not wait out a dead replica's lease: once the replica
it waits for has no liveness key, that replica cannot be serving (its own clock says its
heartbeat ran out too), and the delay ends (:meth:`Leases.reclaim`).
"""

from __future__ import annotations

import logging
import secrets
import time

import anyio

from ..errors import (
    HistoryConflictError,
    LeaseHeldError,
    StaleWriterError,
    TierIOError,
    UnauthenticatedWriterError,
)
from ..payload import SegmentHeader
from ._redis_client import RedisError, refused_as_damaged, text, to_int
from ._redis_client import fields as manifest_fields
from ._redis_state import Replica, Writer
from .redis_manifest import Damaged, Manifest, parse
from .shared import SharedState

__all__ = ["Leases"]

_log = logging.getLogger("tieredkv.redis")


class Leases(Replica):
    """The sharing half of :class:`~tieredkv.backends.shared.SharedTier` for Redis."""

    async def refresh(self, session: str, *, take: bool = False) -> SharedState:
        # the cache's read: it makes its copies agree with what this finds (sharing._adopt)
        state = await self._refresh(session, take=take)
        known = self._known.get(session)
        if known is None:
            self._adopted.pop(session, None)
        else:
            self._adopted[session] = known
        return state

    async def _refresh(self, session: str, *, take: bool = False) -> SharedState:
        """Read ``session``'s manifest into what this tier knows, not into what the cache
        adopted (see ``_adopted``)."""
        self._check_open()
        manifest = self._manifest(session)
        writer = self._writers.get(session)
        sent = time.monotonic()
        token: int | None = None
        if take:
            reply = await self._conn.call(
                "take",
                [manifest],
                [self.owner, self._lease_ms, str(writer.token) if writer else ""],
                "look up a conversation",
            )
            fields = manifest_fields(reply[2]) if int(reply[0]) != -1 else {}
            if int(reply[0]) == 0:
                token = to_int(reply[3])
        else:
            fields = await self._conn.manifest(manifest)
        return self._settle(session, fields, token, sent)

    def _settle(
        self, session: str, fields: dict[bytes, bytes], token: int | None, sent: float
    ) -> SharedState:
        """Compare the manifest just read with what this tier knew; index it."""
        prev = self._known.get(session)
        try:
            m = (
                parse(fields, session, self._key, self._where(session), self.prefix)
                if fields
                else None
            )
        except Damaged as exc:
            self._counters.corrupt += 1
            _log.warning("%s: the manifest of %.80r is damaged: %s", self.name, session, exc)
            self._drop_view(session, keep_writer=True)  # (its writer may still discard it)
            return SharedState(status="damaged")
        if m is None:
            self._drop_view(session, keep_writer=True)
            writer = self._writers.get(session)
            knew = prev is not None and prev.n > 0
            # a history this tier knew, or one its writer lease covered (its view may have
            # been dropped since, unread): lost. Said again while this replica holds that
            # lease, whoever asks first (a fork's look-up, say), so that no later refresh
            # takes it for a conversation started here and never committed ("absent")
            if knew or (writer is not None and writer.history):
                if knew or (writer is not None and not writer.lost):
                    self._counters.lost += 1
                if writer is not None:
                    writer.history = writer.lost = True
                return SharedState(status="lost")
            return SharedState(status="absent")
        self._reconcile(session, m)
        if token is not None and m.fence == token:
            self._writers[session] = Writer(token, self._lease_from(sent))
        elif (w := self._writers.get(session)) is not None and m.fence != w.token:
            self._drop_writer(session, w)  # another replica took it over
        self._adopt_fenced(session, m)
        if (w := self._writers.get(session)) is not None and m.history:
            w.history = True
        if prev is not None and prev.id == m.id and m.v < prev.v:
            # an older version than this tier committed or read: the server lost data
            self._counters.lost += 1
            self._known[session] = m
            self._forget(session)
            return SharedState(status="lost")
        self._absorb(m)
        same = prev is not None and (prev.id, prev.v) == (m.id, m.v)
        return SharedState(status="current" if same else "changed", headers=tuple(m.history))

    async def lookup(self, session: str) -> list[SegmentHeader]:
        state = await self._refresh(session)  # (not the cache's read: nothing adopted)
        return list(state.headers)

    async def check_unmarked(self, session: str, *, ask: bool) -> None:
        """Refuse to write into an authenticated prefix without its secret: a replica
        with the secret marks the prefix (``<prefix>:auth``); a tier without one learns of
        the mark at each heartbeat, and here (``ask``) before it takes a conversation.

        :raises UnauthenticatedWriterError: this tier has no secret and the prefix is marked
        :raises TierIOError: the server cannot be reached (with ``ask``)
        """
        if self._key is not None:
            return
        if ask and not self._marked:
            try:
                with anyio.fail_after(self._timeout):
                    self._marked = bool(await self._check_open().exists(self._marker))
            except (RedisError, OSError, TimeoutError) as exc:
                raise self._io_error("check the prefix's secret", exc) from exc
        if self._marked:
            raise UnauthenticatedWriterError(self.name, session)

    async def acquire(self, session: str, *, force: bool = False) -> int:
        self._check_open()
        await self.check_unmarked(session, ask=True)
        # the history the cache's copy is: a newer one this tier learned by a look-up the
        # cache did not reconcile is not proof that this replica extends it (its next turn
        # would be committed after another replica's turns: a splice)
        adopted = self._adopted.get(session)
        prev = adopted if adopted is not None and adopted.n else None
        new_id = secrets.token_hex(16)
        sent = time.monotonic()
        reply = await self._conn.call(
            "acquire",
            [self._manifest(session)],
            [
                self.owner,
                self._lease_ms,
                "1" if force else "0",
                session,
                prev.id if prev else "",
                str(prev.v) if prev else "",
                new_id,
            ],
            "take a conversation's lease",
        )
        code = int(reply[0])
        if code == -1:
            raise LeaseHeldError(
                self.name, session, text(reply[2]), max(0, to_int(reply[3])) / 1000
            )
        if code == -2:
            self._counters.conflicts += 1
            raise HistoryConflictError(
                self.name,
                session,
                f"the shared tier holds version {to_int(reply[3])} of its history "
                f"({to_int(reply[4])} turn(s)), which this replica has not read",
            )
        token, turns = to_int(reply[2]), to_int(reply[5])
        if turns == 0 and prev is None:
            # an empty history (this call may have created it): known as a whole
            self._known[session] = self._adopted[session] = Manifest(
                session=session, id=text(reply[3]), v=to_int(reply[4]), fence=token
            )
        self._writers[session] = Writer(token, self._lease_from(sent), history=turns > 0)
        if turns == 0:
            await self._recheck_forks(session)
        return token

    async def _recheck_forks(self, session: str) -> None:
        """Before this replica starts ``session``'s history (empty on the server), read
        again the forks whose views index a turn under its key: such a turn of an earlier
        history, kept for a fork, makes :meth:`reserve` refuse the new one, and a view
        can outlive what the server holds (it restarted empty, or another replica dropped
        the fork), which would refuse every turn under the key here until this replica
        happened to read the fork again. A fork the server still holds keeps its turns
        (and the refusal); one it cannot be asked about stays as it is."""
        if (session, 0) not in self._holders:  # (the usual case, at once: a fork lists
            return  # its parent's turns from turn 0, and a history its turns from 0 too)
        forks = {by for key, by_ in self._holders.items() if key[0] == session for by in by_}
        for fork in sorted(forks - {session}):
            try:
                await self._refresh(fork)  # (not the cache's read: nothing adopted)
            except TierIOError:
                return

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
        reply = await self._conn.call(
            "ensure",
            [self._manifest(session)],
            [self.owner, self._lease_ms, writer.token],
            "check a conversation's writer",
        )
        code = int(reply[0])
        if code == -4:  # no manifest: the server restarted empty or evicted it
            self._drop_writer(session, writer)
            prev = self._known.get(session)
            if prev is None or not prev.n:
                self._known.pop(session, None)
                self._adopted.pop(session, None)
                return await self.acquire(session)  # nothing was committed yet: start again
            raise self._lost(session)
        if code == -1:
            self._drop_writer(session, writer)
            self._counters.refused += 1
            raise StaleWriterError(
                self.name,
                session,
                writer.token,
                to_int(reply[2]),
                damaged=refused_as_damaged(reply),
            )
        writer.lease_until = self._lease_from(sent)
        return writer.token

    def token(self, session: str) -> int | None:
        """This replica's fencing token for ``session`` (``None``: it is not the writer)."""
        writer = self._writers.get(session)
        return None if writer is None else writer.token

    def may_serve_local(self, session: str) -> bool:
        writer = self._writers.get(session)
        now = time.monotonic()
        return (
            writer is not None
            and now < writer.lease_until
            and now < self._alive_until
            and not self._evicting  # (a server that evicts may have forgotten the lease)
        )

    async def beat(self) -> bool:
        """Renew this replica's liveness key (it expires ``liveness`` seconds after the
        server sets it); whether it was renewed. A heartbeat that fails leaves
        :meth:`may_serve_local` false once the last one that came back has run out."""
        client = self._conn.client
        if client is None:
            return False
        sent = time.monotonic()
        ms = max(1, round(self._liveness * 1000))
        try:
            with anyio.fail_after(min(self._timeout, self._liveness)):
                before = await client.set(self._live_key(self.owner), b"1", px=ms, get=True)
                memory = await client.info("memory")
                if self._key is None and not self._marked:
                    self._marked = bool(await client.exists(self._marker))
                elif self._key is not None:  # (again: a server restarted empty forgot it)
                    await self._put_mark(client)
        except (RedisError, OSError, TimeoutError) as exc:
            if self._beating:
                self._beating = False
                left = max(0.0, self._alive_until - time.monotonic())
                _log.warning(
                    "%s: heartbeat to %s failed (%s: %s); this replica serves its own copies "
                    "of the conversations it writes for %.1f s more, then counts their loads "
                    "as misses until the server answers again",
                    self.name,
                    self.url,
                    type(exc).__name__,
                    exc,
                    left,
                )
            return False
        if before is None and sent < self._alive_until:
            self._lost_liveness()
        self._check_eviction(memory)
        self._alive_until = max(self._alive_until, sent + self._liveness)
        if not self._beating:
            self._beating = True
            _log.info("%s: heartbeat to %s answered again", self.name, self.url)
        return True

    def _lost_liveness(self) -> None:
        """The server no longer held this replica's liveness key, which it should have
        (it restarted empty, or evicted it): with it went what kept another replica from
        committing over this one's leases. No lease held now proves a copy current: each
        is renewed by the next commit, load or takeover (until then, loads while the
        server is away are counted misses)."""
        held = [w for w in self._writers.values() if w.lease_until > 0]
        for writer in held:
            writer.lease_until = 0.0
        _log.warning(
            "%s: the server at %s lost this replica's liveness key (it restarted empty, or "
            "evicted it): the %d writer lease(s) held no longer let this replica serve its "
            "own copies while the server is away, until each is renewed",
            self.name,
            self.url,
            len(held),
        )

    def _check_eviction(self, memory: object) -> None:
        """Note whether the server evicts keys (``INFO memory``: a ``maxmemory`` with a
        policy other than ``noeviction``; for a Cluster, any node that does), logging a
        change."""
        infos = [memory] if isinstance(memory, dict) and "maxmemory" in memory else []
        if not infos and isinstance(memory, dict):  # (a Cluster's: per node)
            infos = [v for v in memory.values() if isinstance(v, dict)]
        evicting = any(
            to_int(info.get("maxmemory", 0) or 0) > 0
            and str(info.get("maxmemory_policy", "noeviction")) != "noeviction"
            for info in infos
        )
        if evicting != self._evicting:
            self._evicting = evicting
            if evicting:
                _log.warning(
                    "%s: the server at %s evicts keys (maxmemory with an eviction policy): "
                    "it may forget a writer lease or a replica's liveness, so this replica "
                    "serves no copy of its own while the server is away (such loads are "
                    "counted misses), and a takeover waits out the lease it meets",
                    self.name,
                    self.url,
                )

    async def beat_forever(self, stop: anyio.Event) -> None:
        """:meth:`beat` every third of ``liveness`` until ``stop`` is set (not by
        cancellation: the client may swallow a cancellation that lands in a command)."""
        while not stop.is_set():
            await self.beat()
            with anyio.move_on_after(self._liveness / 3):
                await stop.wait()

    async def reclaim(self, session: str, holder: str) -> bool:
        """End the takeover delay of ``session`` if ``holder``, the replica whose lease it
        waits for, is dead (no liveness key); whether it ended."""
        client = self._conn.client
        if client is None or not holder or self._evicting:  # (an evicted key proves nothing)
            return False
        try:
            with anyio.fail_after(self._timeout):
                if await client.exists(self._live_key(holder)):
                    return False
                reply = await self._conn.scripts["reclaim"](
                    keys=[self._manifest(session)], args=[holder]
                )
        except (RedisError, OSError, TimeoutError):
            return False
        if int(reply[0]) != 1:
            return False
        _log.info(
            "%s: %.80r: replica %s is gone, its lease need not run out", self.name, session, holder
        )
        return True

    async def discard(self, session: str) -> bool:
        self._check_open()
        writer = self._writers.get(session)
        self._forget(session)
        self._adopted.pop(session, None)  # (the cache holds no copy of it now)
        if writer is None:
            return False
        new_id = secrets.token_hex(16)
        reply = await self._conn.call(
            "drop",
            [self._manifest(session)],
            ["discard", writer.token, "", self._base(session), new_id],
            "discard a conversation",
        )
        if int(reply[0]) < 0:
            self._drop_view(session)
            return False
        self._known.pop(session, None)  # (the manifest is gone with it, and the lease: a
        self._drop_writer(session, writer)  # new history under this key takes a new one)
        return True
