"""Layer-wise (streamed) restores: a history arrives group by group of its tensors.

A history of ``n`` turns is ``n`` segments, each holding every layer's tensors of its turn
(:mod:`tieredkv.payload`). A model needs layer 0's history first, then layer 1's, ...; so a
streamed restore reads, from every segment, the byte span of the first group of tensors,
then of the second, and so on (CachedAttention's layer-wise pre-loading, Gao et al., USENIX
ATC'24, section 3.2), and says when each group has been copied into the caller's tensors.
The model computes layer ``L`` as soon as its group is in, while later groups are read.

Spans are disjoint and aligned: group ``g`` of a segment is ``[align_up(end of group g-1),
align_up(end of group g))`` (group 0 from 0, so it holds the header; the last group runs to
the segment's end), read into a segment-sized buffer at the same offsets. A boundary that
falls inside the next group's first tensor only means that part of it arrives early.

Where the history lives decides where the bytes go:

* in tier 0 (host memory): the groups are copied from the slots, in order;
* on a lower tier, and it fits in tier 0: it is read straight into fresh tier-0 slots (a
  promotion, as :meth:`~tieredkv.TieredKVCache.prefetch` would make, from the same reads:
  nothing is read twice), and each group is copied out of the slots as it lands;
* otherwise: into a staging buffer, copied out group by group.

Lossless: the model may compute on bytes not yet verified, but every segment is verified
as a whole (header CRC, body hash, MACs: the tier's own checks) before the restore reports
success, and a caller returns nothing computed from it before then
(:meth:`LayerwiseLoad.finished`). A promotion becomes part of the index only after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import ExitStack

import anyio
import torch

from .._copy import copy_tensor
from ..errors import (
    CorruptSegmentError,
    InvalidArgumentError,
    RestoreFailedError,
    SessionNotFoundError,
    TierIOError,
)
from ..payload import Schema, SegmentHeader, align_up, segment_tensors
from .atomic import settle
from .forest import copying
from .gather import check_into
from .placement import drop_damaged, end_filling, finish_promotion, start_promotion
from .state import Core, Session
from .turns import commit_load, damaged, missed

__all__ = ["LayerwiseLoad", "check_groups", "layerwise", "reported", "stream"]


class LayerwiseLoad:
    """A streamed restore in progress (from :meth:`TieredKVCache.load_layerwise
    <tieredkv.TieredKVCache.load_layerwise>`).

    Groups land in order: once group ``g`` is in, groups ``0 .. g`` all are. The bytes of a
    landed group may not be verified yet; :meth:`finished` says when everything is.
    """

    def __init__(self, session: str, groups: int, tokens: int) -> None:
        self.session = session
        """The session being restored."""
        self.groups = groups
        """How many groups the tensors were split into."""
        self.tokens = tokens
        """Tokens of history being restored (positions filled in each output tensor)."""
        self._cond = threading.Condition()
        self._landed = -1
        self._failed = False
        self._task: asyncio.Task[BaseException | None] | None = None

    # -- for the model's thread -------------------------------------------------------------
    def landed(self) -> int:
        """Groups in place so far (``0 .. landed() - 1``)."""
        with self._cond:
            return self._landed + 1

    def wait(self, group: int, timeout: float | None = None) -> bool:
        """Block until group ``group`` is in place (call it from a worker thread, never
        from the event loop); ``False`` if ``timeout`` seconds passed first.

        :raises RestoreFailedError: if the restore failed (the group will never land)
        """
        if not 0 <= group < self.groups:
            raise InvalidArgumentError(f"group {group} is not in 0 .. {self.groups - 1}")
        with self._cond:
            ok = self._cond.wait_for(lambda: self._landed >= group or self._failed, timeout)
            if self._landed >= group:
                return True
            if self._failed:
                raise RestoreFailedError(self.session)
            return ok

    # -- for the caller's task ----------------------------------------------------------------
    def when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the event loop once the restore has ended (every byte in
        and verified, or failed), even while the caller is still computing."""
        assert self._task is not None
        self._task.add_done_callback(lambda _: callback())

    async def finished(self) -> None:
        """Wait until every byte is in place and verified.

        Cancelling the caller does not stop the restore (it completes or rolls back on its
        own, see :meth:`TieredKVCache.load_layerwise`).

        :raises SessionNotFoundError: the history was found damaged (it is gone: a miss)
        :raises TierIOError: reading failed (the history stays where it was)
        """
        assert self._task is not None
        error = await asyncio.shield(self._task)
        if error is not None:
            raise reported(self.session, error) from None

    # -- for the restore ----------------------------------------------------------------------
    def _land(self, group: int) -> None:
        with self._cond:
            self._landed = max(self._landed, group)
            self._cond.notify_all()

    def _fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def _start(self, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run()`` (a coroutine function) in a task of its own, which nobody cancels."""

        async def guarded() -> BaseException | None:
            try:
                await run()
            except Exception as exc:  # reported through finished() and the context's exit
                self._fail()
                return exc
            return None

        self._task = asyncio.get_running_loop().create_task(guarded())

    async def _outcome(self) -> BaseException | None:
        assert self._task is not None
        return await asyncio.shield(self._task)


def reported(session: str, error: BaseException) -> BaseException:
    """What a failed restore raises to its caller: a damaged history is a miss."""
    if isinstance(error, CorruptSegmentError):
        return SessionNotFoundError(session, damaged(error))
    return error


def check_groups(schema: Schema, groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """``groups`` as lists, refused unless they split the stored names in storage order."""
    flat = [name for group in groups for name in group]
    if not groups or any(not group for group in groups) or tuple(flat) != schema.names:
        raise InvalidArgumentError(
            f"groups must split the session's tensor names, in the order they are stored, "
            f"into non-empty groups: {list(schema.names)}"
        )
    return [list(group) for group in groups]


def _ends(header: SegmentHeader, groups: list[list[str]]) -> list[int]:
    """Where each group's span of this segment ends (aligned; the last at its length)."""
    specs = {spec.name: spec for spec in header.tensors}
    ends = []
    for group in groups[:-1]:
        last = specs[group[-1]]
        ends.append(align_up(header.body_offset + last.offset + last.nbytes))
    ends.append(header.length)
    return ends


class _Scatter:
    """Copies each landed group of every segment from its buffer into the outputs."""

    def __init__(
        self, s: Session, out: dict[str, torch.Tensor], groups: list[list[str]], load: LayerwiseLoad
    ) -> None:
        self._s = s
        self._out = out
        self._groups = groups
        self._moves: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in groups]
        self._load = load

    def use(self, buffers: Sequence[memoryview]) -> None:
        """Copy from ``buffers`` (one per segment, each holding all of it once it lands)."""
        dim = self._s.schema.token_dim if self._s.schema is not None else 0
        offset = 0
        for seg, take, buf in zip(self._s.segs, self._s.takes, buffers, strict=True):
            views = segment_tensors(buf, seg.header)
            for g, group in enumerate(self._groups):
                self._moves[g].extend(
                    (self._out[name].narrow(dim, offset, take), views[name].narrow(dim, 0, take))
                    for name in group
                )
            offset += take

    def __call__(self, group: int) -> None:
        for dst, src in self._moves[group]:
            copy_tensor(dst, src, non_blocking=False)
        self._load._land(group)

    def all(self) -> None:
        for g in range(len(self._moves)):
            self(g)

    def all_from(self, buffers: list[memoryview]) -> None:
        self.use(buffers)
        self.all()

    def close(self) -> None:
        """Drop the tensor views of the buffers (so the buffers can be released)."""
        self._moves = []


