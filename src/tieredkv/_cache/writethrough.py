"""Background copies to the next tier (inclusive mode, "write-through").

After an append to tier ``t``, a pump copies the session's segments that tier ``t + 1``
lacks, in order, so that evicting the session from ``t`` later costs no write on the
critical path. The pump runs in a task of its own (no caller's cancellation reaches it),
marks the session busy (never a victim), and builds the lower copy as a prefix. A copy
joins the index segment by segment, and the lower tier's policy admits the session once
the copy is complete. No exception of a pump is ever left unretrieved: each is logged,
counted and, for a shared tier, reported by :meth:`WriteThrough.flush_checked`.

Into a local tier, a copy that cannot be completed (no room, an I/O error) is removed
rather than left to waste space, and one an I/O error stopped is tried again at close.

Into a shared tier (the fleet's copy, see :mod:`tieredkv._cache.sharing`) this is the
*local-first* acknowledgement: an append returns once its turn is in this replica's own
tiers; the pump then commits it to the shared tier. What is committed is never taken out
again by a failure here. A commit that fails for a transient reason (the server away or
stalled, a takeover delay, no room as this cache counts it) keeps the turn here and is
retried in the background (backoff from 0.1 to 5 s, cut short when another commit gets
through: the server is back); one the shared tier refuses for good
(another replica took the conversation over, or its history changed) is a refusal
(:mod:`tieredkv._cache.refusals`). ``flush()`` retries at once what is waiting, waits out
takeover delays, and returns only when every turn appended before it is committed, or
raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import anyio

from ..backends.shared import plain_header
from ..errors import (
    CommitDelayedError,
    CorruptSegmentError,
    HistoryConflictError,
    LeaseHeldError,
    StaleWriterError,
    TierIOError,
    UnauthenticatedWriterError,
)
from .placement import copy_segments, delete_or_orphan, is_shared, remove_copy, reserve
from .refusals import Owed, pending, record_refusal, report
from .state import Core, Seg, Session, claim, unclaim

__all__ = ["WriteThrough"]

_log = logging.getLogger("tieredkv.cache")

_REFUSALS = (StaleWriterError, LeaseHeldError, HistoryConflictError, UnauthenticatedWriterError)
_BACKOFF = (0.1, 5.0)
"""First and largest wait before a failed commit into a shared tier is tried again, s."""


class _Waiting:
    """A session whose commit into a shared tier is waiting to be tried again."""

    __slots__ = ("attempts", "due", "error")

    def __init__(self) -> None:
        self.attempts = 0
        self.due = 0.0
        self.error: BaseException | None = None


class WriteThrough:
    """The pumps of one cache, and a way to wait for all of them."""

    def __init__(self, core: Core) -> None:
        self._core = core
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending = 0
        self._idle: anyio.Event | None = None
        self._pumping: set[Session] = set()
        """Sessions a pump is copying now (see :meth:`settle`)."""
        self._failed: set[str] = set()
        """Sessions whose copy into a local tier an I/O error stopped (tried again at close)."""
        self._local: set[str] = set()
        """Sessions whose pump copies into the local tier below the primary too."""
        self._up: set[str] = set()
        """Sessions whose pump commits into the shared tiers above the primary too, until
        complete there (a commit restarted from a local tier below: :meth:`restart`)."""
        self._waiting: dict[str, _Waiting] = {}
        """Sessions whose commit into a shared tier waits to be tried again."""
        self._away: set[str] = set()
        """Those of them whose last try met a shared tier that failed (not a full one, not
        a takeover delay): tried again at once when another commit gets through."""
        self._retrier: asyncio.Task[None] | None = None
        self._wake: anyio.Event | None = None
        core.restart_copy = self.restart
        core.hold_copies = self.held
        core.shared_answered = self._answering

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(_retrieved)
        task.add_done_callback(self._tasks.discard)
        return task

    def targets(self, s: Session) -> list[int]:
        """The tiers a pump copies ``s`` into, in order (inclusive mode): the next tier
        below its primary (while :meth:`start` asked for it), and every shared tier below
        that, so that a replica's turns reach the fleet whatever local tiers sit between
        (host, SSD, Redis: host to SSD, and host to Redis); after :meth:`restart`, the
        shared tiers above it too."""
        p = s.primary
        core = self._core
        if core.mode != "inclusive" or p is None:
            return []
        up = s.key in self._up
        return [
            d
            for d in range(len(core.tiers))
            if (
                (core.io[d].shared is not None and (d > p or (up and d < p)))
                or (d == p + 1 and s.key in self._local)
            )
            and not s.complete(d)
        ]

    def start(self, s: Session, *, local: bool = True) -> None:
        """Make sure a pump is copying ``s``'s missing segments into the tiers below it
        (:meth:`targets`); ``local=False``: only into the shared tiers (a commit tried
        again, which must not copy again into a local tier that the policy emptied)."""
        if s.deferred is not None:  # (made when the reconciliation ends: see held)
            s.deferred = max(s.deferred, 2 if local else 1)
            return
        if local:
            self._local.add(s.key)
        if s.inflight:  # the running pump picks up the new segment
            return
        if not self.targets(s):
            self._local.discard(s.key)
            return
        # A plain asyncio task rather than a task group: the cache may be opened and closed
        # from different tasks (e.g. a framework's startup and shutdown hooks).
        s.inflight += 1
        s.quiet = anyio.Event()
        self._pumping.add(s)
        self._core.busy[s.key] += 1
        self._pending += 1
        if self._pending == 1:
            self._idle = anyio.Event()
        self._spawn(self._pump(s))

    async def stop(self, s: Session) -> None:
        """Stop ``s``'s background copy early and wait for it (a drop is coming).

        If the wait is cancelled, the drop will not happen: the copy is restarted. A drop
        that fails before its point of no return restarts it too (:meth:`unstop`).
        """
        s.stopping = True
        try:
            await s.wait_quiet()
        except BaseException:
            self.unstop(s)
            raise
        # (a commit waiting stays listed until the drop is done, when a kick forgets it:
        # a flush meanwhile must not take it for made, the drop may yet fail)

    def unstop(self, s: Session) -> None:
        """The drop :meth:`stop` made way for will not happen: ``s``'s copy goes on."""
        s.stopping = False
        self.resume(s)

    def restart(self, s: Session) -> None:
        """:meth:`resume`, and commit ``s``'s turns the shared tiers lack even into one
        above its primary, until complete there: when a shared tier lost turns committed
        here, the local tier that serves the history now may lie below it (see
        :func:`~tieredkv._cache.sharing.examine`)."""
        self._up.add(s.key)
        self.resume(s)

    def resume(self, s: Session, *, local: bool = True) -> None:
        """In inclusive mode, restart ``s``'s copies to the tiers below it where they are
        incomplete (a pump stopped early: by a drop that was then cancelled, or by an I/O
        error; a commit to a shared tier waiting); ``local=False``: only into shared tiers."""
        if not s.dropped and s.key not in self._core.refused:
            self.start(s, local=local)

    @contextlib.asynccontextmanager
    async def held(self, s: Session) -> AsyncIterator[None]:
        """``async with``: ``s`` (locked) is reconciled with a shared tier, its background
        copies quiet: none starts meanwhile (a commit retried, or one a flush kicks, would
        read copies the reconciliation removes, and write into the shared tier it reads);
        one asked for is started once it ends."""
        await s.wait_quiet()
        s.deferred = 0
        try:
            yield
        finally:
            asked, s.deferred = s.deferred, None
            if asked:
                self.resume(s, local=asked == 2)
                if not s.inflight:  # (nothing left to copy: a kick forgets it, see _kick)
                    self._waiting.pop(s.key, None)

    def retry_failed(self) -> None:
        """Restart the copies that an I/O error stopped (at close, so a restart finds those
        sessions), and every commit into a shared tier waiting to be tried again. A copy
        removed for want of room, or evicted, is not restarted: that was the policy's
        choice, and copying it now would evict another session's copy."""
        failed, self._failed = self._failed, set()
        for key in failed | self._waiting.keys():
            s = self._core.sessions.get(key)
            if s is not None:
                self.resume(s, local=key in failed)

    async def settle(self) -> None:
        """Wait until the sessions being copied now are quiet: pumps that start meanwhile
        are not waited for (unlike :meth:`flush`, a steady stream of appends cannot hold
        this up), and no failure is reported (the pumps count and log their own)."""
        for s in list(self._pumping):
            await s.wait_quiet()

    async def flush(self) -> None:
        """Wait until no pump is running (those started meanwhile included)."""
        while self._pending and self._idle is not None:
            await self._idle.wait()

    async def flush_checked(self) -> None:
        """Try again at once every commit into a shared tier that is waiting, wait for
        every pump and takeover delay, then report what did not reach the shared tier.

        :raises TurnRefusedError: turns the shared tier refused (reported once to each
            caller waiting for them: every concurrent ``flush()``)
        :raises TierIOError: turns still not committed (kept here, tried again later)
        """
        owed = Owed(self._core)
        while True:
            now = time.monotonic()
            for key, w in list(self._waiting.items()):
                if not isinstance(w.error, CommitDelayedError) or w.due <= now:
                    self._kick(key)
            for key in list(self._waiting):  # (a kick a reconciliation holds: once it ends)
                s = self._core.sessions.get(key)
                if s is not None and s.deferred is not None:
                    async with s.lock:
                        pass
            await self.flush()
            delays = [
                w.due for w in self._waiting.values() if isinstance(w.error, CommitDelayedError)
            ]
            if not delays:
                break
            await anyio.sleep(max(0.0, min(delays) - time.monotonic()))
        report(self._core, list(self._core.refused), owed)
        failing = [(k, w.error) for k, w in self._waiting.items() if w.error is not None]
        if failing:
            key, error = failing[0]
            what = f"the latest turns of {len(failing)} session(s) (the first: {key[:80]!r})"
            tier, action, cause, hint = "shared", f"commit {what}", str(error), None
            if isinstance(error, TierIOError):
                tier, cause, hint = error.tier, f"{error.action}: {error.reason}", error.hint
                if not is_shared(self._core, tier):  # the local tier the commit reads from
                    action, cause = f"{error.action} to commit {what}", error.reason
            raise TierIOError(
                tier,
                action,
                cause,
                hint="they stay on this replica and are tried again in the background; "
                + (hint or "flush() again later"),
            )

    def cancel_all(self) -> None:
        """Stop the pumps and the retries (only at close, after the last flush)."""
        for task in tuple(self._tasks):
            task.cancel()
        if self._waiting:
            _log.warning(
                "closing with the latest turns of %d session(s) not committed to the shared "
                "tier: the other replicas will not see them",
                len(self._waiting),
            )
        self._waiting.clear()
        self._away.clear()
        self._up.clear()

    async def _pump(self, s: Session) -> None:
        core = self._core
        stopped: set[int] = set()  # tiers this pump's copy stopped short in
        dst = -1
        try:
            while not (s.dropped or s.stopping):
                dst = next((d for d in self.targets(s) if d not in stopped), -1)
                if dst < 0:
                    break
                if not await self._copy_next(s, dst) and not s.complete(dst):
                    stopped.add(dst)
        except Exception as exc:  # a bug: never left unretrieved, never silent
            core.stats.errors += 1
            _log.exception("write-through of %.80r failed", s.key)
            if dst >= 0 and core.io[dst].shared is None:
                self._failed.add(s.key)  # (that local copy: tried again at close)
            if any(core.io[d].shared is not None for d in self.targets(s)):
                # the commit, whichever copy failed: tried again (into the shared tiers
                # only), and reported by flush() until it succeeds, never taken for done
                self._later(s, exc)
        finally:
            self._local.discard(s.key)
            if s.dropped:
                self._up.discard(s.key)
            s.inflight -= 1
            core.unbusy(s.key)
            if not s.inflight:
                self._pumping.discard(s)
                if s.quiet is not None:
                    s.quiet.set()
            self._pending -= 1
            if self._pending == 0 and self._idle is not None:
                self._idle.set()

    async def _copy_next(self, s: Session, dst: int) -> bool:
        """Copy the first segment ``dst`` lacks; ``False`` when the pump should stop."""
        core = self._core
        assert s.primary is not None
        seg = next((g for g in s.segs if dst not in g.tiers), None)
        shared = core.io[dst].shared is not None
        if seg is None:
            if shared:
                self._waiting.pop(s.key, None)
            return False
        if not await claim([seg], dst):  # another conversation copied it there meanwhile
            return True
        try:
            return await self._copy_claimed(s, seg, dst, shared)
        finally:
            unclaim([seg], dst)

    async def _copy_claimed(self, s: Session, seg: Seg, dst: int, shared: bool) -> bool:
        core = self._core
        if s.primary is None or s.dropped or seg not in s.segs:  # gone while it waited
            return False
        key = seg.key
        to = core.tiers[dst]
        # (nor, until a fork's first turn is committed, are the conversations whose turns
        # it inherits victims: their copies there are what that commit references)
        first = s.first_own()
        waits = first is not None and dst not in first.tiers
        protect = {s.key, *(g.key[0] for g in s.segs[: s.base] if waits)}
        written = False
        try:
            how = await _inherited(core, s, seg, dst) if shared else "write"
            if how == "orphaned":
                record_refusal(core, s, dst, _ORPHANED)
                self._waiting.pop(s.key, None)
                return False
            if how == "there":
                stored = True  # (the tier indexes it again: nothing to write)
            else:
                stored = await reserve(core, dst, key, seg.length, protect, lossless=True)
                if stored:
                    try:
                        await copy_segments(core, s, s.primary, dst, [key], [])
                        written = True
                    finally:
                        to.release(key)
                else:
                    _log.info("write-through of %.80r stopped: tier %r is full", s.key, to.name)
        except _REFUSALS as exc:
            turns = pending(s, dst)
            n = exc.shared_turns if isinstance(exc, HistoryConflictError) else None
            if n is not None:  # turns committed here that the shared history lost: gone too
                lost = [g.header.seq for g in s.segs[max(n, s.base) :] if dst in g.tiers]
                turns = sorted({*turns, *lost})
            record_refusal(core, s, dst, exc.reason, turns)  # (its reason, not its advice)
            self._waiting.pop(s.key, None)
            self._up.discard(s.key)
            return False
        except (TierIOError, CorruptSegmentError) as exc:
            if shared and isinstance(exc, TierIOError):
                away = not isinstance(exc, CommitDelayedError)
                if away:
                    core.stats.errors += 1
                    _log.warning("write-through of %.80r: %s; will retry", s.key, exc)
                self._later(s, exc, away=away)
                return False
            core.stats.errors += 1
            _log.exception("write-through of %.80r failed", s.key)
            self._failed.add(s.key)
            stored = False
        if not stored:
            if shared:  # what is committed stays; the rest waits for room
                self._later(s, TierIOError(to.name, "take the turn", "the tier is full"))
                return False
            await remove_copy(core, s, dst)  # this copy can never be completed now
            return False
        if s.dropped or seg not in s.segs:  # dropped or lost meanwhile
            if written:
                await delete_or_orphan(core, dst, key)
            return False
        seg.tiers.add(dst)
        core.gained(s, [seg], dst)
        if written:
            core.stats.write_through += 1
        if shared:
            self._answering()
        w = self._waiting.get(s.key) if shared else None
        if w is not None:
            w.attempts, w.error = 0, None
        if s.complete(dst):
            if shared:
                self._waiting.pop(s.key, None)
                self._up.discard(s.key)
            now = core.clock()
            core.residency.admitted(core.meta(s, now), now, dst)
        return True

    def _kick(self, key: str) -> None:
        """Try a waiting commit now; forget it if there is nothing left to copy."""
        s = self._core.sessions.get(key)
        if s is not None and not s.dropped:
            self.resume(s, local=False)
        if s is not None and s.deferred is not None:
            return  # (started when the reconciliation holding it ends)
        if s is None or not s.inflight:  # (nothing to copy, dropped, or not inclusive)
            self._waiting.pop(key, None)

    def _later(self, s: Session, error: BaseException, *, away: bool = False) -> None:
        """Try ``s``'s commit again later (after the takeover delay, or with backoff);
        ``away``: the shared tier failed it (tried again as soon as another commit gets
        through, :meth:`_answering`)."""
        if away:
            self._away.add(s.key)
        else:
            self._away.discard(s.key)
        w = self._waiting.setdefault(s.key, _Waiting())
        w.error = error
        if isinstance(error, CommitDelayedError):
            delay = error.retry_in + 0.005
        else:
            delay = min(_BACKOFF[0] * 2**w.attempts, _BACKOFF[1])
            w.attempts += 1
        w.due = time.monotonic() + delay
        if self._retrier is None or self._retrier.done():
            self._retrier = self._spawn(self._retry_loop())
        elif self._wake is not None:
            self._wake.set()

    def _answering(self) -> None:
        """A commit got through, or a load's look-up (a replica that takes no new turn has
        no commit of its own to tell it): the shared tier answers again. The commits that
        waited out its failure are due now, not at the end of their backoff (up to 5 s
        after the server came back); one that fails again waits as long as it would have."""
        if not self._away:
            return
        now = time.monotonic()
        for key in self._away:
            w = self._waiting.get(key)
            if w is not None:
                w.due = min(w.due, now)
        self._away.clear()
        if self._wake is not None:
            self._wake.set()

    async def _retry_loop(self) -> None:
        """Restart the waiting commits when they are due, until none waits."""
        core = self._core
        while self._waiting:
            due = min(w.due for w in self._waiting.values())
            self._wake = anyio.Event()
            with anyio.move_on_after(max(0.0, due - time.monotonic())):
                await self._wake.wait()
            now = time.monotonic()
            for key, w in list(self._waiting.items()):
                s = core.sessions.get(key)
                if s is not None and s.inflight:  # a pump is at it already: look again later
                    w.due = max(w.due, now + _BACKOFF[0])
                elif w.due <= now:
                    w.due = now + _BACKOFF[1]  # (until this attempt reports back)
                    self._kick(key)


