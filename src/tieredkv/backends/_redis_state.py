"""What a Redis tier knows of the conversations on its server: the state that its lease,
commit and read paths (:mod:`._redis_lease`, :mod:`._redis_commit`, :mod:`._redis_read`)
share, and the bookkeeping every one of them does on it.

Per conversation a tier keeps the manifest as it last committed or read it (``_known``),
its writer lease if it holds one (``_writers``), the writes whose commit's outcome it has
not learned yet (``_attempts``), and whether the manifest must be read again before the
next commit (``_stale``); per segment, the committed entries it counts and may read
(``_index``) and the reservations of segments being written (``_reserved``).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from ..errors import HistoryConflictError, TierIOError
from ..payload import SegmentHeader
from ._redis_client import Client, Connection
from .base import SegmentKey
from .redis_manifest import Entry, Manifest, conversation_tag

__all__ = ["LEASE_MARGIN", "Attempt", "Counters", "Replica", "Writer"]

LEASE_MARGIN = 0.9
"""A replica counts its lease as ending after this share of ``lease_ttl`` from the moment
it sent the request that set it (the server counts from when it ran it, later): a margin
for the two clocks' rates."""


@dataclass
class Writer:
    token: int
    lease_until: float
    """By this process's monotonic clock: until then no other replica can commit."""
    history: bool = False
    """Whether a committed history was known under this lease (acquired over one, read
    with ``take``, or committed here): if the store then holds none, it was lost, even
    after this tier dropped its view of it (a stale view, say: a fork listed another
    history's turn under the key) and knows no manifest to compare with."""
    lost: bool = False
    """Whether the store was found holding none of that history (counted once)."""


@dataclass
class Attempt:
    """A segment written whose commit's outcome this tier has not learned yet."""

    entry: Entry
    mid: str
    header: SegmentHeader


@dataclass
class Counters:
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    corrupt: int = 0
    missing: int = 0
    refused: int = 0
    conflicts: int = 0
    lost: int = 0


