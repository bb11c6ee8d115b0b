"""The metadata channel: what compute and storage know about each conversation.

Bidaw's "bidirectional awareness" is one shared view: the scheduler reads where a
session's KV lives and how big it is (to order loads), and the eviction policy reads the
previous answer length (to predict the next reuse distance). :class:`MetadataChannel` is
that view. The cache (or the simulator) writes it; policies and the engine read it.

Everything here is pure Python with no clock and no asyncio, so the same channel runs
inside :class:`tieredkv.TieredKVCache` and inside the simulator under a virtual clock.

Per-session metadata is a frozen :class:`KVMeta` Struct, replaced (never mutated) on every
change. Changes are announced as :data:`Event` values (a msgspec tagged union: encode them
with ``msgspec.json.encode`` for tracing) to subscribers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import EllipsisType
from typing import Any, Literal, Protocol

import msgspec

from ._checks import check_name
from .errors import SessionNotFoundError

__all__ = [
    "Demoted",
    "Dropped",
    "Forgotten",
    "Event",
    "Evicted",
    "KVMeta",
    "Loaded",
    "MetadataChannel",
    "MetadataView",
    "Promoted",
    "Refused",
    "RetentionHint",
    "Stored",
    "TierInfo",
    "Transfer",
    "advance_meta",
    "apply_hint",
]

_log = logging.getLogger(__name__)


class Transfer(msgspec.Struct, frozen=True, kw_only=True):
    """A move of a session's KV between tiers that has started and not finished.

    :param kind: ``"promote"`` (toward the performance tier), ``"demote"`` (away from it),
        or ``"write-through"`` (a background copy in inclusive mode)
    :param src: name of the tier read from
    :param dst: name of the tier written to
    :param nbytes: bytes being moved
    :param started: time the transfer started (the caller's clock)
    """

    kind: Literal["promote", "demote", "write-through"]
    src: str
    dst: str
    nbytes: int
    started: float


class KVMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What the channel knows about one session's history KV.

    :param session: the session key
    :param tier: name of the tier that serves loads (holds the complete history), or
        ``None`` when the KV is stored nowhere (lost to eviction: it must be recomputed)
    :param copies: names of every tier holding a complete copy, ``tier`` first
    :param nbytes: stored bytes of the whole history (one copy)
    :param tokens: tokens in the stored history
    :param turns: segments stored (one per :meth:`~tieredkv.TieredKVCache.append`)
    :param prev_answer_tokens: the model's answer length in the latest turn (Bidaw's
        eviction signal)
    :param turn_tokens: tokens the latest turn added to the history (its new input: the
        person's message or a tool's result, and the answer), 0 when unknown; the new
        input is ``turn_tokens - prev_answer_tokens``, which ``"bidaw"`` weighs
    :param last_access: time of the latest append or load (the caller's clock)
    :param created: time of the first append
    :param accesses: appends and loads so far
    :param in_flight: a transfer under way, if any
    :param next_access: an oracle's next access time (the simulator fills it in for
        Belady); ``None`` when unknown
    :param codec: what the stored tensors hold (``"kv"``, or a storage-efficient codec's
        name, as given to :meth:`~tieredkv.TieredKVCache.append`)
    :param tool_call: the latest turn's answer ended in a tool call (the next turn comes
        when the tool returns, not when a person has read the answer)
    :param next_turn: the caller's hint: when it expects the next access (the caller's
        clock); advice a policy may weigh, cleared by the next access
    :param pinned_until: the conversation is pinned in its tier until this time (the
        caller's clock; ``math.inf``: until released); ``None``: not pinned
    :param pin_group: the group the pin counts in (``RetentionHint.group``: the cache
        bounds each group's pinned bytes, e.g. one tenant's); ``None``: no group, or not
        pinned
    :param priority: the caller's priority (0 neutral; higher is kept longer, lower goes
        first); advice a policy may weigh
    :param parent: for a fork, the conversation it was forked from (its history starts
        with that conversation's first ``parent_tokens`` tokens, stored once for both)
    :param parent_tokens: the tokens the fork inherited (0 for a conversation that is not
        a fork)
    :param shared_bytes: bytes of ``nbytes`` that other stored conversations also list
        (a shared system prompt, the history before a fork point): a tier frees them only
        when no conversation it serves needs them any more; :attr:`owned_bytes` are the
        rest
    :param tier_shared: per tier, in the order of the channel's tiers: bytes of ``nbytes``
        that another conversation *resident in that tier* also lists (its copy there stays
        while that conversation does), so ``nbytes - tier_shared[t]`` is what moving this
        conversation out of tier ``t`` frees there (:func:`~tieredkv.policies.base.freed_bytes`);
        a tier past the end (or all of them, when empty: a publisher that does not track
        residency per tier) counts ``shared_bytes``
    :param share_bytes: this conversation's share of the stored bytes: what it owns plus,
        for each range it shares, the range's bytes divided by the number of stored
        conversations listing it (over all conversations these add up to the unique bytes
        stored); ``None``: ``nbytes`` (it shares nothing). A policy that measures how many
        bytes pass through a tier between two accesses weighs each access by it
    """

    session: str
    tier: str | None
    copies: tuple[str, ...] = ()
    nbytes: int = 0
    tokens: int = 0
    turns: int = 0
    prev_answer_tokens: int = 0
    turn_tokens: int = 0
    last_access: float = 0.0
    created: float = 0.0
    accesses: int = 0
    in_flight: Transfer | None = None
    next_access: float | None = None
    codec: str = "kv"
    tool_call: bool = False
    next_turn: float | None = None
    pinned_until: float | None = None
    pin_group: str | None = None
    priority: int = 0
    parent: str | None = None
    parent_tokens: int = 0
    shared_bytes: int = 0
    tier_shared: tuple[int, ...] = ()
    share_bytes: int | None = None

    def pinned(self, now: float) -> bool:
        """Whether the conversation is pinned at ``now``."""
        return self.pinned_until is not None and self.pinned_until > now

    @property
    def owned_bytes(self) -> int:
        """Bytes of the history no other stored conversation lists: what evicting this
        conversation from a tier frees there, while the conversations it shares the rest
        with stay."""
        return self.nbytes - self.shared_bytes


def advance_meta(
    old: KVMeta | None,
    *,
    session: str,
    tier: str | None,
    copies: tuple[str, ...],
    nbytes: int,
    tokens: int,
    turns: int,
    now: float,
    access: bool = False,
    answer: int | None = None,
    codec: str = "kv",
    next_access: float | EllipsisType | None = ...,
    restart: bool = False,
    accesses: int | None = None,
    tool_call: bool | None = None,
    next_turn: float | EllipsisType | None = ...,
    parent: str | None = None,
    parent_tokens: int = 0,
    shared_bytes: int = 0,
    tier_shared: tuple[int, ...] = (),
    share_bytes: int | None = None,
    turn_tokens: int | None = None,
) -> KVMeta:
    """The session's next :class:`KVMeta`, from the previous one and what just changed.

    The one rule by which the cache, the simulator and the replay advance a session's
    metadata: placement and size are taken as given; ``access`` (an append or a load)
    counts one more access at ``now``; ``answer`` (an append) replaces the previous answer
    length, and ``turn_tokens`` (the tokens it added; ``None``: unknown, 0) what the
    turn added; ``next_access`` replaces the oracle's hint (``...`` keeps it); the first
    access time and an in-flight transfer carry over. ``restart`` starts the history's
    clock afresh (a session rebuilt at open). ``accesses`` sets the access count where the
    caller knows it better (a trace replay counts the conversation's rounds).
    ``tool_call`` replaces whether the latest answer ended in a tool call (an append that
    does not say: it did not); an access clears the caller's ``next_turn`` hint unless a new
    one is given; a pin (with its group) and a priority carry over. ``parent``,
    ``parent_tokens`` and ``shared_bytes``, ``tier_shared``, ``share_bytes`` (a fork's
    link, the bytes shared with other conversations, in any tier and per tier, and the
    conversation's share of the stored bytes) are taken as given.
    """
    fresh = old is None or restart
    return KVMeta(
        session=session,
        tier=tier,
        copies=copies,
        nbytes=nbytes,
        tokens=tokens,
        turns=turns,
        prev_answer_tokens=(
            answer if answer is not None else (old.prev_answer_tokens if old else 0)
        ),
        turn_tokens=((turn_tokens or 0) if answer is not None else (old.turn_tokens if old else 0)),
        last_access=now if access or old is None else old.last_access,
        created=now if fresh or old is None else old.created,
        accesses=(
            accesses
            if accesses is not None
            else (old.accesses if old else 0) + (1 if access else 0)
        ),
        in_flight=old.in_flight if old else None,
        next_access=((old.next_access if old else None) if next_access is ... else next_access),
        codec=codec,
        tool_call=(
            tool_call
            if tool_call is not None
            else (False if answer is not None else (old.tool_call if old else False))
        ),
        next_turn=(
            (None if access or old is None else old.next_turn) if next_turn is ... else next_turn
        ),
        pinned_until=old.pinned_until if old else None,
        pin_group=old.pin_group if old else None,
        priority=old.priority if old else 0,
        parent=parent,
        parent_tokens=parent_tokens,
        shared_bytes=shared_bytes,
        tier_shared=tier_shared,
        share_bytes=share_bytes,
    )


class RetentionHint(msgspec.Struct, frozen=True, kw_only=True):
    """What a caller tells the cache about a conversation's future
    (:meth:`tieredkv.TieredKVCache.hint`, or ``append(..., hint=...)``). Each field left
    ``None`` leaves what the cache knew unchanged.

    :param next_turn_in: seconds from now until the caller expects the conversation's next
        turn (e.g. a tool's expected run time). Advice: the eviction policy learns how far
        such hints are to be trusted. Cleared by the next access.
    :param pin: ``True`` pins the conversation in the tier that holds it: no eviction
        policy picks it as a victim until the pin ends; ``False`` releases a pin
    :param ttl: with ``pin=True``, seconds until the pin ends by itself (``None``: it lasts
        until released)
    :param group: with ``pin=True``, the group the pin counts in (any non-empty text, e.g.
        a tenant's name): besides the bound on all pinned bytes, the cache bounds each
        group's (``TieredKVCache(max_pinned_bytes_per_group=...)``). The latest pin sets
        the group: a pin without one counts in no group
    :param priority: advice, 0 neutral: higher keeps the conversation longer, lower lets it
        go first (``"bidaw"`` weighs it by a factor ``2 ** priority``, clamped to +-4)
    :param tool_call: the latest answer ended in a tool call (the next turn comes when the
        tool returns, not when a person has read the answer)
    """

    next_turn_in: float | None = None
    pin: bool | None = None
    ttl: float | None = None
    priority: int | None = None
    tool_call: bool | None = None
    group: str | None = None

    def __post_init__(self) -> None:
        if self.next_turn_in is not None and not self.next_turn_in >= 0:
            raise ValueError(f"next_turn_in must be >= 0 seconds (got {self.next_turn_in})")
        if self.ttl is not None:
            if self.pin is not True:
                raise ValueError("ttl is the lifetime of a pin: give it with pin=True")
            if not self.ttl > 0:
                raise ValueError(f"ttl must be > 0 seconds (got {self.ttl})")
        if self.group is not None:
            if self.pin is not True:
                raise ValueError("group is the group of a pin: give it with pin=True")
            check_name("a pin's group", self.group)
        if self.priority is not None and (
            isinstance(self.priority, bool) or not isinstance(self.priority, int)
        ):
            raise ValueError(f"priority must be an int (got {self.priority!r})")


def apply_hint(meta: KVMeta, hint: RetentionHint, now: float) -> KVMeta:
    """``meta`` with ``hint`` applied at ``now`` (the caller's clock): a pin sets its end
    and its group (none if the hint names none), a release clears both."""
    changes: dict[str, Any] = {}
    if hint.next_turn_in is not None:
        changes["next_turn"] = now + hint.next_turn_in
    if hint.pin is not None:
        if hint.pin:
            changes["pinned_until"] = math.inf if hint.ttl is None else now + hint.ttl
        else:
            changes["pinned_until"] = None
        changes["pin_group"] = hint.group
    if hint.priority is not None:
        changes["priority"] = hint.priority
    if hint.tool_call is not None:
        changes["tool_call"] = hint.tool_call
    return msgspec.structs.replace(meta, **changes) if changes else meta


class TierInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A tier as policies see it: its name, position and byte capacity."""

    name: str
    level: int
    capacity: int


class _EventBase(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    session: str
    time: float
    nbytes: int


class Stored(_EventBase, frozen=True, kw_only=True):
    """A segment was appended to ``tier``; ``seconds`` the append took (the cache's clock,
    from holding the session to the segment committed; 0 where not measured)."""

    tier: str
    tokens: int
    seconds: float = 0.0


class Loaded(_EventBase, frozen=True, kw_only=True):
    """A session's history was served from ``tier``; ``hit`` if that is the top tier.

    On a miss the history is promoted first when it fits (a :class:`Promoted` event comes
    before this one, naming the tier it came from), and ``tier`` is then the top tier.
    ``seconds`` is what the load took, promotion included (the cache's clock, from holding
    the session to the copy done; 0 where not measured).
    """

    tier: str
    hit: bool
    seconds: float = 0.0


class Promoted(_EventBase, frozen=True, kw_only=True):
    """A session's history moved up from ``src`` to ``dst``, in ``seconds`` (the cache's
    clock, making room included; 0 where not measured)."""

    src: str
    dst: str
    seconds: float = 0.0


class Demoted(_EventBase, frozen=True, kw_only=True):
    """A session's history moved down from ``src`` to ``dst`` (or its copy there became primary)."""

    src: str
    dst: str