_ORPHANED = (
    "the turns it inherits left the shared tier before its first turn was committed there "
    "(its parent was dropped, or another history took the parent's key)"
)


async def _inherited(core: Core, s: Session, seg: Seg, t: int) -> str:
    """How ``s``'s background copy puts ``seg`` into shared tier ``t``: ``"write"`` (its own
    turn, or a turn it inherits that its owner here still lists: committed as the owner's
    turn, as the owner's own copy would), ``"there"`` (the owner's committed history there
    holds it: the owner left this replica's index, evicted, while the server kept it; the
    look-up indexed it again, nothing is written) or ``"orphaned"``. Only its owner
    commits a segment there; a fork's first turn references it. A turn whose owner's
    history there no longer holds it (dropped, or another history took its key) must not
    be written again under the owner's key, where it would bring the dropped history back,
    or be taken for another one: the fork cannot be committed.

    :raises TierIOError: the shared tier could not be asked (try again later)
    """
    owner, seq = seg.key
    u = core.sessions.get(owner)
    if owner == s.key or (u is not None and not u.dropped and seg in u.segs):
        return "write"
    tier = core.io[t].shared
    assert tier is not None
    history = await tier.lookup(owner)
    held = seq < len(history) and plain_header(history[seq]) == plain_header(seg.header)
    return "there" if held and tier.contains(seg.key) else "orphaned"


def _retrieved(task: asyncio.Task[None]) -> None:
    """A done callback: an exception the task let out is logged here, never left
    unretrieved (the pumps catch everything themselves)."""
    if not task.cancelled() and task.exception() is not None:
        _log.error("a background task of the cache failed", exc_info=task.exception())
