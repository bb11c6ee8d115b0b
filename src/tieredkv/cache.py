"""TieredKVCache: the async facade over tiers, eviction policies and the metadata channel.

One conversation ("session") = an append-only list of segments, one per turn. A session's
complete history lives in one *primary* tier (the one loads are served from); in inclusive
mode lower tiers may also hold a copy. Tiers are ordered: index 0 is the performance tier
(host memory), the rest are capacity tiers (SSD, mmap).

Flow of one turn (see docs/explanation/architecture.md)::

    load(session)   -> promote the history into tier 0 if it fits (evicting others down),
                       then copy it out, joined along the token dimension
    append(session) -> write the new segment into the session's primary tier, evicting
                       others down if needed; in inclusive mode, copy it to the next tier in
                       the background (write-through)

Guarantees:

* per-session operations are serialized (a per-session lock), different sessions run
  concurrently;
* every move is all-or-nothing: a copy is registered only once it is complete, and the
  source is removed only after that; a failed or cancelled operation releases whatever it
  reserved, so no tier leaks space and nothing committed is lost;
* blocking I/O and large copies run in worker threads (each tier has its own limiter).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import msgspec
import torch

from .backends.arena import INLINE_COPY, close_mapping
from .backends.base import AddressableTier, SegmentKey, Tier, TierStats
from .errors import (
    CapacityError,
    ClosedError,
    CorruptSegmentError,
    SchemaMismatchError,
    SessionNotFoundError,
    TierIOError,
)
from .meta import (
    Demoted,
    Dropped,
    Evicted,
    KVMeta,
    Loaded,
    MetadataChannel,
    Promoted,
    Stored,
    TierInfo,
    Transfer,
)
from .payload import Schema, SegmentHeader, dtype_of, plan_segment, segment_tensors
from .policies.base import Eviction
from .policies.lru import LRU
from .policies.registry import make_eviction

__all__ = ["CacheStats", "TieredKVCache"]

_log = logging.getLogger(__name__)


class CacheStats(msgspec.Struct, kw_only=True):
    """Counters of a :class:`TieredKVCache` since it was opened.

    :param hits: loads served from the performance tier (tier 0)
    :param misses: loads of a stored session served from a lower tier (promoted or not),
        plus loads that found the history damaged
    :param appends: segments stored
    :param loads: successful loads
    :param prefetches: prefetch calls that moved data up
    :param promotions: sessions moved up to tier 0
    :param demotions: sessions moved down a tier (or whose lower copy became primary)
    :param evictions: copies removed from a tier to make room
    :param lost: sessions whose last copy was evicted (their KV must be recomputed)
    :param drops: sessions dropped by the application
    :param corrupt: segments that failed verification (never served)
    :param write_through: segments copied down in the background (inclusive mode)
    :param errors: I/O errors reported while moving data (the data stayed where it was)
    :param tiers: each tier's own counters, including bytes read and written
    """

    hits: int = 0
    misses: int = 0
    appends: int = 0
    loads: int = 0
    prefetches: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    lost: int = 0
    drops: int = 0
    corrupt: int = 0
    write_through: int = 0
    errors: int = 0
    tiers: tuple[TierStats, ...] = ()

    @property
    def hit_ratio(self) -> float:
        """hits / (hits + misses), or 0.0 before any load."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class _Seg:
    __slots__ = ("header", "length")

    def __init__(self, header: SegmentHeader) -> None:
        self.header = header
        self.length = header.length


class _Session:
    __slots__ = ("cond", "dropped", "held", "inflight", "key", "primary", "schema", "segs")

    def __init__(self, key: str, ntiers: int) -> None:
        self.key = key
        self.schema: Schema | None = None
        self.segs: list[_Seg] = []
        self.held: list[set[int]] = [set() for _ in range(ntiers)]
        self.primary: int | None = None
        self.cond = anyio.Condition()
        self.inflight = 0
        self.dropped = False

    def nbytes(self) -> int:
        return sum(seg.length for seg in self.segs)

    def tokens(self) -> int:
        return sum(seg.header.tokens for seg in self.segs)

    def complete(self, t: int) -> bool:
        return len(self.held[t]) == len(self.segs) and bool(self.segs)


