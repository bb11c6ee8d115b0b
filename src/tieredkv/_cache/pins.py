"""The bounds on pinned bytes: on all pinned conversations (``max_pinned_bytes``) and on
those of each pin group (``max_pinned_bytes_per_group``).

The bytes a set of pinned conversations holds are those of the distinct segments they
list: a fork and the parent it shares its first turns with, both pinned, count those
turns once (the tier holds them once). Two places check the bounds:

- a new pin (:meth:`TieredKVCache.hint <tieredkv.TieredKVCache.hint>`) is refused past
  either, nothing changed (:func:`past_bound`);
- a pinned conversation whose history grows past either, whatever made it grow (its own
  append, or a newer history another replica committed and this one adopted), loses its
  pin, logged, in the metadata published with its new size (:func:`kept_within`, which
  :meth:`Core.meta <tieredkv._cache.state.Core.meta>` calls for every pinned conversation
  that grew).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from ..errors import PinLimitError
from ..meta import KVMeta, MetadataChannel

if TYPE_CHECKING:  # (state calls this module)
    from .state import Seg, Session

__all__ = ["PinBounds", "kept_within", "past_bound"]

_log = logging.getLogger("tieredkv.cache")


class PinBounds:
    """The two bounds (bytes): ``total`` on every pinned conversation, ``per_group`` on
    each group's (``None``: none per group)."""

    __slots__ = ("per_group", "total")

    def __init__(self, total: int, per_group: int | None) -> None:
        self.total = total
        self.per_group = per_group


def _pinned(
    sessions: dict[str, Session],
    channel: MetadataChannel,
    now: float,
    but: str,
    group: str | None,
) -> Iterable[Session]:
    """The conversations pinned at ``now`` but ``but`` (of ``group`` only, if given)."""
    for key, until in channel.pins.items():
        if until <= now or key == but:
            continue
        meta = channel.get(key)
        s = sessions.get(key)
        if meta is not None and s is not None and (group is None or meta.pin_group == group):
            yield s


def _held(segs: Iterable[Seg], pinned: Iterable[Session]) -> tuple[int, int]:
    """The bytes the ``pinned`` conversations hold, and what ``segs`` add to them (each
    distinct segment counted once)."""
    held: set[Seg] = set()
    for s in pinned:
        held.update(s.segs)
    more = {seg for seg in segs if seg not in held}
    return sum(seg.length for seg in held), sum(seg.length for seg in more)


def past_bound(
    bounds: PinBounds,
    sessions: dict[str, Session],
    channel: MetadataChannel,
    meta: KVMeta,
    group: str | None,
    now: float,
) -> PinLimitError | None:
    """The bound that ``meta``'s conversation, pinned in ``group`` at ``now``, would pass
    (the one on all pinned bytes first, then its group's), as the error that says so (its
    ``nbytes``: what the pin adds to that bound's count); ``None`` within both."""
    key = meta.session
    s = sessions.get(key)
    segs = s.segs if s is not None else []
    pinned, adds = _held(segs, _pinned(sessions, channel, now, key, None))
    if pinned + adds > bounds.total:
        return PinLimitError(key, adds, pinned, bounds.total)
    if group is not None and bounds.per_group is not None:
        pinned, adds = _held(segs, _pinned(sessions, channel, now, key, group))
        if pinned + adds > bounds.per_group:
            return PinLimitError(key, adds, pinned, bounds.per_group, group)
    return None


def kept_within(
    bounds: PinBounds,
    sessions: dict[str, Session],
    channel: MetadataChannel,
    meta: KVMeta,
    now: float,
) -> KVMeta:
    """``meta`` (of a conversation pinned at ``now`` that grew), or, if its pin now passes
    a bound, ``meta`` without its pin (logged)."""
    passed = past_bound(bounds, sessions, channel, meta, meta.pin_group, now)
    if passed is None:
        return meta
    what, setting = "pinned bytes", "max_pinned_bytes"
    if passed.group is not None:
        what, setting = f"the pinned bytes of group {passed.group!r}", setting + "_per_group"
    _log.warning(
        "conversation %r grew to %d bytes: %s (%d) passed %s (%d), so its pin is released",
        meta.session,
        meta.nbytes,
        what,
        passed.pinned + passed.nbytes,
        setting,
        passed.bound,
    )
    return msgspec.structs.replace(meta, pinned_until=None, pin_group=None)
