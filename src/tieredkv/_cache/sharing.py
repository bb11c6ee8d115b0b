"""Sharing conversations across replicas through a shared tier (see
:class:`~tieredkv.backends.shared.SharedTier`, e.g. Redis).

Several caches configured with the same shared tier see each other's conversations. A
replica asks the shared tier about a conversation before it loads or prefetches it
(:func:`discover`): what it finds there replaces this replica's view when it is newer
(another replica appended turns) or another version, and this replica's stale copies in
its own tiers are deleted. The metadata channel then gets the conversation's size, tokens
and previous answer length from the shared tier's headers, so the policies work across
replicas.

One writer per conversation: the replica that loads a conversation takes its writer
lease (``take``), and an append first checks that this replica still holds it
(:func:`check_writer`), so a replica that another has taken the conversation from gets
:class:`~tieredkv.errors.StaleWriterError` and stores nothing.
"""

from __future__ import annotations

import functools

from ..backends.shared import SharedTier
from ..errors import SchemaMismatchError
from ..payload import SegmentHeader, header_schema
from .atomic import settle
from .placement import forget_copy, remove_copy
from .state import Core, Seg, Session

__all__ = ["check_writer", "discover", "shared_tiers"]


def shared_tiers(core: Core) -> list[tuple[int, SharedTier]]:
    """The shared tiers, with their levels."""
    return [(t, tier) for t, tier in enumerate(core.tiers) if isinstance(tier, SharedTier)]


async def check_writer(core: Core, session: str) -> None:
    """Make sure this replica may append to ``session`` in every shared tier.

    :raises StaleWriterError: another replica took the conversation over
    :raises LeaseHeldError: another replica's lease on a conversation new to this one is live
    """
    for _, tier in shared_tiers(core):
        await tier.ensure_writer(session)


async def discover(core: Core, key: str, *, take: bool) -> None:
    """Bring the shared tiers' state of ``key`` into the index; with ``take``, this replica
    takes the conversation's writer lease (another replica's next write is refused)."""
    for t, tier in shared_tiers(core):
        s = core.sessions.get(key)
        if s is None:
            s = core.sessions[key] = Session(key, len(core.tiers))
        try:
            async with core.hold(s):
                if core.sessions.get(key) is not s:  # dropped while we waited
                    continue
                # a move like any other: cancellation waits for it, then is raised
                _, cancel = await settle(functools.partial(_look, core, s, t, tier, take))
                if cancel is not None:
                    raise cancel
        finally:
            core.discard_unused(s)  # nothing found: no empty entry stays behind


async def _look(core: Core, s: Session, t: int, tier: SharedTier, take: bool) -> None:
    await s.wait_quiet()  # no write into the shared tier under way
    await _adopt(core, s, t, await tier.lookup(s.key))
    if take and s.primary is not None:
        await tier.acquire(s.key, force=True)


async def _adopt(core: Core, s: Session, t: int, headers: list[SegmentHeader]) -> None:
    """Make ``s`` agree with what shared tier ``t`` holds (``headers``, just looked up)."""
    local = [seg.header for seg in s.segs]
    if headers and local and s.schema is not None:
        diff = s.schema.describe_difference(header_schema(headers[0]))
        if diff is not None:  # another model's KV under the same key: not ours
            raise SchemaMismatchError(s.key, diff)
    n = len(headers)
    if n <= len(local) and headers == local[:n]:
        # this replica's history is as new as the shared one, or newer
        s.held[t] = set(range(n))
        if not s.complete(t) and (s.held[t] or s.primary == t):
            # the shared copy lost segments: what is left of it there is of no use
            await forget_copy(core, s, t)
        return
    # the shared copy is newer (another replica appended) or another version: take it and
    # let go of this replica's stale copies
    schema = header_schema(headers[0])
    good = next((i for i, h in enumerate(headers) if header_schema(h) != schema), n)
    for u in range(len(core.tiers)):
        if u != t and s.held[u]:
            await remove_copy(core, s, u)
    s.segs = [Seg(h) for h in headers[:good]]
    s.schema = schema
    s.held[t] = set(range(good))
    s.primary = t
    now = core.clock()
    meta = core.publish(s, now, answer=headers[good - 1].answer_tokens)
    core.policies[t].on_admit(s.key, meta, now)