@contextlib.asynccontextmanager
async def layerwise(
    core: Core, s: Session, out: Mapping[str, torch.Tensor], groups: Sequence[Sequence[str]]
) -> AsyncIterator[LayerwiseLoad]:
    """``async with``: stream ``s`` (locked, stored) into ``out`` group by group while the
    caller computes (see :meth:`~tieredkv.TieredKVCache.load_layerwise`); leaving waits for
    the restore, raises what it raised, and counts the load only if the block finished."""
    assert s.schema is not None
    parts = check_groups(s.schema, groups)
    target = check_into(out)(s.schema, s.tokens())
    began = core.clock()
    hit = s.primary == 0
    load = LayerwiseLoad(s.key, len(parts), s.tokens())
    load._start(lambda: stream(core, s, target, parts, load))
    try:
        yield load
    except BaseException as exc:
        error, cancel = await settle(load._outcome)
        if isinstance(error, CorruptSegmentError):
            await missed(core, s)  # (it cannot start again from a whole copy elsewhere)
        if cancel is not None:
            raise cancel from None
        if error is not None and isinstance(exc, RestoreFailedError):
            raise reported(s.key, error) from None
        raise
    error, cancel = await settle(load._outcome)
    if isinstance(error, CorruptSegmentError):
        await missed(core, s)
    if cancel is not None:
        raise cancel
    if error is not None:
        raise reported(s.key, error) from None
    commit_load(core, s, hit, began)