class Replica:
    """A Redis tier's view of its server's conversations, over its :class:`Connection`
    (the arguments: :class:`~tieredkv.backends.redis.RedisTier`'s, checked)."""

    def __init__(
        self,
        conn: Connection,
        *,
        name: str,
        prefix: str,
        value_size: int,
        owner: str,
        key: bytes | None,
        capacity: int,
        lease_ttl: float,
        liveness: float,
        part_ttl: float,
        read_batch: int,
        recover: bool,
    ) -> None:
        self.url = conn.url
        self.name = name
        self.prefix = prefix
        self.value_size = value_size
        self.owner = owner
        self._key = key
        self._conn = conn
        self._capacity = capacity
        self._timeout = conn.timeout
        self._lease_ttl = lease_ttl
        self._lease_ms = round(lease_ttl * 1000)
        self._liveness = liveness
        self._marked = False
        """(Without a secret) whether the prefix was found authenticated: this tier may
        not write (see :meth:`Leases.check_unmarked`)."""
        self._alive_until = 0.0
        """Until when (this process's monotonic clock) the server may still hold this
        replica's liveness key, by its last heartbeat that came back."""
        self._beating = True
        """Whether the last heartbeat came back (a change either way is logged)."""
        self._evicting = False
        """Whether the server evicts keys (a ``maxmemory`` and a policy other than
        ``noeviction``, as the last heartbeat found): it may forget a lease or a liveness
        key, so no lease proves this replica's copy current (see
        :meth:`Leases.may_serve_local`)."""
        self._part_ms = round(part_ttl * 1000)
        self._batch = read_batch
        self._recover = recover
        self._index: dict[SegmentKey, Entry] = {}
        """The committed segments this cache counts (and may read): every conversation's
        own, and the ones a fork it knows inherits (under their owners' keys)."""
        self._markers: dict[SegmentKey, int] = {}
        """Retirement markers the cache wrote (kept here only: on the server, a dropped
        parent's segments that forks list are kept by their reference sets), and their
        lengths."""
        self._holders: dict[SegmentKey, set[str]] = {}
        """Per indexed segment, the conversations whose known manifest lists it (its
        owner's, and forks'): it leaves the index with the last of them."""
        self._origin: dict[SegmentKey, str] = {}
        """Per indexed segment, the id of the owner's manifest that committed it."""
        self._reserved: dict[SegmentKey, int] = {}
        self._committed: set[SegmentKey] = set()
        """Indexed segments this tier committed itself (not learned from a manifest read)."""
        self._known: dict[str, Manifest] = {}
        """Per conversation, the manifest as this tier last committed or read it."""
        self._adopted: dict[str, Manifest] = {}
        """Per conversation, the manifest whose history the cache's copy is (the cache
        read it through :meth:`Leases.refresh` and made its copies agree, this tier found
        it at open, or it is one fenced by this replica's token: the cache's own turns
        since): the only proof :meth:`Leases.acquire` offers the server. ``_known`` may be
        newer: a look-up the cache did not reconcile (a fork's owner, the forks listing a
        key, a commit's reread) learns another replica's history there, which this
        replica's copy is not."""
        self._writers: dict[str, Writer] = {}
        self._attempts: dict[SegmentKey, Attempt] = {}
        self._stale: set[str] = set()
        """Conversations whose manifest must be read again before this tier commits."""
        self._used = 0
        self._counters = Counters()

    def _check_open(self) -> Client:
        return self._conn.check_open()

    def _base(self, session: str) -> str:
        return f"{self.prefix}:{{{conversation_tag(session)}}}"

    def _manifest(self, session: str) -> str:
        return f"{self._base(session)}:m"

    @property
    def _mark(self) -> str:
        """The value a tier with a secret marks its prefix with (derived from the secret)."""
        assert self._key is not None
        return hmac.new(self._key, b"tieredkv authenticated prefix", hashlib.sha256).hexdigest()[
            :32
        ]

    @property
    def _settle_ms(self) -> int:
        """How long (ms) a prefix must have been seen unmarked before a tier without a
        secret commits to it (see the ``COMMIT`` step): thrice its liveness, nine times the
        interval at which replicas with the secret put the mark back (a server that
        restarted empty forgot it), so that a replica slowed by a loaded machine still
        does so first."""
        return max(1, round(3 * self._liveness * 1000))

    async def _put_mark(self, client: Client) -> None:
        """Mark the prefix authenticated if it is not (a tier with a secret); where this
        put the mark back, the prefix no longer counts as long unmarked (see ``SETTLE``)."""
        if await client.set(self._marker, self._mark, nx=True) and not self._conn.cluster:
            await client.delete(f"{self._marker}:unmarked")

    @property
    def _marker(self) -> str:
        """The key that says the prefix is authenticated (see ``RedisTier``'s open)."""
        return f"{self.prefix}:auth"

    def _live_key(self, owner: str) -> str:
        """The key a replica's heartbeat keeps alive (see :meth:`Leases.beat`)."""
        return f"{self.prefix}:live:{owner}"

    def _parts(self, key: SegmentKey, entry: Entry) -> list[str]:
        base = f"{self._base(key[0])}:{key[1]}:{entry.nonce}"
        return [f"{base}:{i}" for i in range(entry.parts)]

    def _io_error(self, action: str, exc: BaseException) -> TierIOError:
        return self._conn.io_error(action, exc)

    def _where(self, session: str) -> str:
        return f"{self.url} {self._base(session)}"

    def _lease_from(self, sent: float) -> float:
        """When a lease set by a request sent at ``sent`` ends, by this process's clock."""
        return sent + LEASE_MARGIN * self._lease_ttl

    def _absorb(self, m: Manifest, *, inherited: bool = True) -> None:
        """Make ``m`` what this tier knows of its conversation, and index its segments (a
        fork's: the ones it inherits too, unless ``inherited`` is false: an open's scan,
        which indexes each owner's segments through the owner's own manifest)."""
        self._known[m.session] = m
        self._stale.discard(m.session)
        self._forget(m.session)
        for ref in m.base if inherited else ():
            self._hold((ref.owner, ref.seq), ref.entry, ref.owner_id, m.session)
        for seq, entry in enumerate(m.entries, m.first):
            self._hold((m.session, seq), entry, m.id, m.session)

    def _hold(self, key: SegmentKey, entry: Entry, mid: str, by: str) -> None:
        """Index segment ``key`` (``entry``, committed in manifest ``mid``) as listed by
        ``by``. Another segment indexed under the same key (a history the owner no longer
        has) takes the views that listed it out: they are read again before they are used."""
        held = self._index.get(key)
        if held is not None and (held.kfield, self._origin[key]) != (entry.kfield, mid):
            for other in sorted(self._holders.get(key, set()) - {by}):
                self._drop_view(other, keep_writer=True)
                self._stale.add(other)
            held = self._index.get(key)
            self._committed.discard(key)
        if held is None:
            self._index[key] = entry
            self._origin[key] = mid
            self._used += entry.length
        self._holders.setdefault(key, set()).add(by)

    def _unhold(self, key: SegmentKey, by: str | None = None) -> None:
        """``by`` no longer lists ``key`` (``None``: none does): it leaves the index with
        the last conversation that listed it."""
        holders = self._holders.get(key)
        if holders is not None and by is not None:
            holders.discard(by)
            if holders:
                return
        self._holders.pop(key, None)
        self._origin.pop(key, None)
        self._committed.discard(key)
        entry = self._index.pop(key, None)
        if entry is not None:
            self._used -= entry.length

    def _forget(self, session: str) -> None:
        """Drop this tier's index entries for ``session`` (not the server's data): the
        segments it lists that no other known conversation lists."""
        for key in [k for k, holders in self._holders.items() if session in holders]:
            self._unhold(key, session)

    def _reconcile(self, session: str, m: Manifest) -> None:
        """Settle the writes of ``session`` whose outcome was unknown, from its manifest."""
        for key in [k for k in self._attempts if k[0] == session]:
            attempt = self._attempts[key]
            if attempt.mid != m.id or key[1] < m.n:
                del self._attempts[key]  # committed (the entry names it) or never will be

    def _drop_view(self, session: str, *, keep_writer: bool = False) -> None:
        self._known.pop(session, None)
        self._adopted.pop(session, None)
        self._stale.discard(session)
        self._forget(session)
        if not keep_writer:
            self._writers.pop(session, None)

    def _adopt_fenced(self, session: str, m: Manifest) -> None:
        """``m`` was just read: fenced with this replica's token, it holds what the cache
        adopted when this replica took the lease and the turns this tier committed since
        (no other replica can commit under the fence), so it is the cache's history."""
        writer = self._writers.get(session)
        if writer is not None and m.fence == writer.token:
            self._adopted[session] = m

    def _drop_writer(self, session: str, writer: Writer) -> None:
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
