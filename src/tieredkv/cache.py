"""TieredKVCache: the async facade over tiers, eviction policies and the metadata channel.

One conversation ("session") = an append-only list of segments, one per turn; a fork
(``append(..., parent=...)``) lists its parent's segments up to the fork point, stored once
for both (:mod:`tieredkv._cache.forest`, docs/explanation/forest.md). A session's
complete history lives in one *primary* tier (the one loads are served from); in inclusive
mode lower tiers may also hold a copy. Tiers are ordered: index 0 is the performance tier
(host memory), the rest are capacity tiers (SSD, mmap).

Flow of one turn (see docs/explanation/architecture.md)::

    load(session)   -> promote the history into tier 0 if it fits (evicting others down),
                       then copy it out, joined along the token dimension
    append(session) -> write the new segment into the session's primary tier, evicting
                       others down if needed; in inclusive mode, copy it to the next tier in
                       the background (write-through)

Guarantees (how each is kept: docs/explanation/architecture.md): per-session operations are
serialized, different sessions run concurrently; every move is all-or-nothing under I/O
errors and under any cancellation (anyio scopes, ``task.cancel()``, ``asyncio.timeout``,
``wait_for``), because it runs in a task of its own (:mod:`tieredkv._cache.atomic`); an
:meth:`append`, :meth:`load` or :meth:`load_into` that raises a cancellation left no trace,
one that returns is fully visible; a :meth:`drop` either did nothing or completed;
:meth:`aclose` writes what only volatile tiers hold down to a persistent tier before it
closes them, and completes whatever cancels it; blocking I/O and large copies run in worker
threads.

The parts live in :mod:`tieredkv._cache`, one concern each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import TracebackType
from typing import Any, Literal, Self

import msgspec
import torch

from ._cache.atomic import settle
from ._cache.closing import check_timeout, close
from ._cache.gather import Target, check_into, fresh
from ._cache.layerwise import LayerwiseLoad, layerwise
from ._cache.pins import PinBounds, past_bound
from ._cache.placement import drop
from ._cache.predict import prefetch, prefetch_predicted
from ._cache.recovery import Truncation, open_tiers
from ._cache.sharing import discover, locked_stored
from ._cache.state import CacheStats, Core, check_key, policies_per_tier
from ._cache.tierio import resolve
from ._cache.turns import append, load
from ._cache.writethrough import WriteThrough
from ._checks import check_int
from ._fork import check_process
from .backends.base import Tier
from .errors import (
    ClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    RestoreFailedError,
    SessionNotFoundError,
)
from .meta import KVMeta, MetadataChannel, RetentionHint, apply_hint
from .policies.base import Eviction, Hinted

__all__ = ["CacheStats", "LayerwiseLoad", "RestoreFailedError", "TieredKVCache", "Truncation"]

_log = logging.getLogger(__name__)

_tiers_lock = threading.Lock()
_open_tiers: dict[int, weakref.ref[TieredKVCache]] = {}
"""The tiers of the open caches (by ``id``: a tier need not be hashable), each with its
cache: a tier object belongs to one open cache at a time."""


def _claim_tiers(cache: TieredKVCache, tiers: Sequence[Tier]) -> None:
    """Record ``tiers`` as ``cache``'s (it is opening), or raise
    :class:`~tieredkv.errors.InvalidArgumentError` if another open cache has one of them."""
    with _tiers_lock:
        for tier in tiers:
            owner = _open_tiers.get(id(tier))
            other = owner() if owner is not None else None
            if other is not None and other is not cache and other._open:
                raise InvalidArgumentError(
                    f"tier {tier.name!r} belongs to another open TieredKVCache: a tier "
                    f"object serves one cache at a time (its index is that cache's); give "
                    f"each cache tiers of its own (an SSD directory of its own; to share "
                    f"conversations between caches, a RedisTier on the same prefix in each)"
                )
        for tier in tiers:
            _open_tiers[id(tier)] = weakref.ref(cache)


def _release_tiers(cache: TieredKVCache, tiers: Sequence[Tier]) -> None:
    """Forget ``tiers`` as ``cache``'s (it closed, or failed to open)."""
    with _tiers_lock:
        for tier in tiers:
            owner = _open_tiers.get(id(tier))
            if owner is not None and owner() in (cache, None):
                del _open_tiers[id(tier)]


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
    :param output_reuse_bytes: host memory that tensors returned by :meth:`load` leave behind
        when the caller drops them, kept (up to this much while idle) for later loads to
        reuse: it is already faulted in, so those loads skip a page fault per 4 KiB of
        output (about 75 ms per 512 MiB on a 2-core VM). 0 turns reuse off
    :param output_huge_pages: while that memory is idle, collapse it into transparent huge
        pages in a background thread (``madvise(MADV_COLLAPSE)``, Linux 6.1; nothing
        elsewhere), so that the loads that reuse it read into physically contiguous memory
        (a load of 134 MB from an SSD tier: 51-64 ms against 92-95 ms on a 2-core VM).
        No load waits for it; ``False`` keeps 4 KiB pages
    :param staging_huge_pages: map the staging buffers that appends to an SSD tier are
        written from (and plain tiers' segments pass through), made once and reused, on
        transparent huge pages (``madvise(MADV_HUGEPAGE)``; nothing where the system has
        none): a new cache's durable appends of 8 MiB turns ran at 1.09-1.41 GB/s against
        0.81-1.20 GB/s on 4 KiB pages (seven runs each on a 2-core VM). Its first use faults them
        in, which on a VM whose balloon takes free 2 MiB blocks back can cost more than
        4 KiB pages once; ``False`` keeps 4 KiB pages
    :param close_timeout: seconds :meth:`aclose` may spend finishing background copies and
        writing conversations that only volatile tiers hold down to a persistent tier (a
        write under way at the deadline finishes; ``math.inf`` for no bound, 0 to write
        nothing down)
    :param max_pinned_bytes: the bound on the bytes of pinned conversations
        (:meth:`hint`); ``None``: half the top tier's capacity
    :param max_pinned_bytes_per_group: the bound on the bytes of the pinned conversations
        of one pin group (a pin's ``RetentionHint.group``, e.g. a tenant), within
        ``max_pinned_bytes``; ``None``: no bound per group
    :param max_lost_records: the most conversations lost on this replica that the cache
        keeps a record of (about 480 bytes each: the channel's entry with ``tier`` ``None``,
        and the loss not yet reported to the caller); past it the oldest records go,
        counted in ``stats().lost_records_forgotten``, and the cache then knows as little
        of those conversations as one opened after the loss. An append that passes
        ``expected_tokens`` needs no record (the caller's count tells a continuation from a
        first turn); one without it, to a conversation whose record went, stores its turn
        as a new history. ``None`` (default): every record is kept until a drop, or an
        append that stores the conversation again

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
        output_reuse_bytes: int = 1 << 30,
        output_huge_pages: bool = True,
        staging_huge_pages: bool = True,
        close_timeout: float = 60.0,
        max_pinned_bytes: int | None = None,
        max_pinned_bytes_per_group: int | None = None,
        max_lost_records: int | None = None,
    ) -> None:
        io, copies = resolve(tiers)
        if max_lost_records is not None:
            check_int("max_lost_records", max_lost_records)
        if max_pinned_bytes is not None:
            check_int("max_pinned_bytes", max_pinned_bytes, minimum=0)
        if max_pinned_bytes_per_group is not None:
            check_int("max_pinned_bytes_per_group", max_pinned_bytes_per_group, minimum=0)
        pins = PinBounds(
            max_pinned_bytes if max_pinned_bytes is not None else tiers[0].capacity // 2,
            max_pinned_bytes_per_group,
        )
        check_int("output_reuse_bytes", output_reuse_bytes, minimum=0)
        for name, flag in (
            ("output_huge_pages", output_huge_pages),
            ("staging_huge_pages", staging_huge_pages),
        ):
            if not isinstance(flag, bool):
                raise InvalidTypeError(f"{name} must be a bool, not {type(flag).__name__}")
        self._close_timeout = check_timeout("close_timeout", close_timeout)
        if mode not in ("exclusive", "inclusive"):
            raise InvalidArgumentError(f"mode must be 'exclusive' or 'inclusive', not {mode!r}")
        shared = [x.tier.name for x in io[1:] if x.shared is not None]
        if mode == "exclusive" and shared:
            _log.info(
                "shared tier(s) %s below local ones in exclusive mode: a turn reaches them "
                "only when the tiers above evict it (other replicas cannot load it before, "
                "and flush() does not wait for it); mode='inclusive' commits every turn",
                ", ".join(map(repr, shared)),
            )
        if isinstance(token_dim, bool) or not isinstance(token_dim, int):
            raise InvalidTypeError(f"token_dim must be an int, not {type(token_dim).__name__}")
        policies = policies_per_tier(eviction, len(io))
        self.channel = channel if channel is not None else MetadataChannel()
        """The metadata channel: per-session :class:`~tieredkv.meta.KVMeta` and events."""
        self._core = Core(
            io,
            copies,
            policies,
            self.channel,
            mode,
            clock,
            output_reuse_bytes,
            output_huge_pages=output_huge_pages,
            staging_huge_pages=staging_huge_pages,
            pins=pins,
            max_lost_records=max_lost_records,
        )
        self._pumps = WriteThrough(self._core)
        self._token_dim = token_dim
        self._open = False
        self._opened_in: int | None = None
        """The process that opened the cache (a child it forks cannot use it)."""
        self._truncated: dict[str, Truncation] = {}

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
        """Open every tier and rebuild the index from what persistent tiers kept.

        :raises InvalidArgumentError: one of the tiers belongs to another open cache
        :raises ForkedError: the cache was open in the process this one was forked from
            when it forked (build a new one here)
        """
        check_process("this TieredKVCache", self._opened_in)
        if self._open:
            return
        tiers = self._core.tiers
        _claim_tiers(self, tiers)
        try:
            self._truncated, cancel = await open_tiers(self._core)
        except BaseException:
            _release_tiers(self, tiers)
            raise
        self._open = True
        self._opened_in = os.getpid()
        if cancel is not None:
            raise cancel

    async def aclose(self) -> None:
        """Keep what the cache holds, then close every tier.

        Within ``close_timeout`` seconds: background copies finish (in inclusive mode, one
        that an I/O error stopped is tried once more); every conversation that only
        volatile tiers hold (in exclusive mode, each one in host memory) is written down
        to a persistent tier, into free room, most recently used first, each whole or not
        at all, with a log line when it starts, every 5 s and when it ends; deletions that
        failed before are retried. ``stats().written_down`` and ``stats().unsaved`` count
        what it wrote and what it could not (logged as a warning: those are lost), added
        to what earlier closes of this cache counted.

        First, within the same ``close_timeout``, the operations already under way (an
        append, a load, an open :meth:`load_layerwise`, a prefetch, a drop) finish: what
        they move stays kept. One still under way at the timeout is cancelled (logged),
        and the close waits for it (up to 30 s more) before it closes the tiers: it is
        undone as a cancelled call is, or completes past its point of no return, and
        raises :class:`~tieredkv.errors.ClosedError` saying which. Operations started
        after the close began raise :class:`~tieredkv.errors.ClosedError`.
        Cancelling it (any kind) does not interrupt it: the close completes, then the
        cancellation is raised.

        In a child forked from the process that had the cache open, it closes only the
        child's copy: nothing is written, deleted or released (the parent goes on using
        the cache), and the copy cannot be opened again there.
        """
        if not self._open:
            return
        self._open = False
        if self._opened_in != os.getpid():  # (and it stays refused here: ForkedError)
            _log.debug("closed a copy of a cache opened in process %s", self._opened_in)
            return
        _, cancel = await settle(lambda: close(self._core, self._pumps, self._close_timeout))
        self._opened_in = None  # closed: a child forked from now on may open it
        _release_tiers(self, self._core.tiers)
        if cancel is not None:
            raise cancel

    async def flush(self) -> None:
        """Wait until every background write-through started so far has finished.

        With a shared tier in inclusive mode (local-first: an append returns once its turn
        is in this replica's tiers), ``flush()`` returning means every turn appended before
        it is committed there, for every replica to load. In exclusive mode a turn reaches
        a shared tier below a local one only when the local tiers evict it, and ``flush()``
        does not wait for that.

        :raises TurnRefusedError: turns the shared tier refused for good (another replica
            took the conversation over, or its history changed, first); reported once
        :raises TierIOError: turns not committed yet (the shared tier is away); they stay
            on this replica and are tried again in the background
        """
        self._check_open()
        await self._pumps.flush_checked()

    async def wait_copies(self) -> None:
        """Wait until the background write-throughs under way now have finished. Copies that
        start meanwhile are not waited for, so a steady stream of appends cannot hold it up;
        failures are not reported here (:meth:`flush` reports them). A conversation being
        copied is busy, and eviction passes over it: an engine about to put bytes into host
        memory waits here first (bounded by its own scope, e.g. ``anyio.move_on_after``), so
        that what goes is the eviction policy's choice, not whatever the disk had finished
        writing.

        :raises ClosedError: the cache is closed
        """
        self._check_open()
        await self._pumps.settle()

    def _check_open(self) -> None:
        if not self._open:
            raise ClosedError("TieredKVCache")
        check_process("this TieredKVCache", self._opened_in)

    def set_protected(self, sessions: Callable[[], AbstractSet[str]] | None) -> None:
        """Never evict the sessions ``sessions()`` returns (asked at each eviction).

        An engine passes its scheduler's ready sessions (``scheduler.ready_sessions``), so
        KV that was just loaded for a request about to run is not evicted before it runs.
        ``None`` removes the hook.
        """
        self._core.protected = sessions if sessions is not None else frozenset

    # -- public queries ------------------------------------------------------------------
    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, performance tier first."""
        return tuple(self._core.tiers)

    @property
    def mode(self) -> str:
        """``"exclusive"`` or ``"inclusive"``."""
        return self._core.mode

    def where(self, session: str) -> str | None:
        """Name of the tier that serves the session's loads, or ``None`` if it is stored nowhere."""
        s = self._core.sessions.get(session)
        if s is None or s.primary is None:
            return None
        return self._core.tiers[s.primary].name

    def addressable(self, session: str) -> bool:
        """Whether the session's history is served from an addressable tier (host memory,
        mmap: an :class:`~tieredkv.backends.base.AddressableTier`), whose bytes a load copies
        out with no read; ``False`` if it is stored nowhere."""
        s = self._core.sessions.get(session)
        if s is None or s.primary is None:
            return False
        return self._core.io[s.primary].view is not None

    def contains(self, session: str) -> bool:
        """Whether the session's history is stored in some tier."""
        return self.where(session) is not None

    def __contains__(self, session: object) -> bool:
        return isinstance(session, str) and self.contains(session)

    def sessions(self) -> list[str]:
        """Keys of the sessions stored in some tier."""
        return [k for k, s in self._core.sessions.items() if s.primary is not None]

    def truncated(self) -> dict[str, Truncation]:
        """The sessions the last :meth:`open` brought back shorter than their tiers had
        stored them (a turn found damaged, or missing, and the turns after it), by key.

        Each is also counted in ``stats().truncated`` and logged as a warning. A session
        that kept no turn is not stored (:meth:`load` raises
        :class:`~tieredkv.errors.SessionNotFoundError`); one that kept some serves those:
        an engine that knows how long the conversation is recomputes the rest.
        """
        return dict(self._truncated)

    def stats(self) -> CacheStats:
        """A snapshot of the counters, with each tier's own."""
        core = self._core
        return msgspec.structs.replace(
            core.stats,
            outputs_reused=core.outputs.reused,
            output_idle_bytes=core.outputs.idle_bytes,
            outputs_collapsed=core.outputs.collapsed,
            output_collapse_failures=core.outputs.collapse_failures,
            tiers=tuple(tier.stats() for tier in core.tiers),
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
        hint: RetentionHint | None = None,
        parent: str | None = None,
        parent_tokens: int | None = None,
        expected_tokens: int | None = None,
    ) -> KVMeta:
        """Store one turn's new KV segment and record the model's answer length.

        With ``parent``, this is the first turn of a *fork*: the conversation's history is
        ``parent``'s first ``parent_tokens`` tokens (all of them if ``None``; a point inside
        a stored turn works), followed by ``tensors``. The inherited history is not copied:
        both conversations list the same stored segments, in every tier, until neither
        needs them (:doc:`/explanation/forest`). The fork's first turn is stored in the
        tier that serves ``parent``.

        :param session: the conversation's key (any non-empty text)
        :param tensors: named torch tensors or numpy arrays (CPU or CUDA), all with the same
            number of tokens along ``token_dim``; every turn of a session must use the same
            names, dtypes and non-token shapes
        :param answer_tokens: tokens the model generated in this turn (Bidaw's eviction
            signal for the next access)
        :param token_dim: the token dimension for this call (default: the cache's)
        :param codec: what the tensors hold (``"kv"``; storage-efficient codecs use their
            own name), recorded with the segment
        :param hint: what the caller knows of the conversation's future, applied once the
            turn is stored (see :meth:`hint`; a pin past the bound, or past its group's,
            raises :class:`~tieredkv.errors.PinLimitError` after the turn is stored)
        :param parent: the stored conversation this one forks from (only at its first
            turn); its tensors must have the same names, dtypes and non-token shapes
        :param parent_tokens: how many of ``parent``'s tokens the fork starts with (1 to
            all of them; ``None``: all)
        :param expected_tokens: the length of the history this turn extends, as the caller
            counts it (0: the turn starts the conversation; for a fork, the tokens it
            inherits). The turn is stored only if the cache holds exactly that many tokens
            of the conversation, checked under its lock: a caller that passes it never has
            a turn stored after a history of another length than the one it counts (one
            lost, even before this cache was opened, of which the cache keeps no record;
            one another append extended meanwhile). The check is of the length only: two
            histories of the same length are not told apart. With 0, a conversation
            lost since the caller last heard of it starts afresh without
            :class:`~tieredkv.errors.HistoryLostError`. ``None`` (default): not checked
        :returns: the session's metadata after the append
        :raises SchemaMismatchError: the tensors disagree with the session's earlier turns
            (the session is untouched)
        :raises CapacityError: the segment (or the session with it) fits in no tier, or a
            fork's first turn does not fit in its parent's tier (nothing is stored)
        :raises SessionNotFoundError: ``parent`` is not stored
        :raises HistoryLostError: the history this turn extends was lost since the caller
            last heard of it (its last copy evicted or found damaged, or lost by a shared
            tier; a load, :meth:`prefetch` or :meth:`discover` tells the caller, whether it
            finds the conversation or not, and a :meth:`drop` ends it); raised once,
            nothing is stored: recompute the whole history and append it, which starts the
            conversation afresh
        :raises HistoryLengthError: the cache holds a history of another length than
            ``expected_tokens`` (none, or a different one): nothing is stored
        :raises ValueError: ``parent`` given for a conversation already stored, or
            ``parent_tokens`` out of range or without ``parent`` (nothing is stored)
        :raises TierIOError: a tier failed while making room or writing (nothing is lost:
            what was stored stays where it was)
        """
        self._check_open()
        check_key(session)
        fork: tuple[str, int | None] | None = None
        if parent is not None:
            check_key(parent)
            if parent_tokens is not None:
                check_int("parent_tokens", parent_tokens, minimum=1)
            fork = (parent, parent_tokens)
        elif parent_tokens is not None:
            raise InvalidArgumentError("parent_tokens needs parent (the conversation to fork)")
        if expected_tokens is not None:
            check_int("expected_tokens", expected_tokens)
        if hint is not None and not isinstance(hint, RetentionHint):  # (before anything is stored)
            raise InvalidTypeError(f"hint must be a RetentionHint, not {type(hint).__name__}")
        dim = self._token_dim if token_dim is None else token_dim
        with self._core.operation():
            meta = await append(
                self._core,
                self._pumps,
                session,
                tensors,
                answer_tokens,
                dim,
                codec,
                fork,
                expected_tokens,
            )
            if hint is not None:  # (checked against the history as it grew)
                meta = self._hint(session, hint)
        return meta

    # -- hints ---------------------------------------------------------------------------
    def hint(self, session: str, hint: RetentionHint) -> KVMeta:
        """Tell the cache what the caller knows of a conversation's future.

        - ``next_turn_in``, ``priority``, ``tool_call`` are **advice**: they go on the
          metadata channel (:class:`~tieredkv.meta.KVMeta`) and the eviction policy may
          weigh them (``"bidaw"`` learns how far hints of each size are to be trusted).
        - ``pin=True`` is a **rule**: the conversation stays in the tier that holds it (no
          eviction policy picks it as a victim) until ``ttl`` seconds pass (the cache's
          clock) or ``pin=False`` releases it. It neither moves the conversation up nor
          protects it from :meth:`drop`. Pinned conversations hold
          :attr:`max_pinned_bytes` at most (a segment that several of them list, such as
          a fork's inherited turns, counts once); a conversation that grows past the
          bound while pinned (by its own turns, or by a newer history another replica
          committed to a shared tier) loses its pin (logged).
        - A pin may name a **group** (``RetentionHint(pin=True, group="tenant-a")``): the
          pinned conversations of one group hold :attr:`max_pinned_bytes_per_group` at
          most, within :attr:`max_pinned_bytes`, and a conversation that grows past its
          group's bound while pinned loses its pin (logged). A pin counts in the group its
          latest ``pin=True`` named; a release or the end of its ``ttl`` takes it out.

        :returns: the session's metadata with the hint
        :raises SessionNotFoundError: for a session the cache does not hold
        :raises PinLimitError: ``pin=True`` would take the pinned bytes past the bound, or
            its group's pinned bytes past the bound per group (nothing changes; the
            error's ``group`` says which)
        """
        self._check_open()
        check_key(session)
        if not isinstance(hint, RetentionHint):
            raise InvalidTypeError(f"hint must be a RetentionHint, not {type(hint).__name__}")
        return self._hint(session, hint)

    def _hint(self, session: str, hint: RetentionHint) -> KVMeta:
        meta = self.channel[session]
        core = self._core
        now = core.clock()
        if hint.pin:
            refused = past_bound(core.pins, core.sessions, self.channel, meta, hint.group, now)
            if refused is not None:
                raise refused
        new = core.residency.published(apply_hint(meta, hint, now))
        for policy in core.residency.policies:
            if isinstance(policy, Hinted):
                policy.on_hint(session, new, now)
        return new

    @property
    def max_pinned_bytes(self) -> int:
        """The bound on the bytes pinned conversations hold (each segment counted once: a
        pinned fork and its pinned parent count what they share once)."""
        return self._core.pins.total

    @max_pinned_bytes.setter
    def max_pinned_bytes(self, value: int) -> None:
        check_int("max_pinned_bytes", value, minimum=0)
        self._core.pins.total = value

    @property
    def max_pinned_bytes_per_group(self) -> int | None:
        """The bound on the bytes one pin group's pinned conversations hold (``None``: no
        bound per group)."""
        return self._core.pins.per_group

    @max_pinned_bytes_per_group.setter
    def max_pinned_bytes_per_group(self, value: int | None) -> None:
        if value is not None:
            check_int("max_pinned_bytes_per_group", value, minimum=0)
        self._core.pins.per_group = value

    # -- load ----------------------------------------------------------------------------
    async def load(self, session: str) -> dict[str, torch.Tensor]:
        """The session's whole history, segments joined along the token dimension.

        The result is new host-memory tensors (the caller owns them), byte-identical to what
        was appended. Tensors of 1 MiB or more live in memory the cache hands to later
        loads once the caller has dropped them and every view of them (see
        ``output_reuse_bytes``); their storage cannot be resized in place (``resize_``
        raises), so clone one to grow it, or pass ``output_reuse_bytes=0``. If the history
        is on a lower tier it is first promoted to tier 0 (evicting other sessions down)
        when it fits there.

        :raises SessionNotFoundError: (a ``KeyError``) if the session has no KV in any tier,
            including when its stored history was found damaged, or (with a shared tier)
            cannot be proven current (it then counts as a miss)
        :raises TurnRefusedError: with a shared tier, turns of this session appended here
            were refused since (another replica took it over first); reported once
        """
        out: dict[str, torch.Tensor] = {}
        await self._load(session, fresh(out, self._core.outputs))
        return out

    async def load_into(self, session: str, out: Mapping[str, torch.Tensor]) -> int:
        """Copy the session's history into caller-provided tensors; return its token count.

        ``out`` must have the session's tensor names and dtypes, the same non-token shape,
        and at least as many positions along the token dimension as the history has tokens
        (the history fills the leading positions; the rest is left untouched). Tensors may
        be on a CUDA device: the copy then comes from the (pinned) host tier. If the call is
        cancelled, the leading positions may hold part of the history.

        :raises SessionNotFoundError: as for :meth:`load`
        :raises ValueError: if ``out`` does not fit the history, or two of its tensors
            overlap in memory (nothing is moved)
        """
        return await self._load(session, check_into(out))

    async def _load(self, session: str, target: Target) -> int:
        self._check_open()
        check_key(session)
        with self._core.operation(), _telling(self._core, session):
            async with locked_stored(self._core, session, load=True) as s:
                return await load(self._core, s, target)

    # -- streamed (layer-wise) load -------------------------------------------------------
    @contextlib.asynccontextmanager
    async def load_layerwise(
        self,
        session: str,
        out: Mapping[str, torch.Tensor],
        groups: Sequence[Sequence[str]],
    ) -> AsyncIterator[LayerwiseLoad]:
        """Copy the session's history into ``out`` group by group, while the caller computes.

        ``async with cache.load_layerwise(session, out, groups) as load:`` starts reading
        and returns at once. ``groups`` splits the session's tensor names, in the order
        they are stored (e.g. per layer: ``[["layers.0.k", "layers.0.v"], ["layers.1.k",
        ...], ...]``); the groups land in order, and a worker thread running the model calls
        ``load.wait(g)`` before it reads group ``g``'s positions of ``out`` (the first
        ``load.tokens`` along the token dimension, as :meth:`load_into` fills them). From a
        lower tier the history is read span by span from every segment (group 0's bytes
        of all turns first), and promoted to tier 0 on the way when it fits there, as
        :meth:`load` does, from the same reads.

        Bytes may land before they are verified. ``await load.finished()`` returns once
        every segment is verified: use nothing computed from ``out`` before it returns.
        Leaving the block waits for the restore whatever happened inside it, and raises
        what :meth:`load_into` would; it counts as a load (an access) only if the block
        finished without an exception. Cancellation anywhere leaves the cache as a
        cancelled :meth:`load_into` does: the history where it was, or wholly promoted.

        :raises SessionNotFoundError: as for :meth:`load` (on entry, or from
            ``finished()`` or the exit when the history is found damaged)
        :raises ValueError: if ``out`` does not fit the history or ``groups`` does not
            split its names (nothing is moved)
        :raises TierIOError: reading failed (the history stays where it was)
        """
        self._check_open()
        check_key(session)
        core = self._core
        with core.operation(), _telling(core, session):
            async with (
                locked_stored(core, session, load=True) as s,
                layerwise(core, s, out, groups) as lw,
            ):
                yield lw

    # -- prefetch ------------------------------------------------------------------------
    async def prefetch(self, session: str) -> str | None:
        """Promote the session's history to tier 0 ahead of its load, if it fits there.

        A promotion is atomic: if the call is cancelled, the history is either where it was
        or wholly in tier 0.

        :returns: the tier that now serves it (``None`` if it was found damaged)
        :raises SessionNotFoundError: if the session has no KV in any tier
        """
        self._check_open()
        check_key(session)
        with self._core.operation(), _telling(self._core, session):
            async with locked_stored(self._core, session, load=False) as s:
                if await prefetch(self._core, s) is None:
                    return None
                return self.where(session)

    async def prefetch_predicted(self, limit: int = 1, *, scan: int = 4096) -> list[str]:
        """Promote to tier 0, while the cache is otherwise idle, up to ``limit`` sessions
        from lower tiers whose users the tier-0 eviction policy expects back soon.

        Call it when the storage would otherwise sit idle and no request is waiting (a
        serving loop with no load to make): its read would delay an arriving request's.
        The policy must implement :class:`~tieredkv.policies.base.Foresight`
        (:class:`~tieredkv.policies.BidawEviction` does: its reuse-distance model, asked
        about a session that is not resident); with any other policy this does nothing. A
        session is brought up only when its chance of a hit beats the summed chances of the
        residents it would displace, and only while no other operation of this cache is
        under way (a load or append arriving meanwhile is not delayed by more than the
        promotion already started). Each promotion is the one :meth:`prefetch` makes:
        atomic under cancellation, and not an access (the policy learns nothing from it).

        A read that fails (an I/O error, counted in ``stats().errors``) ends the call with
        a warning; that session stays where it was, and those promoted before it are
        returned.

        :param limit: sessions to promote at most
        :param scan: lower-tier sessions to consider at most, the most recently used;
            ranked by chance of a hit, and of equal chances the user gone longest first
        :returns: the sessions promoted, in order
        """
        self._check_open()
        check_int("limit", limit, minimum=0)
        check_int("scan", scan, minimum=1)
        with self._core.operation():
            return await prefetch_predicted(self._core, limit, scan)

    # -- sharing across replicas ---------------------------------------------------------
    async def discover(self, session: str) -> bool:
        """Ask the shared tiers (:class:`~tieredkv.backends.shared.SharedTier`) about
        ``session``, taking in what other replicas stored; whether it is stored now.

        :meth:`load` and :meth:`prefetch` do this themselves; :meth:`contains` (synchronous)
        answers from what this cache knows, so call this first for a replica-wide answer.
        Without a shared tier it is :meth:`contains`.
        """
        self._check_open()
        check_key(session)
        core = self._core
        try:
            with _telling(core, session):  # (the answer tells the caller, either way)
                if core.sharing:
                    with core.operation():
                        if not await discover(core, session, take=False):
                            # its history cannot be proven current (the tier is away)
                            raise SessionNotFoundError(session)
                if not self.contains(session):
                    raise SessionNotFoundError(session)
        except SessionNotFoundError:
            return False
        return True

    # -- drop ----------------------------------------------------------------------------
    async def drop(self, session: str) -> None:
        """Forget the session: delete every copy of its history and its metadata.

        What its forks (or the conversation it was forked from) still list stays stored
        for them; the rest is deleted.

        With a shared tier (Redis), the conversation leaves the shared tier for every
        replica only if this replica is its writer (it appended or loaded it last); another
        replica's conversation stays there, and only this replica's copies go (a later
        load here reads it again). To remove it for every replica, load it first (a load
        takes the conversation over), then drop it.

        :raises SessionNotFoundError: if the cache does not know the session
        """
        self._check_open()
        check_key(session)
        core = self._core
        s = core.sessions.get(session)
        meta = self.channel.get(session)
        if s is None and (meta is None or meta.tier is not None):
            core.told(session)
            raise SessionNotFoundError(session)
        with core.operation():
            # its loss, if any, is no news to the caller once the drop is done (or found
            # nothing); one that was cancelled or failed first leaves it to be told
            ended = False
            if s is None:  # lost: only the channel's record is left (Core.discard_lost)
                s = await core.session(session)
            try:
                async with core.hold(s):
                    if core.sessions.get(session) is not s:  # dropped while this one waited
                        ended = True
                        raise SessionNotFoundError(session)
                    await drop(core, s, self._pumps.stop, self._pumps.unstop)
                    ended = True
            finally:
                core.discard_lost(s)  # (a drop that failed leaves no empty entry)
                if ended or core.operation_completed():
                    core.told(session)


@contextlib.contextmanager
def _telling(core: Core, session: str) -> Iterator[None]:
    """``with``: a call that tells the caller of ``session``'s state (see
    :attr:`~tieredkv._cache.state.Core.unreported`): a :class:`SessionNotFoundError` for it
    raised inside says its history is gone (the next append starts it afresh), and a
    call that completes says what it holds now, unless it was lost meanwhile; any other
    error tells nothing."""
    since = core.unreported.get(session)
    try:
        yield
    except SessionNotFoundError as exc:
        if exc.session == session:
            core.told(session)
        raise
    if since is not None:
        core.told(session, since)