async def stream(
    core: Core,
    s: Session,
    out: dict[str, torch.Tensor],
    groups: list[list[str]],
    load: LayerwiseLoad,
) -> None:
    """Fill ``out`` with ``s``'s history group by group (run in a task nobody cancels, with
    the session's lock held); promote it to tier 0 on the way when it fits there."""
    assert s.primary is not None
    src = s.primary
    fits = core.io[0].view is not None and s.nbytes() <= core.tiers[0].capacity
    if src != 0 and fits and await _stream_promoting(core, s, out, groups, load):
        return
    io = core.io[s.primary]
    scatter = _Scatter(s, out, groups, load)
    if io.view is not None:
        try:
            await io.read_in_place(s.segment_keys(), scatter.all_from)
        finally:
            scatter.close()
        return
    with core.staging.buffer(s.nbytes()) as whole:
        buffers, at = [], 0
        for seg in s.segs:
            buffers.append(whole[at : at + seg.length])
            at += seg.length
        scatter.use(buffers)
        try:
            await _read_checked(core, s, src, buffers, groups, scatter)
        finally:
            scatter.close()
            for b in buffers:
                b.release()


async def _read_checked(
    core: Core,
    s: Session,
    src: int,
    buffers: Sequence[memoryview | None],
    groups: list[list[str]],
    scatter: _Scatter,
) -> None:
    """Read ``s``'s segments from tier ``src`` into ``buffers`` (``None``: already there);
    ``scatter`` each group as it lands: span by span where the tier streams and every
    segment is read, else once everything is in. A damaged segment costs ``s`` that copy."""
    io = core.io[src]
    keys = s.segment_keys()
    try:
        if all(b is not None for b in buffers):
            into = [b for b in buffers if b is not None]
            ends = [_ends(seg.header, groups) for seg in s.segs]
            await io.read_landing(keys, into, ends, scatter)
            return
        wanted = [(k, b) for k, b in zip(keys, buffers, strict=True) if b is not None]
        await io.tier.read([k for k, _ in wanted], [b for _, b in wanted])
    except CorruptSegmentError as exc:
        await drop_damaged(core, s, src, exc.where)
        raise
    except TierIOError:
        core.stats.errors += 1
        raise
    await anyio.to_thread.run_sync(scatter.all)


async def _stream_promoting(
    core: Core,
    s: Session,
    out: dict[str, torch.Tensor],
    groups: list[list[str]],
    load: LayerwiseLoad,
) -> bool:
    """Read ``s`` into fresh tier-0 slots, scattering as groups land, and make tier 0 its
    primary (as :func:`~tieredkv._cache.placement.promote` does); ``False`` (nothing
    changed) if room cannot be made there."""
    assert s.primary is not None
    src = s.primary
    top = core.io[0]
    assert top.view is not None
    assert top.commit is not None
    began = core.clock()
    missing = await start_promotion(core, s, src)
    if missing is None:
        return False  # room could not be made: stream from where it is
    try:
        with ExitStack() as release:
            for key in missing:
                release.callback(top.tier.release, key)  # until committed
            await copying(core, missing, 0)  # (a persistent tier 0: retirement markers)
            keys = s.segment_keys()
            views = [top.view(key) for key in keys]
            wanted = set(missing)
            scatter = _Scatter(s, out, groups, load)
            scatter.use(views)
            try:
                into = [v if k in wanted else None for k, v in zip(keys, views, strict=True)]
                await _read_checked(core, s, src, into, groups, scatter)
            finally:
                scatter.close()
            for key in missing:
                top.commit(key)
            release.pop_all()
        for key in missing:
            s.seg(key).tiers.add(0)
        core.gained(s, [s.seg(key) for key in missing], 0)
    finally:
        core.set_transfer(s, None)
        await end_filling(core, s, 0)
    await finish_promotion(core, s, src, began)
    return True
