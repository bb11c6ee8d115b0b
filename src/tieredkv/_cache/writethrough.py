"""Background copies to the next tier (inclusive mode, "write-through").

After an append to tier ``t``, a pump copies the session's segments that tier ``t + 1``
lacks, in order, so that evicting the session from ``t`` later costs no write on the
critical path. The pump runs in a task of its own (no caller's cancellation reaches it),
marks the session busy (never a victim), and builds the lower copy as a prefix: a copy
that cannot be completed (no room, an I/O error) is removed rather than left to waste
space. A copy joins the index segment by segment, and the lower tier's policy admits the
session once the copy is complete.
"""

from __future__ import annotations

import asyncio
import logging

import anyio

from ..errors import CorruptSegmentError, TierIOError
from .placement import copy_segment, delete_or_orphan, remove_copy, reserve
from .state import Core, Session

__all__ = ["WriteThrough"]

_log = logging.getLogger("tieredkv.cache")


class WriteThrough:
    """The pumps of one cache, and a way to wait for all of them."""

    def __init__(self, core: Core) -> None:
        self._core = core
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending = 0
        self._idle: anyio.Event | None = None
        self._failed: set[str] = set()
        """Sessions whose copy an I/O error stopped (tried once more at close)."""

    def start(self, s: Session, dst: int) -> None:
        """Make sure a pump is copying ``s``'s missing segments into ``dst``."""
        if s.inflight:  # the running pump picks up the new segment
            return
        # A plain asyncio task rather than a task group: the cache may be opened and closed
        # from different tasks (e.g. a framework's startup and shutdown hooks).
        s.inflight += 1
        s.quiet = anyio.Event()
        self._core.busy[s.key] += 1
        self._pending += 1
        if self._pending == 1:
            self._idle = anyio.Event()
        task = asyncio.get_running_loop().create_task(self._pump(s, dst))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, s: Session) -> None:
        """Stop ``s``'s background copy early and wait for it (a drop is coming).

        If the wait is cancelled, the drop will not happen: the copy is restarted.
        """
        s.stopping = True
        try:
            await s.wait_quiet()
        except BaseException:
            s.stopping = False
            self.resume(s)
            raise

    def resume(self, s: Session) -> None:
        """In inclusive mode, restart ``s``'s copy to the next tier if it is incomplete there
        (a pump stopped early: by a drop that was then cancelled, or by an I/O error)."""
        p = s.primary
        if self._core.mode != "inclusive" or p is None or p + 1 >= len(self._core.tiers):
            return
        if not s.complete(p + 1) and not s.dropped:
            self.start(s, p + 1)

    def retry_failed(self) -> None:
        """Restart the copies that an I/O error stopped (at close, so a restart finds those
        sessions). A copy removed for want of room, or evicted, is not restarted: that was
        the policy's choice, and copying it now would evict another session's copy."""
        failed, self._failed = self._failed, set()
        for key in failed:
            s = self._core.sessions.get(key)
            if s is not None:
                self.resume(s)

    async def flush(self) -> None:
        """Wait until every pump started so far has finished."""
        while self._pending and self._idle is not None:
            await self._idle.wait()

    def cancel_all(self) -> None:
        """Stop the pumps (only at close, after an interrupted flush)."""
        for task in tuple(self._tasks):
            task.cancel()

    async def _pump(self, s: Session, dst: int) -> None:
        core = self._core
        try:
            while not (s.dropped or s.stopping) and s.primary is not None and s.primary < dst:
                if not await self._copy_next(s, dst):
                    break
        finally:
            s.inflight -= 1
            core.unbusy(s.key)
            if not s.inflight and s.quiet is not None:
                s.quiet.set()
            self._pending -= 1
            if self._pending == 0 and self._idle is not None:
                self._idle.set()

    async def _copy_next(self, s: Session, dst: int) -> bool:
        """Copy the first segment ``dst`` lacks; ``False`` when the pump should stop."""
        core = self._core
        assert s.primary is not None
        seg = next((g for g in s.segs if g.header.seq not in s.held[dst]), None)
        if seg is None:
            return False
        key = (s.key, seg.header.seq)
        to = core.tiers[dst]
        try:
            stored = await reserve(core, dst, key, seg.length, {s.key}, lossless=True)
            if stored:
                try:
                    await copy_segment(core, s, s.primary, dst, key)
                finally:
                    to.release(key)
            else:
                _log.info("write-through of %.80r stopped: tier %r is full", s.key, to.name)
        except (TierIOError, CorruptSegmentError):
            core.stats.errors += 1
            _log.exception("write-through of %.80r failed", s.key)
            self._failed.add(s.key)
            stored = False
        if not stored:  # this copy can never be completed now: free its space
            await remove_copy(core, s, dst)
            return False
        if s.dropped or seg not in s.segs:  # dropped or lost meanwhile
            await delete_or_orphan(core, dst, key)
            return False
        s.held[dst].add(seg.header.seq)
        core.stats.write_through += 1
        if s.complete(dst):
            now = core.clock()
            core.policies[dst].on_admit(s.key, core.publish(s, now), now)
        return True