class TieredKVCache:
    """History KV of multi-turn conversations, kept in tiers (host memory, SSD, mmap).

    :param tiers: the tiers, performance tier first (e.g. ``[HostMemoryTier(...),
        SSDTier(...)]``); names must be unique
    :param eviction: the policy that chooses what leaves tier 0 (default :class:`LRU`), as
        an object or a registry name (``"bidaw"``, ``"queue-enhanced"``, ...), or one policy
        per tier; lower tiers default to LRU
    :param mode: ``"exclusive"`` (a session's KV is in exactly one tier; moving down writes
        it) or ``"inclusive"`` (write-through: every segment is also copied to the next tier
        in the background, so evicting from memory costs no write on the critical path, and
        promoting keeps the lower copy)
    :param token_dim: the dimension along which a session's segments are joined (per
        tensor; negative counts from the end); :meth:`append` can override it
    :param clock: time source for metadata and policies (``time.monotonic``)
    :param channel: a metadata channel to share (one is created otherwise)

    Use it as an async context manager::

        async with TieredKVCache([HostMemoryTier(1 << 30), SSDTier(path, 64 << 30)]) as cache:
            await cache.append("user-1", {"k": k, "v": v}, answer_tokens=45)
            history = await cache.load("user-1")
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        eviction: Eviction | str | Sequence[Eviction | str] | None = None,
        mode: Literal["exclusive", "inclusive"] = "exclusive",
        token_dim: int = 0,
        clock: Callable[[], float] = time.monotonic,
        channel: MetadataChannel | None = None,
    ) -> None:
        tiers = list(tiers)
        if not tiers:
            raise ValueError("TieredKVCache needs at least one tier")
        for tier in tiers:
            if not isinstance(tier, Tier):
                raise TypeError(f"{tier!r} does not implement the Tier protocol")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if mode not in ("exclusive", "inclusive"):
            raise ValueError(f"mode must be 'exclusive' or 'inclusive', not {mode!r}")
        if isinstance(eviction, Sequence) and not isinstance(eviction, str):
            policies = [make_eviction(p) if isinstance(p, str) else p for p in eviction]
            if len(policies) != len(tiers):
                raise ValueError(
                    f"got {len(policies)} eviction policies for {len(tiers)} tiers; pass one "
                    f"policy (for tier 0) or one per tier"
                )
        else:
            if isinstance(eviction, str):
                top = make_eviction(eviction)
            else:  # not `eviction or LRU()`: an empty policy may be falsy (it has __len__)
                top = eviction if eviction is not None else LRU()
            policies = [top] + [LRU() for _ in tiers[1:]]
        for policy in policies:
            if not isinstance(policy, Eviction):
                raise TypeError(f"{policy!r} does not implement the Eviction protocol")
        if len({id(p) for p in policies}) != len(policies):
            raise ValueError("each tier needs its own eviction policy instance")
        self._tiers = tiers
        self._policies = policies
        self._mode = mode
        self._token_dim = token_dim
        self._clock = clock
        self.channel = channel if channel is not None else MetadataChannel()
        """The metadata channel: per-session :class:`~tieredkv.meta.KVMeta` and events."""
        self._sessions: dict[str, _Session] = {}
        self._busy: Counter[str] = Counter()
        self._stats = CacheStats()
        self._tasks: set[asyncio.Task[None]] = set()
        self._protected: Callable[[], AbstractSet[str]] = frozenset
        self._open = False
        self._pending = 0
        self._idle_event: anyio.Event | None = None  # created on open (needs a running loop)

    # -- lifecycle -----------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Open every tier and rebuild the index from what persistent tiers kept."""
        if self._open:
            return
        opened: list[Tier] = []
        recovered: list[list[SegmentHeader]] = []
        try:
            for tier in self._tiers:
                recovered.append(await tier.open())
                opened.append(tier)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for tier in opened:
                    await tier.aclose()
            raise
        self.channel.set_tiers(
            TierInfo(name=t.name, level=i, capacity=t.capacity) for i, t in enumerate(self._tiers)
        )
        self._open = True
        self._idle_event = anyio.Event()
        self._idle_event.set()
        with anyio.CancelScope(shield=True):
            await self._recover(recovered)

    async def aclose(self) -> None:
        """Finish background write-through, then close every tier."""
        if not self._open:
            return
        try:
            with anyio.CancelScope(shield=True):
                await self.flush()
        finally:
            self._open = False
            for task in tuple(self._tasks):  # none unless flush was interrupted
                task.cancel()
            with anyio.CancelScope(shield=True):
                for tier in self._tiers:
                    try:
                        await tier.aclose()
                    except Exception:
                        _log.exception("closing tier %r failed", tier.name)
            self._sessions.clear()
            self._busy.clear()

    async def flush(self) -> None:
        """Wait until every background write-through started so far has finished."""
        self._check_open()
        while self._pending and self._idle_event is not None:
            await self._idle_event.wait()

    def _check_open(self) -> None:
        if not self._open:
            raise ClosedError("TieredKVCache")

    def set_protected(self, sessions: Callable[[], AbstractSet[str]] | None) -> None:
        """Never evict the sessions ``sessions()`` returns (asked at each eviction).

        An engine passes its scheduler's ready sessions (``scheduler.ready_sessions``), so
        KV that was just loaded for a request about to run is not evicted before it runs.
        ``None`` removes the hook.
        """
        self._protected = sessions if sessions is not None else frozenset

    # -- public queries ------------------------------------------------------------------
    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, performance tier first."""
        return tuple(self._tiers)

    @property
    def mode(self) -> str:
        """``"exclusive"`` or ``"inclusive"``."""
        return self._mode

    def where(self, session: str) -> str | None:
        """Name of the tier that serves the session's loads, or ``None`` if it is stored nowhere."""
        s = self._sessions.get(session)
        if s is None or s.primary is None:
            return None
        return self._tiers[s.primary].name

    def contains(self, session: str) -> bool:
        """Whether the session's history is stored in some tier."""
        return self.where(session) is not None

    def __contains__(self, session: object) -> bool:
        return isinstance(session, str) and self.contains(session)

    def sessions(self) -> list[str]:
        """Keys of the sessions stored in some tier."""
        return [k for k, s in self._sessions.items() if s.primary is not None]

    def stats(self) -> CacheStats:
        """A snapshot of the counters, with each tier's own."""
        return msgspec.structs.replace(
            self._stats, tiers=tuple(tier.stats() for tier in self._tiers)
        )

    # -- append --------------------------------------------------------------------------
    async def append(
        self,
        session: str,
        tensors: Mapping[str, Any],
        *,
        answer_tokens: int,
        token_dim: int | None = None,
        codec: str = "kv",
    ) -> KVMeta:
        """Store one turn's new KV segment and record the model's answer length.

        :param session: the conversation's key (any non-empty text)
        :param tensors: named torch tensors or numpy arrays (CPU or CUDA), all with the same
            number of tokens along ``token_dim``; every turn of a session must use the same
            names, dtypes and non-token shapes
        :param answer_tokens: tokens the model generated in this turn (Bidaw's eviction
            signal for the next access)
        :param token_dim: the token dimension for this call (default: the cache's)
        :param codec: what the tensors hold (``"kv"``; storage-efficient codecs use their
            own name), recorded with the segment
        :returns: the session's metadata after the append
        :raises SchemaMismatchError: the tensors disagree with the session's earlier turns
            (the session is untouched)
        :raises CapacityError: the segment (or the session with it) fits in no tier
            (nothing is stored)
        :raises TierIOError: a tier failed while making room or writing (nothing is lost:
            what was stored stays where it was)
        """
        self._check_open()
        _check_key(session)
        dim = self._token_dim if token_dim is None else token_dim
        while True:
            s = self._sessions.get(session)
            if s is None:
                s = self._sessions[session] = _Session(session, len(self._tiers))
            async with self._hold(s):
                if self._sessions.get(session) is not s:  # dropped while we waited
                    continue
                try:
                    return await self._append_locked(s, tensors, answer_tokens, dim, codec)
                finally:
                    if not s.segs and session not in self.channel:  # a first append failed
                        self._sessions.pop(session, None)

    async def _append_locked(
        self, s: _Session, tensors: Mapping[str, Any], answer_tokens: int, dim: int, codec: str
    ) -> KVMeta:
        session = s.key
        began = self._clock()
        if s.primary is None and s.segs:  # lost or damaged earlier: start afresh
            s.segs.clear()
        plan = plan_segment(
            session,
            len(s.segs),
            tensors,
            token_dim=dim,
            answer_tokens=answer_tokens,
            codec=codec,
            created=time.time(),
        )
        if s.schema is not None and s.segs:
            diff = s.schema.describe_difference(plan.schema)
            if diff is not None:
                raise SchemaMismatchError(session, diff)
        largest = max(t.capacity for t in self._tiers)
        if plan.length + s.nbytes() > largest:
            what = "the segment" if not s.segs else "the session with this segment"
            raise CapacityError(what, plan.length + s.nbytes(), largest)
        key = (session, plan.header.seq)
        t = 0 if s.primary is None else s.primary
        try:
            while True:
                protect = {session}
                if await self._reserve(t, key, plan.length, protect):
                    break
                if t + 1 >= len(self._tiers):
                    raise CapacityError(
                        "the segment",
                        plan.length,
                        self._tiers[t].capacity - self._tiers[t].used,
                    )
                if s.primary == t:
                    # the session itself no longer fits here: move it down whole
                    await self._wait_quiet(s)
                    await self._demote(s, t, may_lose=False)
                t += 1
            with anyio.CancelScope(shield=True):
                await self._write_new(t, key, plan.write_into, plan.length)
                s.segs.append(_Seg(plan.header))
                s.held[t].add(plan.header.seq)
                s.schema = plan.schema
                if s.primary is None:
                    s.primary = t
        finally:
            self._tiers[t].release(key)
        self._stats.appends += 1
        now = self._clock()
        meta = self._publish(s, now, access=True, answer=answer_tokens)
        # the access first, then the admission (as the replay does): a policy must see a new
        # session's first turn as its first access, not as a reuse at distance 0
        for policy in self._policies:
            policy.on_access(session, meta, now)
        self._policies[t].on_admit(session, meta, now)
        self.channel.emit(
            Stored(
                session=session,
                time=now,
                nbytes=plan.length,
                tier=self._tiers[t].name,
                tokens=plan.header.tokens,
                seconds=now - began,
            )
        )
        if self._mode == "inclusive" and t + 1 < len(self._tiers):
            self._start_write_through(s, t + 1)
        return meta

    async def _write_new(
        self, t: int, key: SegmentKey, fill: Callable[[memoryview], None], length: int
    ) -> None:
        tier = self._tiers[t]
        if isinstance(tier, AddressableTier):
            await _run(fill, tier.view(key), big=length > INLINE_COPY)
            tier.commit(key)
            return
        with _scratch(length) as view:
            await _run(fill, view, big=length > INLINE_COPY)
            await tier.write(key, view)

    # -- load ----------------------------------------------------------------------------
    async def load(self, session: str) -> dict[str, torch.Tensor]:
        """The session's whole history, segments joined along the token dimension.

        The result is new host-memory tensors (the caller owns them), byte-identical to what
        was appended. If the history is on a lower tier it is first promoted to tier 0
        (evicting other sessions down) when it fits there.

        :raises SessionNotFoundError: (a ``KeyError``) if the session has no KV in any tier,
            including when its stored history was found damaged (it then counts as a miss)
        """
        out: dict[str, torch.Tensor] = {}

        def alloc(schema: Schema, tokens: int) -> dict[str, torch.Tensor]:
            for name, dt, shape in zip(schema.names, schema.dtypes, schema.shapes, strict=True):
                full = tuple(tokens if d == -1 else d for d in shape)
                out[name] = torch.empty(full, dtype=dtype_of(dt))
            return out

        await self._load(session, alloc)
        return out

    async def load_into(self, session: str, out: Mapping[str, torch.Tensor]) -> int:
        """Copy the session's history into caller-provided tensors; return its token count.

        ``out`` must have the session's tensor names and dtypes, the same non-token shape,
        and at least as many positions along the token dimension as the history has tokens
        (the history fills the leading positions; the rest is left untouched). Tensors may
        be on a CUDA device: the copy then comes from the (pinned) host tier.

        :raises SessionNotFoundError: as for :meth:`load`
        :raises ValueError: if ``out`` does not fit the history (nothing is moved)
        """

        def check(schema: Schema, tokens: int) -> dict[str, torch.Tensor]:
            if set(out) != set(schema.names):
                raise ValueError(
                    f"out has tensors {sorted(out)}, the session stores {sorted(schema.names)}"
                )
            for name, dt, shape in zip(schema.names, schema.dtypes, schema.shapes, strict=True):
                t = out[name]
                want = dtype_of(dt)
                if t.dtype != want:
                    raise ValueError(f"out[{name!r}] is {t.dtype}, the session stores {want}")
                dim = schema.token_dim
                got = tuple(-1 if i == dim else d for i, d in enumerate(t.shape))
                if got != shape or t.shape[dim] < tokens:
                    raise ValueError(
                        f"out[{name!r}] has shape {tuple(t.shape)}; it needs "
                        f"{tuple(tokens if d == -1 else d for d in shape)} or more positions "
                        f"along dim {dim}"
                    )
            return dict(out)

        return await self._load(session, check)

    async def _load(
        self, session: str, target: Callable[[Schema, int], dict[str, torch.Tensor]]
    ) -> int:
        self._check_open()
        s = self._sessions.get(session)
        if s is None or s.primary is None:
            raise SessionNotFoundError(session)
        async with self._hold(s):
            began = self._clock()
            if s.primary is None:
                raise SessionNotFoundError(session)
            assert s.schema is not None
            out = target(s.schema, s.tokens())
            hit = s.primary == 0
            try:
                if not hit:
                    await self._promote(s)
                await self._copy_out(s, out)
            except CorruptSegmentError:
                self._stats.misses += 1
                raise SessionNotFoundError(session) from None
            now = self._clock()
            if hit:
                self._stats.hits += 1
            else:
                self._stats.misses += 1
            self._stats.loads += 1
            meta = self._publish(s, now, access=True)
            for policy in self._policies:
                policy.on_access(session, meta, now)
            assert s.primary is not None
            self.channel.emit(
                Loaded(
                    session=session,
                    time=now,
                    nbytes=meta.nbytes,
                    tier=self._tiers[s.primary].name,
                    hit=hit,
                    seconds=now - began,
                )
            )
            return s.tokens()

    async def _copy_out(self, s: _Session, out: dict[str, torch.Tensor]) -> None:
        """Copy every segment of ``s`` from its primary tier into ``out``."""
        assert s.primary is not None
        assert s.schema is not None
        tier = self._tiers[s.primary]
        dim = s.schema.token_dim
        cuda = any(t.is_cuda for t in out.values())
        if isinstance(tier, AddressableTier):
            # every segment in one worker-thread hop: a history has one segment per turn, and
            # each hop waits for the event loop (and the GIL) on a busy server
            parts = [(tier.view((s.key, seg.header.seq)), seg.header) for seg in s.segs]
            total = s.nbytes()
            await _run(_scatter_all, parts, out, dim, cuda, big=total > INLINE_COPY)
            note = getattr(tier, "note_read", None)
            if note is not None:
                for seg in s.segs:
                    note(seg.length)
        else:
            offset = 0
            for seg in s.segs:
                with _scratch(seg.length) as view:
                    await self._read(s, s.primary, (s.key, seg.header.seq), view)
                    await _run(_scatter, view, seg.header, out, dim, offset, False, big=True)
                offset += seg.header.tokens
        if cuda:
            await anyio.to_thread.run_sync(torch.cuda.synchronize)

    async def _read(self, s: _Session, t: int, key: SegmentKey, out: memoryview) -> None:
        """Read a committed segment; on damage, the session is lost from that tier."""
        try:
            await self._tiers[t].read_into(key, out)
        except CorruptSegmentError:
            with anyio.CancelScope(shield=True):
                await self._drop_damaged(s, t, f"segment {key[1]}")
            raise

    async def _drop_damaged(self, s: _Session, t: int, where: str) -> None:
        self._stats.corrupt += 1
        _log.warning("session %.80r: %s in tier %r is damaged", s.key, where, self._tiers[t].name)
        await self._forget_copy(s, t)

    # -- prefetch ------------------------------------------------------------------------
    async def prefetch(self, session: str) -> str | None:
        """Promote the session's history to tier 0 ahead of its load, if it fits there.

        :returns: the tier that now serves it (``None`` if it was found damaged)
        :raises SessionNotFoundError: if the session has no KV in any tier
        """
        self._check_open()
        s = self._sessions.get(session)
        if s is None or s.primary is None:
            raise SessionNotFoundError(session)
        async with self._hold(s):
            if s.primary is None:
                raise SessionNotFoundError(session)
            if s.primary != 0:
                try:
                    if await self._promote(s):
                        self._stats.prefetches += 1
                except CorruptSegmentError:
                    return None
            return self.where(session)

    async def _promote(self, s: _Session) -> bool:
        """Move ``s`` (locked) into tier 0 if it fits; ``True`` if it moved."""
        assert s.primary is not None
        src = s.primary
        top = self._tiers[0]
        total = s.nbytes()
        if src == 0 or total > top.capacity:
            return False
        keys = [(s.key, seg.header.seq) for seg in s.segs]
        reserved: list[SegmentKey] = []
        began = self._clock()
        self._set_transfer(
            s,
            Transfer(
                kind="promote", src=self._tiers[src].name, dst=top.name, nbytes=total, started=began
            ),
        )
        try:
            try:
                for key, seg in zip(keys, s.segs, strict=True):
                    if not await self._reserve(0, key, seg.length, {s.key}):
                        return False
                    reserved.append(key)
            except TierIOError:
                self._stats.errors += 1
                return False  # room could not be made: serve from where it is
            with anyio.CancelScope(shield=True):
                await self._copy_history(s, src, keys)
                for key in keys:
                    s.held[0].add(key[1])
                reserved.clear()
                s.primary = 0
                if self._mode == "exclusive":
                    await self._remove_copy(s, src)
        finally:
            with anyio.CancelScope(shield=True):  # cleanup must finish even when cancelled
                for key in reserved:
                    top.release(key)
                    if top.contains(key) and key[1] not in s.held[0]:
                        await top.delete(key)
            self._set_transfer(s, None)
        self._stats.promotions += 1
        now = self._clock()
        meta = self._publish(s, now)
        self._policies[0].on_admit(s.key, meta, now)
        self.channel.emit(
            Promoted(
                session=s.key,
                time=now,
                nbytes=total,
                src=self._tiers[src].name,
                dst=top.name,
                seconds=now - began,
            )
        )
        return True

    async def _copy_history(self, s: _Session, src: int, keys: list[SegmentKey]) -> None:
        """Copy ``s``'s segments from tier ``src`` into tier 0's reservations (and commit)."""
        top, frm = self._tiers[0], self._tiers[src]
        read_many = getattr(frm, "read_many_into", None)
        if not isinstance(top, AddressableTier) or read_many is None:
            for key in keys:
                await self._copy_segment(s, src, 0, key, frm.length(key))
            return
        try:  # the whole history in one tier call (one worker-thread hop)
            await read_many([(key, top.view(key)) for key in keys])
        except CorruptSegmentError as exc:
            with anyio.CancelScope(shield=True):
                await self._drop_damaged(s, src, exc.where)
            raise
        for key in keys:
            top.commit(key)

    async def _copy_segment(
        self, s: _Session, src: int, dst: int, key: SegmentKey, length: int
    ) -> None:
        """Copy one committed segment between tiers into ``dst``'s reservation (and commit)."""
        to = self._tiers[dst]
        frm = self._tiers[src]
        if isinstance(to, AddressableTier):
            await self._read(s, src, key, to.view(key))
            to.commit(key)
        elif isinstance(frm, AddressableTier):
            await to.write(key, frm.view(key))
        else:
            with _scratch(length) as view:
                await self._read(s, src, key, view)
                await to.write(key, view)

    # -- drop ----------------------------------------------------------------------------
    async def drop(self, session: str) -> None:
        """Forget the session: delete every copy of its history and its metadata.

        :raises SessionNotFoundError: if the cache does not know the session
        """
        self._check_open()
        s = self._sessions.get(session)
        if s is None:
            raise SessionNotFoundError(session)
        async with self._hold(s):
            s.dropped = True
            await self._wait_quiet(s)
            nbytes = s.nbytes()
            with anyio.CancelScope(shield=True):
                for t in range(len(self._tiers)):
                    await self._remove_copy(s, t)
            s.segs.clear()
            s.primary = None
            if self._sessions.get(session) is s:
                del self._sessions[session]
            self.channel.remove(session)
            self._stats.drops += 1
            self.channel.emit(Dropped(session=session, time=self._clock(), nbytes=nbytes))

    # -- making room ---------------------------------------------------------------------
    async def _reserve(
        self, t: int, key: SegmentKey, length: int, protect: set[str], *, lossless: bool = False
    ) -> bool:
        """Reserve ``length`` bytes in tier ``t``, evicting unprotected sessions as needed.

        With ``lossless``, only victims that keep a copy somewhere are moved (a background
        copy must never cost another session its only copy). When enough bytes are free but
        split into gaps, a tier that can (``defragment``, as the arena tiers) first moves
        idle sessions' segments aside, so that no session is evicted for want of one gap.
        """
        tier = self._tiers[t]
        if length > tier.capacity:
            return False
        skip = set(protect)
        defragment = getattr(tier, "defragment", None)
        busy = self._busy
        while not tier.reserve(key, length):
            short = length - (tier.capacity - tier.used)
            if (
                short <= 0
                and defragment is not None
                and defragment(length, lambda k: k[0] not in busy) is not None
                and tier.reserve(key, length)
            ):
                break
            short = max(short, 1)
            victims = self._policies[t].victims(
                short, self._clock(), self.channel, skip | self._busy.keys() | self._protected()
            )
            if not victims:
                return False
            for victim in victims:
                vs = self._sessions.get(victim)
                skip.add(victim)
                if vs is None or not vs.held[t]:
                    self._policies[t].on_remove(victim)  # stale entry
                    continue
                if victim in self._busy:
                    continue
                if lossless and vs.primary == t and t + 1 >= len(self._tiers):
                    continue
                try:
                    vs.cond.acquire_nowait()
                except anyio.WouldBlock:
                    continue
                self._busy[victim] += 1
                try:
                    with anyio.CancelScope(shield=True):
                        if vs.primary == t and t + 1 < len(self._tiers):
                            await self._demote(vs, t, may_lose=not lossless)
                        else:  # last tier, or a (possibly partial) lower copy
                            await self._evict_copy(vs, t)
                except CorruptSegmentError:
                    pass  # the victim turned out damaged; it is gone, and so is its space
                except CapacityError:
                    pass  # lossless, and the victim has nowhere to go: it stays
                finally:
                    _unbusy(self._busy, victim)
                    vs.cond.release()
        return True

    async def _demote(self, s: _Session, t: int, *, may_lose: bool = True) -> None:
        """Move primary ``s`` (locked) out of tier ``t`` into the next tier.

        If the next tier cannot make room, the copy in ``t`` is evicted (and the session
        lost) when ``may_lose``, else :class:`CapacityError` is raised and nothing changes.
        On an I/O error the session stays in ``t`` and the error propagates. A move is
        atomic: it runs shielded from cancellation (which lands once it is done).
        """
        with anyio.CancelScope(shield=True):
            await self._demote_shielded(s, t, may_lose)

    async def _demote_shielded(self, s: _Session, t: int, may_lose: bool) -> None:
        total = s.nbytes()
        now = self._clock()
        for u in range(t + 1, len(self._tiers)):
            if s.complete(u):  # inclusive: the lower copy takes over, no write needed
                await self._remove_copy(s, t)
                s.primary = u
                self._after_demote(s, t, u, total)
                return
        u = t + 1
        if u >= len(self._tiers):
            if not may_lose:
                raise CapacityError("the session", total, 0)
            await self._evict_copy(s, t)
            return
        dst = self._tiers[u]
        self._set_transfer(
            s,
            Transfer(
                kind="demote", src=self._tiers[t].name, dst=dst.name, nbytes=total, started=now
            ),
        )
        written: list[SegmentKey] = []
        reserved: list[SegmentKey] = []
        try:
            for seg in s.segs:
                key = (s.key, seg.header.seq)
                if seg.header.seq in s.held[u]:
                    continue
                if not await self._reserve(u, key, seg.length, {s.key}):
                    break
                reserved.append(key)
            else:
                for key in reserved:
                    await self._copy_segment(s, t, u, key, self._tiers[t].length(key))
                    written.append(key)
                for key in written:
                    s.held[u].add(key[1])
                written.clear()
                reserved.clear()
                await self._remove_copy(s, t)
                s.primary = u
                self._after_demote(s, t, u, total)
                return
        except TierIOError:
            self._stats.errors += 1
            raise
        finally:
            for key in reserved:
                dst.release(key)
            for key in written:
                await dst.delete(key)
            self._set_transfer(s, None)
        # the next tier cannot take it: the session is lost from this tier
        if not may_lose:
            raise CapacityError("the session", total, self._tiers[u].capacity - self._tiers[u].used)
        await self._evict_copy(s, t)

    def _after_demote(self, s: _Session, t: int, u: int, total: int) -> None:
        self._stats.demotions += 1
        now = self._clock()
        meta = self._publish(s, now)
        self._policies[u].on_admit(s.key, meta, now)
        self.channel.emit(
            Demoted(
                session=s.key,
                time=now,
                nbytes=total,
                src=self._tiers[t].name,
                dst=self._tiers[u].name,
            )
        )

    async def _evict_copy(self, s: _Session, t: int) -> None:
        """Remove ``s``'s copy from tier ``t`` to make room (lost if it was the last one)."""
        nbytes = s.nbytes()
        lost = await self._forget_copy(s, t)
        self._stats.evictions += 1
        self.channel.emit(
            Evicted(
                session=s.key,
                time=self._clock(),
                nbytes=nbytes,
                tier=self._tiers[t].name,
                lost=lost,
            )
        )

    async def _forget_copy(self, s: _Session, t: int) -> bool:
        """Remove the copy in ``t``; re-elect the primary; return whether the session is lost."""
        await self._remove_copy(s, t)
        if s.primary == t:
            s.primary = next((u for u in range(len(self._tiers)) if s.complete(u)), None)
        if s.primary is None:
            for u in range(len(self._tiers)):
                await self._remove_copy(s, u)  # partial copies are of no use
            s.segs.clear()
            self._stats.lost += 1
        self._publish(s, self._clock())
        return s.primary is None

    async def _remove_copy(self, s: _Session, t: int) -> None:
        """Delete ``s``'s segments in tier ``t``, highest first (a crash leaves a prefix)."""
        tier = self._tiers[t]
        for seq in sorted(s.held[t], reverse=True):
            await tier.delete((s.key, seq))
            s.held[t].discard(seq)
        self._policies[t].on_remove(s.key)

    # -- write-through -------------------------------------------------------------------
    def _start_write_through(self, s: _Session, dst: int) -> None:
        """Make sure a background pump is copying ``s``'s missing segments into ``dst``."""
        if s.inflight:  # the running pump picks up the new segment
            return
        # A plain asyncio task rather than a task group: the cache may be opened and closed
        # from different tasks (e.g. a framework's startup and shutdown hooks).
        s.inflight += 1
        self._busy[s.key] += 1
        self._pending += 1
        if self._pending == 1:
            self._idle_event = anyio.Event()
        task = asyncio.get_running_loop().create_task(self._write_through(s, dst))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_through(self, s: _Session, dst: int) -> None:
        """Copy ``s``'s segments into ``dst`` in order, until its copy there is complete.

        The copy is built as a prefix, so a copy that cannot be completed (no room, an I/O
        error) is removed rather than left to waste space.
        """
        to = self._tiers[dst]
        try:
            with anyio.CancelScope(shield=True):
                while not s.dropped and s.primary is not None and s.primary < dst:
                    src = s.primary
                    seg = next((g for g in s.segs if g.header.seq not in s.held[dst]), None)
                    if seg is None:
                        break
                    key = (s.key, seg.header.seq)
                    try:
                        stored = await self._reserve(dst, key, seg.length, {s.key}, lossless=True)
                        if stored:
                            try:
                                await self._copy_segment(s, src, dst, key, seg.length)
                            finally:
                                to.release(key)
                        else:
                            _log.info(
                                "write-through of %.80r stopped: tier %r is full", s.key, to.name
                            )
                    except (TierIOError, CorruptSegmentError):
                        self._stats.errors += 1
                        _log.exception("write-through of %.80r failed", s.key)
                        stored = False
                    if not stored:  # this copy can never be completed now: free its space
                        await self._remove_copy(s, dst)
                        break
                    if s.dropped or seg not in s.segs:  # dropped or reset meanwhile
                        await to.delete(key)
                        break
                    s.held[dst].add(seg.header.seq)
                    self._stats.write_through += 1
                    if s.complete(dst):
                        now = self._clock()
                        self._policies[dst].on_admit(s.key, self._publish(s, now), now)
        finally:
            s.inflight -= 1
            _unbusy(self._busy, s.key)
            async with s.cond:
                s.cond.notify_all()
            self._pending -= 1
            if self._pending == 0 and self._idle_event is not None:
                self._idle_event.set()

    async def _wait_quiet(self, s: _Session) -> None:
        """Wait (``s.cond`` held) until no background transfer of ``s`` is in flight."""
        while s.inflight:
            await s.cond.wait()

    # -- recovery ------------------------------------------------------------------------
    async def _recover(self, recovered: list[list[SegmentHeader]]) -> None:
        by_session: dict[str, list[dict[int, SegmentHeader]]] = {}
        for t, headers in enumerate(recovered):
            for h in headers:
                by_session.setdefault(h.session, [{} for _ in self._tiers])[t][h.seq] = h
        now = self._clock()
        for key, per_tier in by_session.items():
            prefix: list[int] = []
            for segs in per_tier:
                n = 0
                while n in segs:
                    n += 1
                prefix.append(n)
            n = max(prefix)
            best = prefix.index(n)
            headers = [per_tier[best][i] for i in range(n)]
            schema = _schema_of(headers[0]) if headers else None
            good = 0
            for h in headers:
                if schema is None or _schema_of(h) != schema:
                    break
                good += 1
            s = _Session(key, len(self._tiers))
            s.segs = [_Seg(h) for h in headers[:good]]
            s.schema = schema
            for t, segs in enumerate(per_tier):
                keep = good if prefix[t] >= good else 0
                for seq in sorted(segs, reverse=True):
                    if seq < keep and segs[seq].length == s.segs[seq].length:
                        s.held[t].add(seq)
                    else:
                        await self._tiers[t].delete((key, seq))
            if not s.segs or not any(s.complete(t) for t in range(len(self._tiers))):
                for t in range(len(self._tiers)):
                    await self._remove_copy(s, t)
                continue
            for t in range(len(self._tiers)):
                if s.held[t] and not s.complete(t):
                    await self._remove_copy(s, t)
            s.primary = next(t for t in range(len(self._tiers)) if s.complete(t))
            self._sessions[key] = s
            meta = self._publish(s, now, answer=s.segs[-1].header.answer_tokens, created=True)
            for t in range(len(self._tiers)):
                if s.complete(t):
                    self._policies[t].on_admit(key, meta, now)
        # a tier may have shrunk since the last run
        for t, tier in enumerate(self._tiers):
            if tier.used > tier.capacity:
                victims = (
                    self._policies[t].victims(tier.used - tier.capacity, now, self.channel) or []
                )
                for victim in victims:
                    vs = self._sessions[victim]
                    async with self._hold(vs):
                        await self._evict_copy(vs, t)

    # -- bookkeeping ---------------------------------------------------------------------
    def _hold(self, s: _Session) -> _Held:
        return _Held(self, s)

    def _set_transfer(self, s: _Session, transfer: Transfer | None) -> None:
        if s.key in self.channel:
            self.channel.update(s.key, in_flight=transfer)

    def _publish(
        self,
        s: _Session,
        now: float,
        *,
        access: bool = False,
        answer: int | None = None,
        created: bool = False,
    ) -> KVMeta:
        old = self.channel.get(s.key)
        copies = tuple(
            self._tiers[t].name
            for t in sorted(range(len(self._tiers)), key=lambda t: t != s.primary)
            if s.complete(t)
        )
        meta = KVMeta(
            session=s.key,
            tier=None if s.primary is None else self._tiers[s.primary].name,
            copies=copies,
            nbytes=s.nbytes(),
            tokens=s.tokens(),
            turns=len(s.segs),
            prev_answer_tokens=(
                answer if answer is not None else (old.prev_answer_tokens if old else 0)
            ),
            last_access=now if access or old is None else old.last_access,
            created=now if old is None or created else old.created,
            accesses=(old.accesses if old else 0) + (1 if access else 0),
            in_flight=old.in_flight if old else None,
            next_access=old.next_access if old else None,
            codec=s.schema.codec if s.schema is not None else "kv",
        )
        self.channel.put(meta)
        return meta