class Evicted(_EventBase, frozen=True, kw_only=True):
    """A copy of a session's history was removed from ``tier`` to make room.

    ``lost`` is true when no other tier holds it: the KV must be recomputed.
    """

    tier: str
    lost: bool


class Dropped(_EventBase, frozen=True, kw_only=True):
    """The application dropped the session; every copy is gone."""


class Forgotten(_EventBase, frozen=True, kw_only=True):
    """The record of a session lost earlier (its metadata with ``tier`` ``None``) was let
    go, past the cache's ``max_lost_records``: the channel no longer knows the session.
    ``nbytes`` is 0."""


class Refused(_EventBase, frozen=True, kw_only=True):
    """Turns of a session that this replica had acknowledged were refused by the shared
    tier ``tier`` (another replica took the conversation over, or its history there changed,
    before they were committed). ``turns`` are their indices; ``nbytes`` their size. They are
    gone from the history; :class:`~tieredkv.errors.TurnRefusedError` reports them to the
    caller."""

    tier: str
    turns: tuple[int, ...]
    reason: str


Event = Stored | Loaded | Promoted | Demoted | Evicted | Dropped | Refused | Forgotten
"""Tagged union of every event the channel emits."""


class MetadataView(Protocol):
    """Read-only access to the channel, as handed to policies."""

    def get(self, session: str) -> KVMeta | None:
        """The session's metadata, or ``None``."""
        ...

    @property
    def waiting(self) -> tuple[str, ...]:
        """Sessions of the requests waiting in the scheduler, in run order."""
        ...

    @property
    def tiers(self) -> tuple[TierInfo, ...]:
        """The tiers, top (performance) first."""
        ...

    @property
    def pins(self) -> Mapping[str, float]:
        """Pinned sessions -> the time their pin ends (``math.inf``: until released); a
        pin may have ended already (compare with ``now``)."""
        ...


