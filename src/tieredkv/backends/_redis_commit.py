"""A Redis tier's write path: a segment's parts, then one Lua step that commits it.

The parts are written with a short expiry (``SET NX PX``, pipelined), then
:data:`~._redis_scripts.COMMIT` commits the segment only if the writer's fencing token is
the manifest's, the manifest is the version the writer last committed or read and the
segment its next one, no takeover delay is pending, every part is still there, and the
server's clock has not passed the write's deadline (see :mod:`tieredkv.backends.redis`).
A commit whose reply is lost is settled from the manifest; every refusal is raised as the
:class:`~tieredkv.errors.TieredKVError` that says what happened.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec

from ..errors import (
    CommitDelayedError,
    HistoryConflictError,
    StaleWriterError,
    TierIOError,
    UnauthenticatedWriterError,
)
from ..payload import (
    PREFIX,
    SegmentHeader,
    authenticated_head,
    inherits,
    is_retirement,
    parse_header,
)
from ._redis_client import (
    Handed,
    Joined,
    NoScriptError,
    RedisCluster,
    RedisError,
    pipelined,
    refused_as_damaged,
    text,
    to_int,
)
from ._redis_lease import Leases
from ._redis_state import Attempt, Writer
from .base import Seal, SegmentKey
from .redis_manifest import Damaged, Entry, Manifest, Ref, encode_entry, parse, sign
from .shared import plain_header as plain

__all__ = ["Commits", "cut"]

_SETTLING = {
    -10: "this replica has no secret, and the server has not known the prefix (unmarked) for "
    "a liveness period yet: it restarted empty, or the prefix is new; replicas with the "
    "secret, if any, mark it again meanwhile",
    -11: "the server has been up for less than a liveness period (it restarted): a replica "
    "whose lease it forgot may still serve its own copy of this conversation until its "
    "heartbeat finds the restart",
}
"""Why COMMIT asked a commit to wait (its codes -10 and -11, with the milliseconds left)."""

_RESOLVE_TIMEOUT = 2.0
"""At most this long (each try at most ``timeout``) to learn whether a commit whose reply was
lost was made."""


def cut(pieces: Sequence[memoryview], size: int) -> list[list[memoryview]]:
    """The bytes of ``pieces`` joined, cut into values of ``size`` bytes (the last one
    shorter), each as the views of the pieces it spans, in order; no byte is copied."""
    values: list[list[memoryview]] = [[]]
    room = size
    for piece in pieces:
        at = 0
        while at < len(piece):
            if not room:
                values.append([])
                room = size
            take = min(room, len(piece) - at)
            values[-1].append(piece[at : at + take])
            at += take
            room -= take
    return values if values[0] else []


class _Once:
    """A :data:`Seal` that runs its seal the first time it is awaited, and only then (a
    retried commit sends the same head)."""

    __slots__ = ("_seal",)

    def __init__(self, seal: Seal) -> None:
        self._seal: Seal | None = seal

    async def __call__(self) -> None:
        if self._seal is not None:
            await self._seal()
            self._seal = None


class _Vanished(Exception):
    """The manifest is gone (COMMIT's -4)."""


class Commits(Leases):
    """:meth:`write` for a Redis tier (with the leases it takes on the way)."""

    @property
    def writes_pieces(self) -> bool:
        """Whether :meth:`write_pieces` sends a segment's pieces without joining them (on
        one server, without a secret; otherwise it joins them and writes the bytes)."""
        return self._key is None and not self._conn.cluster

    async def write_pieces(
        self, key: SegmentKey, pieces: Sequence[memoryview], seal: Seal | None = None
    ) -> None:
        """:meth:`write` of the segment whose bytes are ``pieces`` joined, the first holding
        at least its prefix and header (:meth:`tieredkv.payload.SegmentPlan.pieces`): each
        value goes out as the pieces it spans, with no copy of them where
        :attr:`writes_pieces` (the caller keeps them unchanged until this returns). Raises
        what :meth:`write` raises.

        ``seal``, when given, completes the prefix (the body hash: ``SegmentPlan.seal`` in a
        worker thread); until it is awaited the prefix parses but is not final. The values
        the head is not in go out while it runs, the ones it is in once it has returned;
        it is awaited at most once, and never after this returns.
        """
        if not pieces:
            raise ValueError(f"segment {key[1]}: no bytes to write")
        if seal is not None and not self.writes_pieces:  # (the bytes are joined, or signed)
            await seal()
            seal = None
        if not self.writes_pieces and len(pieces) > 1:  # (a MAC over the whole body)
            await self.write(key, memoryview(await anyio.to_thread.run_sync(b"".join, pieces)))
            return
        await self._write(key, pieces, _Once(seal) if seal is not None else None)

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
        :raises UnauthenticatedWriterError: this tier has no secret, and the prefix (or the
            conversation) is authenticated
        :raises TierIOError: the server failed or went away; nothing is visible unless the
            commit ran before the write's deadline and its reply was lost, and the server
            could not be asked since (``maybe_committed`` is then true; the tier learns the
            outcome from the manifest, and the same write later succeeds at once)
        """
        await self._write(key, [data])

    async def _write(
        self, key: SegmentKey, pieces: Sequence[memoryview], seal: Seal | None = None
    ) -> None:
        """:meth:`write` of the segment whose bytes are ``pieces`` joined (the first holds
        its prefix and header; ``seal``: see :meth:`write_pieces`, run at most once)."""
        self._check_open()
        length = self._reserved.get(key)
        if length is None:
            raise ValueError(f"segment {key[1]} has no reservation in tier {self.name!r}")
        given = sum(len(p) for p in pieces)
        if given != length:
            raise ValueError(f"reserved {length} bytes, asked to write {given}")
        session, seq = key
        await self.check_unmarked(session, ask=False)
        lead = pieces[0]
        hlen = PREFIX.unpack_from(lead, 0)[1] if len(lead) >= PREFIX.size else 0
        head_len = min(len(lead), PREFIX.size + hlen)
        header, _ = parse_header(lead[:head_len], f"segment {seq} to write")
        if (header.session, header.seq) != key or header.length != length:
            raise ValueError(f"the bytes to write are not segment {seq} of this session")
        if is_retirement(header):
            # the server keeps a dropped conversation's segments that forks list by their
            # reference sets (see DROP): the cache's marker is this replica's alone
            self._markers[key] = self._reserved.pop(key)
            return
        known = self._known.get(session)
        if (
            known is not None
            and known.first <= seq < known.n
            and plain(known.headers[seq - known.first]) == plain(header)
        ):  # committed already (written back)
            self._commit_local(key, known.entries[seq - known.first], known.id)
            return
        for attempt in range(2):
            if session in self._stale:  # a commit of this tier's moved the version on
                await self._reload(session)
            w = self._writers.get(session)
            if w is None or (session not in self._known and not w.history):
                # (no lease; or one over no committed turn whose history the server has
                # lost since, an empty restart, say: the log starts again)
                await self.acquire(session)
            known = self._known.get(session)
            if known is None:
                self._counters.conflicts += 1
                raise HistoryConflictError(
                    self.name, session, "this replica has not read its shared history"
                )
            first = len(header.base)  # (a fork's first turn: after the ones it inherits)
            if seq != known.n if not first else (known.n or seq != first):
                self._counters.conflicts += 1
                raise HistoryConflictError(
                    self.name,
                    session,
                    f"the shared history has {known.n} turn(s), this is turn {seq}"
                    + (f" of a fork of {first} turn(s)" if first else ""),
                )
            refs = self._references(session, header) if header.base else None
            try:
                await self._commit(key, pieces, header, head_len, known, refs, seal)
                return
            except _Vanished:
                if attempt or known.n:
                    raise self._lost(session) from None
                self._drop_view(session)  # nothing was committed yet: start the log again

    def _commit_local(self, key: SegmentKey, entry: Entry, mid: str) -> None:
        self._used -= self._reserved.pop(key)  # (counted again as committed)
        self._hold(key, entry, mid, key[0])
        self._committed.add(key)
        self._attempts.pop(key, None)

    def _references(self, session: str, header: SegmentHeader) -> list[Ref]:
        """The references a fork's first turn (``header``) commits: the committed entry of
        every segment it starts from, as this tier indexes them, which must be the very
        segments the fork inherits (:func:`~tieredkv.payload.inherits`: its ``base_ids``,
        where the fork lists them).

        :raises HistoryConflictError: one of them is not committed in this tier, or another
            segment is indexed under its key (a history started under the parent's key
            since: referencing it would make the fork's history a splice of two)
        """
        refs: list[Ref] = []
        for owner, seq, _ in header.base:
            entry = self._index.get((owner, seq))
            mid = self._origin.get((owner, seq))
            if entry is None or mid is None:
                raise self._unreferenced(
                    session,
                    f"turn {seq} of {owner[:80]!r}, which the fork starts from, is not "
                    f"committed in the shared tier",
                )
            refs.append(Ref(owner=owner, owner_id=mid, seq=seq, entry=entry))
        heads = [parse_header(ref.entry.head, "a reference")[0] for ref in refs]
        if not inherits(header, heads):
            raise self._unreferenced(
                session,
                "a turn the fork starts from is another history's there now (a conversation "
                "started under its owner's key since)",
            )
        return refs

    def _unreferenced(self, session: str, detail: str) -> HistoryConflictError:
        """A fork's first turn cannot reference what it inherits (``detail``: why)."""
        self._counters.conflicts += 1
        return HistoryConflictError(self.name, session, detail)

    async def _commit(
        self,
        key: SegmentKey,
        pieces: Sequence[memoryview],
        header: SegmentHeader,
        head_len: int,
        known: Manifest,
        refs: list[Ref] | None = None,
        seal: Seal | None = None,
    ) -> None:
        """Commit segment ``key``, whose bytes are ``pieces`` joined (one piece, or several
        without a secret: see :meth:`write_pieces`; ``refs``: a fork's first, with its
        references; ``seal``: what completes the prefix, awaited once every value but the
        ones holding the head has been handed to the connection)."""
        client = self._check_open()
        session, seq = key
        writer = self._writers[session]
        length = sum(len(p) for p in pieces)
        data = pieces[0]
        vs = self.value_size
        prior = self._attempts.get(key)
        if prior is not None and prior.mid == known.id and plain(prior.header) == plain(header):
            entry = prior.entry  # the same segment again: the same parts (a retry)
        else:
            if self._key is not None:
                assert len(pieces) == 1  # (see write_pieces)
                assert seal is None
                head = await anyio.to_thread.run_sync(
                    authenticated_head, data, self._key, bytes.fromhex(known.id)
                )
            else:
                head = b"" if seal is not None else bytes(data[:head_len])  # (b"": unsealed)
            entry = Entry(
                length=length,
                nonce=secrets.token_hex(8),
                parts=-(-length // vs),
                value_size=vs,
                head=head,
            )
        if entry.head:
            self._attempts[key] = Attempt(entry, known.id, header)
        # the values: the first ones carry the (authenticated) head in place of data's (a
        # copy of them); where the head is data's own (no secret), views of the pieces,
        # and so where it is data's own once sealed
        values: list[list[memoryview]]
        if not entry.head or data[: len(entry.head)] == entry.head:
            values = cut(pieces, vs)
        else:
            cover = -(-len(entry.head) // vs)
            first = bytearray(data[: cover * vs])
            first[: len(entry.head)] = entry.head
            values = [[memoryview(first)[at : at + vs]] for at in range(0, len(first), vs)]
            values += [[data[at : at + vs]] for at in range(cover * vs, length, vs)]
        views = [view for value in values for view in value]
        parts = self._parts(key, entry)
        base = known.base if refs is None else refs
        start = time.monotonic()
        keys = [self._manifest(session), *parts]

        def arguments(entry: Entry) -> list[str | int | bytes]:
            """The commit step's arguments for ``entry``."""
            mac = (
                b""
                if self._key is None
                else sign(session, known.id, known.v + 1, [*known.entries, entry], self._key, base)
            )
            return [
                seq,
                writer.token,
                encode_entry(entry),
                entry.kfield,
                known.id,
                known.v,
                self._conn.deadline(start),
                mac,
                self.owner,
                self._lease_ms,
                # (on one server: the prefix's mark, checked (or put back) in the same step;
                # a Cluster keeps it in another slot, and the heartbeat checks it instead)
                "" if isinstance(client, RedisCluster) else self._marker,
                len(refs or ()),
                *[ref.qfield(self.prefix) for ref in refs or ()],
                *[encode_entry(ref) for ref in refs or ()],
                f"{self._base(session)}:t",
                "" if self._key is None else self._mark,
                self._settle_ms,
            ]

        args = arguments(entry) if entry.head else []
        commit = self._conn.scripts["commit"]
        ms = self._part_ms
        sets = [
            ("SET", part, value[0] if len(value) == 1 else Joined(value), "PX", ms, "NX")
            for part, value in zip(parts, values, strict=True)
        ]
        heads = -(-head_len // vs)  # the values that hold the head, sent once it is sealed

        async def sealed() -> list[tuple[Any, ...]]:
            """Seal the head, then the commands that send it and commit the segment."""
            nonlocal entry, args
            if not entry.head:
                assert seal is not None
                await seal()  # (every value but the head's is in flight meanwhile)
                entry = msgspec.structs.replace(entry, head=bytes(data[:head_len]))
                self._attempts[key] = Attempt(entry, known.id, header)
                args = arguments(entry)
            return [*sets[:heads], ("EVALSHA", commit.sha, len(keys), *keys, *args)]

        handed = Handed()
        try:
            with anyio.fail_after(self._timeout):
                # one round trip: the values, then the commit, which the server runs after
                # them and which checks that they all arrived
                # (a Cluster client refuses scripts in pipelines: two round trips there)
                cluster = isinstance(client, RedisCluster)
                if isinstance(client, RedisCluster):
                    handed.any = True  # (its pipeline does not say)
                    assert entry.head  # (see write_pieces)
                    async with client.pipeline(transaction=False) as pipe:
                        for part, value in zip(parts, values, strict=True):
                            one = value[0] if len(value) == 1 else b"".join(value)
                            pipe.set(part, one, px=ms, nx=True)
                        results = await pipe.execute(raise_on_error=False)
                elif entry.head:  # (the values without the transport's copies: pipelined)
                    results = await pipelined(
                        client, [*sets[heads:], *await sealed()], handed=handed
                    )
                else:  # the values the head is not in go out while it is sealed
                    results = await pipelined(client, sets[heads:], then=sealed, handed=handed)
                for failed in results[: len(parts)]:  # a value refused (out of memory)
                    if isinstance(failed, Exception):
                        raise failed  # (the commit step found it missing: nothing committed)
                reply = await commit(keys=keys, args=args) if cluster else results[-1]
                if isinstance(reply, NoScriptError):  # the server lost its script cache
                    reply = await commit(keys=keys, args=args)
                elif isinstance(reply, Exception):
                    raise reply
        except (RedisError, OSError) as exc:
            # (nothing handed to a connection: it could not connect, and nothing was made)
            made = await self._resolve(key, entry) if handed.any else False
            error = self._io_error(f"write segment {seq} ({length:,} bytes)", exc)
            if made is None:  # (the server may have run it before the deadline)
                raise TierIOError(
                    self.name,
                    error.action,
                    f"{error.reason}, and the server could not be asked since whether the "
                    f"commit was made",
                    hint="it may have been made all the same: load the conversation to learn "
                    "whether the turn is in its history",
                    maybe_committed=True,
                ) from exc
            if not made:
                raise error from exc
            reply = [1, 0, -1]  # committed after all: its reply was lost
        finally:
            # the client may keep the command's arguments: let go of the caller's buffer
            for view in views:
                view.release()
        self._conn.clock(reply[1])
        await self._after_commit(key, entry, known, writer, reply, start, refs)

    async def _resolve(self, key: SegmentKey, entry: Entry) -> bool | None:
        """Whether a commit whose reply did not come was made, asking the server until it
        answers, for up to :data:`_RESOLVE_TIMEOUT` seconds (the write's deadline has
        passed: a commit not made by now never will be); ``None`` when it did not answer
        (the attempt stays recorded, and a retry or a refresh settles it)."""
        end = time.monotonic() + _RESOLVE_TIMEOUT
        while True:
            client = self._conn.client
            if client is None:
                return None
            left = end - time.monotonic()
            with contextlib.suppress(RedisError, OSError):  # (TimeoutError too)
                with anyio.fail_after(min(left, self._timeout)):
                    got = await client.hget(self._manifest(key[0]), f"k:{key[1]}")
                return text(got) == entry.kfield if got is not None else False
            if end - time.monotonic() < 0.05:
                return None
            await anyio.sleep(0.05)  # (the server restarting: ask again)

    async def _after_commit(
        self,
        key: SegmentKey,
        entry: Entry,
        known: Manifest,
        writer: Writer,
        reply: Sequence[Any],
        start: float,
        refs: list[Ref] | None = None,
    ) -> None:
        """Settle a commit's reply (``known`` and ``writer``: what the commit was made
        with; another call may have replaced them meanwhile)."""
        session, seq = key
        code = int(reply[0])
        if code >= 0:
            v = to_int(reply[2])
            extended = v == known.v + 1  # (this commit alone moved the version on)
            current = self._known.get(session) is known
            # the cache's history was the one this extended: it is the new one now
            adopted = self._adopted.get(session)
            carried = adopted is not None and (adopted.id, adopted.v) == (known.id, known.v)
            if extended and (current or carried):
                head, _ = parse_header(entry.head, "a committed segment")
                for ref in refs or ():
                    known.base.append(ref)
                    known.base_headers.append(parse_header(ref.entry.head, "a reference")[0])
                    if current:
                        self._hold((ref.owner, ref.seq), ref.entry, ref.owner_id, session)
                known.entries.append(entry)
                known.headers.append(head)
                known.v = v
                if carried:
                    self._adopted[session] = known
            if not (extended and current):
                # the version moved on, or another call changed the view: read it again
                self._stale.add(session)  # (before the next commit)
            writer.lease_until = self._lease_from(start)
            writer.history = True
            self._commit_local(key, entry, known.id)
            self._counters.writes += 1
            self._counters.bytes_written += entry.length
            return
        if code in (-1, -2, -4, -8, -9):
            self._attempts.pop(key, None)  # refused for good: its parts are gone
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
        if code == -2:
            if self._known.get(session) is known:
                del self._known[session]
            self._adopted.pop(session, None)  # (another history there: read it first)
            self._counters.conflicts += 1
            raise HistoryConflictError(
                self.name,
                session,
                f"the shared tier holds version {to_int(reply[3])} of its history "
                f"({to_int(reply[4])} turn(s)), not version {known.v} ({known.n} turn(s)) that "
                f"this replica extends",
                shared_turns=to_int(reply[4]),
            )
        if code == -3:
            # (try again once the holder's liveness could have run out, if it is gone)
            retry_in = min(max(0, to_int(reply[2])) / 1000, self._liveness)
            if len(reply) > 3 and await self.reclaim(session, text(reply[3])):
                retry_in = 0.0  # the replica it waited for is gone: commit at once
            raise CommitDelayedError(self.name, session, retry_in)
        if code in _SETTLING:
            raise CommitDelayedError(
                self.name, session, max(0, to_int(reply[2])) / 1000, why=_SETTLING[code]
            )
        if code == -4:
            raise _Vanished
        if code in (-8, -9):
            self._counters.conflicts += 1
            raise HistoryConflictError(
                self.name,
                session,
                "the history the fork starts from is no longer in the shared tier (its "
                "conversation was dropped, or the server evicted or lost it)"
                if code == -8
                else "the conversation was dropped while forks still list its history, which "
                "stays in the shared tier under its key for them; store the new conversation "
                "under another key",
            )
        if code == -7:
            self._attempts.pop(key, None)  # refused for good: its parts are gone
            self._counters.refused += 1
            raise UnauthenticatedWriterError(self.name, session)
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
        fields = await self._conn.manifest(self._manifest(session))
        self._stale.discard(session)
        try:
            m = (
                parse(fields, session, self._key, self._where(session), self.prefix)
                if fields
                else None
            )
        except Damaged:
            m = None
        if m is None:
            self._known.pop(session, None)
            self._adopted.pop(session, None)
        else:
            self._reconcile(session, m)
            self._known[session] = m
            self._adopt_fenced(session, m)
