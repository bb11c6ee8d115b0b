"""Retention hints given with a served turn: applied once the turn is stored, a pin past
the cache's bound refused without losing the turn or the rest of the hint.

The engines (the vLLM connector's workers, the transformers adapter, and through it the
serving loop) store a turn and then apply the hint its request carried. The turn is the
request's answer and must not be lost to a hint: a pin that would take the pinned bytes
past :attr:`~tieredkv.TieredKVCache.max_pinned_bytes`, or its group's past
:attr:`~tieredkv.TieredKVCache.max_pinned_bytes_per_group`, is refused (logged, as a
warning that says which bound and how to fix it) and the hint's advice (``next_turn_in``,
``priority``, ``tool_call``) is applied without it.
"""

from __future__ import annotations

import logging

import msgspec

from ..cache import TieredKVCache
from ..errors import PinLimitError
from ..meta import KVMeta, RetentionHint

__all__ = ["apply_turn_hint"]

_log = logging.getLogger(__name__)


def apply_turn_hint(
    cache: TieredKVCache, session: str, hint: RetentionHint, *, what: str = "the hint"
) -> tuple[KVMeta, PinLimitError | None]:
    """Apply ``hint`` to a stored conversation (:meth:`TieredKVCache.hint`); a pin past
    a bound (the cache's, or its group's) is refused, logged, and the rest applied.

    :param what: how the log line names the hint's origin (e.g. the request)
    :returns: the conversation's metadata with the hint, and the refusal if the pin was
    :raises SessionNotFoundError: the cache does not hold the conversation
    """
    try:
        return cache.hint(session, hint), None
    except PinLimitError as exc:
        _log.warning("%s: pin refused, the rest applied: %s", what, exc)
        rest = msgspec.structs.replace(hint, pin=None, ttl=None, group=None)
        return cache.hint(session, rest), exc