class MetadataChannel:
    """Per-session :class:`KVMeta` plus the scheduler's waiting queue, with event fan-out.

    Writers (the cache, the simulator, the engine) use :meth:`put`, :meth:`update`,
    :meth:`remove`, :meth:`publish_waiting` and :meth:`emit`; readers (policies) use
    :meth:`get`, iteration, :attr:`waiting` and :attr:`tiers`.
    """

    __slots__ = ("_meta", "_pins", "_subscribers", "_tiers", "_waiting")

    def __init__(self, tiers: Iterable[TierInfo] = ()) -> None:
        self._meta: dict[str, KVMeta] = {}
        self._pins: dict[str, float] = {}
        self._subscribers: list[Callable[[Event], None]] = []
        self._waiting: tuple[str, ...] = ()
        self._tiers: tuple[TierInfo, ...] = tuple(tiers)

    # -- reading -----------------------------------------------------------------------
    def get(self, session: str) -> KVMeta | None:
        """The session's metadata, or ``None`` if unknown (never seen, or dropped)."""
        return self._meta.get(session)

    def __getitem__(self, session: str) -> KVMeta:
        try:
            return self._meta[session]
        except KeyError:
            raise SessionNotFoundError(session) from None

    def __contains__(self, session: object) -> bool:
        return session in self._meta

    def __len__(self) -> int:
        return len(self._meta)

    def __iter__(self) -> Iterator[str]:
        return iter(self._meta)

    def values(self) -> Iterator[KVMeta]:
        """Every session's metadata."""
        return iter(self._meta.values())

    @property
    def waiting(self) -> tuple[str, ...]:
        """Sessions of the requests waiting in the scheduler, in the order they will run."""
        return self._waiting

    @property
    def tiers(self) -> tuple[TierInfo, ...]:
        """The tiers, top (performance) first."""
        return self._tiers

    @property
    def pins(self) -> Mapping[str, float]:
        """Pinned sessions -> the time their pin ends (``math.inf``: until released), as
        the metadata says; a pin may have ended already (compare with ``now``)."""
        return self._pins

    def _index_pin(self, meta: KVMeta) -> None:
        if meta.pinned_until is None:
            self._pins.pop(meta.session, None)
        else:
            self._pins[meta.session] = meta.pinned_until

    # -- writing -----------------------------------------------------------------------
    def set_tiers(self, tiers: Iterable[TierInfo]) -> None:
        """Describe the tiers (done once by the cache or the simulator)."""
        self._tiers = tuple(tiers)

    def put(self, meta: KVMeta) -> None:
        """Insert or replace a session's metadata."""
        self._meta[meta.session] = meta
        if meta.pinned_until is not None or meta.session in self._pins:
            self._index_pin(meta)

    def update(self, session: str, **changes: Any) -> KVMeta:
        """Replace fields of a session's metadata and return the new Struct.

        :raises SessionNotFoundError: if the channel does not know the session
        """
        new = msgspec.structs.replace(self[session], **changes)
        self.put(new)
        return new

    def remove(self, session: str) -> KVMeta | None:
        """Forget a session; returns what was known, or ``None``."""
        self._pins.pop(session, None)
        return self._meta.pop(session, None)

    def hint_next_access(self, session: str, when: float | None) -> None:
        """Record an oracle's next access time for a session (used by Belady)."""
        if session in self._meta:
            self.update(session, next_access=when)

    def publish_waiting(self, sessions: Iterable[str]) -> None:
        """Publish the scheduler's waiting queue (sessions in the order they will run)."""
        self._waiting = tuple(sessions)

    # -- events ------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``callback`` with every event from now on; returns a function that unsubscribes.

        Callbacks run synchronously where the change happens and must not block. An
        exception in a callback is logged and does not affect the cache.
        """
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def emit(self, event: Event) -> None:
        """Deliver ``event`` to every subscriber."""
        for callback in tuple(self._subscribers):
            try:
                callback(event)
            except Exception:  # a metrics hook must never break storage
                _log.exception("tieredkv event subscriber %r failed on %r", callback, event)