class _Held:
    """``async with``: hold a session's lock and mark it busy (never chosen as a victim)."""

    __slots__ = ("_cache", "_s")

    def __init__(self, cache: TieredKVCache, s: _Session) -> None:
        self._cache = cache
        self._s = s

    async def __aenter__(self) -> None:
        await self._s.cond.acquire()
        self._cache._busy[self._s.key] += 1

    async def __aexit__(self, *exc_info: object) -> None:
        _unbusy(self._cache._busy, self._s.key)
        self._s.cond.release()


def _unbusy(busy: Counter[str], key: str) -> None:
    busy[key] -= 1
    if busy[key] <= 0:
        del busy[key]


def _check_key(session: object) -> None:
    if not isinstance(session, str):
        raise TypeError(f"session keys are str, not {type(session).__name__}")
    if not session:
        raise ValueError("session key is empty; use any non-empty text")
    try:
        session.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"session key is not valid Unicode text ({exc.reason} at {exc.start}); "
            f"remove lone surrogates"
        ) from None


def _schema_of(h: SegmentHeader) -> Schema:
    return Schema(
        token_dim=h.token_dim,
        codec=h.codec,
        names=tuple(t.name for t in h.tensors),
        dtypes=tuple(t.dtype for t in h.tensors),
        shapes=tuple(
            tuple(-1 if i == h.token_dim else d for i, d in enumerate(t.shape)) for t in h.tensors
        ),
    )


def _scatter(
    buf: memoryview,
    header: SegmentHeader,
    out: dict[str, torch.Tensor],
    dim: int,
    offset: int,
    non_blocking: bool,
) -> None:
    # non_blocking only from the pinned arena, which stays valid until the final synchronize
    for name, view in segment_tensors(buf, header).items():
        out[name].narrow(dim, offset, header.tokens).copy_(view, non_blocking=non_blocking)


@contextlib.contextmanager
def _scratch(length: int) -> Iterator[memoryview]:
    """A page-aligned temporary buffer (O_DIRECT-capable), unmapped when done."""
    buf = mmap.mmap(-1, length)
    view = memoryview(buf)
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):  # a view still alive: freed with it
            view.release()
        close_mapping(buf, "scratch buffer")


def _scatter_all(
    parts: list[tuple[memoryview, SegmentHeader]],
    out: dict[str, torch.Tensor],
    dim: int,
    non_blocking: bool,
) -> None:
    offset = 0
    for buf, header in parts:
        _scatter(buf, header, out, dim, offset, non_blocking)
        offset += header.tokens


async def _run(fn: Callable[..., None], *args: Any, big: bool) -> None:
    if big:
        await anyio.to_thread.run_sync(fn, *args)
    else:
        fn(*args)
