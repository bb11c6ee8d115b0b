"""What a close does with the conversations that only volatile tiers hold: write them down.

In exclusive mode a conversation in host memory has no other copy (and after a restart,
loading one moves it into host memory and deletes the copy it came from). A close that just
let host memory go would lose every one of them. So :meth:`~tieredkv.TieredKVCache.aclose`
first writes each conversation that no persistent tier holds whole down to one
(:func:`write_down`): into free room only, since evicting a conversation the persistent tier
holds would trade one loss for another; most recently used first, so that what a full tier
or the close timeout leaves out is what was used longest ago; each conversation all or
nothing (a partial copy left from an earlier write-through is removed rather than kept as an
older history). What it could not write is counted and logged.
"""

from __future__ import annotations

import logging
import math
import time

import anyio

from ..errors import CorruptSegmentError, InvalidArgumentError, InvalidTypeError, TierIOError
from .placement import copy_into_room, purge_orphans, remove_copy
from .state import Core, Session
from .writethrough import WriteThrough

__all__ = ["check_timeout", "close", "write_down"]

_log = logging.getLogger("tieredkv.cache")

PROGRESS_EVERY = 5.0
"""Seconds between progress lines of a long write-down."""

UNDO_WAIT = 30.0
"""Seconds a close waits for the operations it cancelled (out of ``close_timeout``) to be
undone before it closes the tiers under them."""


def check_timeout(what: str, value: object) -> float:
    """``value`` as seconds if it is a number from 0 (``math.inf`` allowed), else a
    :class:`~tieredkv.errors.TieredKVError` saying what to pass."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTypeError(f"{what} must be a number of seconds, not {value!r}")
    if math.isnan(value) or value < 0:
        raise InvalidArgumentError(
            f"{what} must be from 0 seconds (math.inf for no bound), not {value!r}"
        )
    return float(value)


async def close(core: Core, pumps: WriteThrough, budget: float) -> None:
    """Keep what the cache holds, then close every tier (see
    :meth:`~tieredkv.TieredKVCache.aclose`), within ``budget`` seconds; never raises for
    what fails on the way (it is logged)."""
    deadline = time.monotonic() + budget
    core.closing = True
    try:
        # what is under way finishes first: a load or prefetch that moved a conversation
        # up after the write-down looked would leave it in a volatile tier alone (lost)
        with anyio.move_on_after(budget):
            await core.wait_operations()
        if core.operations:
            # closing the tiers under them would cut their moves in half (an SSD write's
            # rename done, its fsync and clean-up failing): each is undone, as a cancelled
            # call is, or completes past its point of no return; either raises ClosedError
            _log.warning(
                "closing: %d operation(s) still under way after close_timeout (%g s): "
                "cancelling them (each is undone, or completes past its point of no "
                "return, and raises ClosedError)",
                core.cancel_operations(),
                budget,
            )
            with anyio.move_on_after(UNDO_WAIT):
                await core.wait_operations()
            if core.operations:
                _log.error(
                    "closing: %d operation(s) still under way %g s after they were "
                    "cancelled; closing the tiers under them: what they move may be lost",
                    core.operations,
                    UNDO_WAIT,
                )
        pumps.retry_failed()
        with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
            await pumps.flush()
        for s in core.sessions.values():  # out of time: copies stop at a segment's end
            s.stopping = True
        await pumps.flush()
        await purge_orphans(core)
        await write_down(core, deadline, budget)
        await purge_orphans(core)
    except Exception:
        _log.exception("closing the cache failed; closing its tiers")
    finally:
        pumps.cancel_all()  # none left
        for tier in core.tiers:
            try:
                await tier.aclose()
            except Exception:
                _log.exception("closing tier %r failed", tier.name)
        core.sessions.clear()
        core.busy.clear()
        core.orphans.clear()
        core.staging.close()
        core.outputs.close()


async def write_down(core: Core, deadline: float, budget: float) -> None:
    """Write every conversation that only volatile tiers hold down to a persistent tier,
    starting none after ``deadline`` (``time.monotonic``; ``budget``, the close timeout it
    came from, is what the log says).

    Adds to ``core.stats.written_down`` and ``core.stats.unsaved``.
    """
    tiers = core.tiers
    keep = [t for t, tier in enumerate(tiers) if tier.persistent]
    targets = [t for t in keep if core.io[t].shared is None]
    pending = [s for s in core.sessions.values() if s.primary is not None and not _kept(s, keep)]
    if not targets or not pending:
        return
    pending.sort(key=lambda s: _last_access(core, s), reverse=True)
    names = ", ".join(repr(tiers[t].name) for t in targets)
    total = sum(s.nbytes() for s in pending)
    _log.info(
        "closing: writing %d conversation(s) (%s bytes) held only in volatile tiers down to "
        "%s (close_timeout %g s)",
        len(pending),
        f"{total:,}",
        names,
        budget,
    )
    began = last = time.monotonic()
    written = nbytes = 0
    outcomes = {"room": 0, "error": 0, "late": 0, "gone": 0}
    for s in pending:
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY:
            _log.info(
                "closing: wrote %d of %d conversation(s) so far (%.1f s)",
                written,
                len(pending),
                now - began,
            )
            last = now
        outcome = await _write_one(core, s, keep, targets, late=now >= deadline)
        if outcome == "written":
            written += 1
            nbytes += s.nbytes()
        else:
            outcomes[outcome] += 1
    unsaved = len(pending) - written - outcomes["gone"]
    core.stats.written_down += written
    core.stats.unsaved += unsaved
    if not unsaved:
        _log.info(
            "closing: wrote %d conversation(s) (%s bytes) down in %.2f s",
            written,
            f"{nbytes:,}",
            time.monotonic() - began,
        )
        return
    _log.warning(
        "closing: %d of %d conversation(s) held only in volatile tiers could not be written "
        "down (%d for want of room in %s, %d by I/O errors, %d by the close timeout of %g s): "
        "they are lost with this close (stats().unsaved counts them); give the persistent "
        "tier more room, or the cache a longer close_timeout",
        unsaved,
        len(pending),
        outcomes["room"],
        names,
        outcomes["error"],
        outcomes["late"],
        budget,
    )


def _kept(s: Session, keep: list[int]) -> bool:
    return any(s.complete(t) for t in keep)


def _last_access(core: Core, s: Session) -> float:
    meta = core.channel.get(s.key)
    return meta.last_access if meta is not None else 0.0


async def _write_one(
    core: Core, s: Session, keep: list[int], targets: list[int], *, late: bool
) -> str:
    """Write ``s`` down to the first of ``targets`` with room (unless ``late``):
    ``"written"``, or why not (``"room"``, ``"error"``, ``"late"``, or ``"gone"`` when an
    operation in flight dropped it meanwhile)."""
    async with core.hold(s):
        if s.primary is None:
            return "gone"
        if _kept(s, keep):  # an operation in flight wrote it down meanwhile
            return "written"
        if late:
            await _drop_partial(core, s, targets)
            return "late"
        failed = False
        for t in targets:
            if t == s.primary:
                continue
            try:
                if await copy_into_room(core, s, t):
                    return "written"
            except (TierIOError, CorruptSegmentError) as exc:
                core.stats.errors += 1
                failed = True
                _log.warning(
                    "closing: could not write %.80r down to %r: %s", s.key, core.tiers[t].name, exc
                )
        await _drop_partial(core, s, targets)
        return "error" if failed else "room"


async def _drop_partial(core: Core, s: Session, targets: list[int]) -> None:
    """Remove what part of ``s`` the persistent tiers hold (a restart would serve it as an
    older history)."""
    changed = False
    for t in targets:
        if s.holds(t) and not s.complete(t):
            await remove_copy(core, s, t)
            changed = True
    if changed:
        core.publish(s)
