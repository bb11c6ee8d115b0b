"""Eviction-only replay: a turn stream through one eviction policy and a host byte budget.

Each turn of a conversation is one access of its history KV. If the conversation's KV is
resident in host memory the access is a *hit*, else a *miss* (first turns have no
history and count as neither). After the turn its history (capped at ``history_cap``
tokens, ``bytes_per_token`` each) is admitted to host memory, evicting the policy's
victims to fit; the conversation itself is protected while it is admitted. A policy that
cannot free enough leaves the conversation out of host memory.

The replay plays the roles the live system plays for the policy:

- the *oracle*: every access carries ``KVMeta.next_access``, the time of the same user's
  next turn (``None`` after the last one), which is what :class:`~tieredkv.policies.Belady`
  reads;
- the *scheduler's queue*: ``view.waiting`` holds the sessions of the next ``window``
  turns of the stream, approximating the requests already queued (as the Bidaw authors'
  artifact does), which is what :class:`~tieredkv.policies.QueueEnhanced` reads;
- the *tiers*: ``view.tiers[0]`` is the host tier with ``host_bytes`` of capacity.

Time is virtual (the trace's timestamps); nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from ..meta import KVMeta, TierInfo, advance_meta
from ..policies.base import Eviction
from ..residency import Residency
from .trace import Turns

__all__ = ["OPT_13B_BYTES_PER_TOKEN", "ReplayResult", "replay"]

OPT_13B_BYTES_PER_TOKEN = 819_200
"""KV bytes per token of OPT-13B in fp16: 40 layers x 5120 x 2 (K, V) x 2 bytes."""

_HOST = "host"


class ReplayResult(msgspec.Struct, frozen=True, kw_only=True):
    """Counts from one replay.

    :param policy: the policy's registry name
    :param host_bytes: the host budget
    :param turns: turns replayed
    :param hits: counted accesses whose KV was resident
    :param misses: counted accesses whose KV was not
    :param hit_bytes: history bytes of the hits (what host memory served)
    :param miss_bytes: history bytes of the misses (what must come from SSD or be recomputed)
    :param evictions: sessions evicted
    :param rejected: admissions the policy could not make room for
    """

    policy: str
    host_bytes: int
    turns: int
    hits: int
    misses: int
    hit_bytes: int
    miss_bytes: int
    evictions: int
    rejected: int

    @property
    def accesses(self) -> int:
        """Counted accesses (turns after a conversation's first, past the warm-up)."""
        return self.hits + self.misses

    @property
    def hit_ratio(self) -> float:
        """Hits over counted accesses (0 when there are none)."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def miss_ratio(self) -> float:
        """Misses over counted accesses (0 when there are none)."""
        return self.misses / self.accesses if self.accesses else 0.0

    @property
    def byte_hit_ratio(self) -> float:
        """Hit bytes over the history bytes of all counted accesses (0 when none)."""
        total = self.hit_bytes + self.miss_bytes
        return self.hit_bytes / total if total else 0.0


class _View:
    """The replay's metadata view: metas, the upcoming sessions, the tiers."""

    __slots__ = ("_i", "_metas", "_pins", "_sessions", "_window", "tiers")

    def __init__(self, sessions: list[str], window: int, tiers: tuple[TierInfo, ...]) -> None:
        self._sessions = sessions
        self._window = window
        self._metas: dict[str, KVMeta] = {}
        self._i = 0
        self._pins: dict[str, float] = {}  # the replay pins nothing
        self.tiers = tiers

    @property
    def pins(self) -> Mapping[str, float]:
        return self._pins

    def get(self, session: str) -> KVMeta | None:
        return self._metas.get(session)

    def put(self, meta: KVMeta) -> None:
        self._metas[meta.session] = meta

    @property
    def waiting(self) -> tuple[str, ...]:
        # Computed on demand: only QueueEnhanced asks, and only when evicting.
        i = self._i + 1
        return tuple(self._sessions[i : i + self._window])


def replay(
    turns: Turns,
    policy: Eviction,
    *,
    host_bytes: int,
    bytes_per_token: int = OPT_13B_BYTES_PER_TOKEN,
    history_cap: int = 2048,
    window: int = 30,
    warmup: int = 0,
    tool_calls: Sequence[bool] | npt.NDArray[np.bool_] | None = None,
    hints: Sequence[float] | npt.NDArray[np.float64] | None = None,
) -> ReplayResult:
    """Replay ``turns`` through ``policy`` with ``host_bytes`` of host memory.

    :param turns: the turn stream (sorted by time)
    :param policy: a fresh eviction policy (it is driven, not reset)
    :param host_bytes: host-memory budget for history KV
    :param bytes_per_token: KV bytes per token of history
    :param history_cap: tokens of history kept per conversation at most
    :param window: upcoming turns published as ``view.waiting``
    :param warmup: leading turns replayed but not counted
    :param tool_calls: per turn, whether its answer ended in a tool call
        (``KVMeta.tool_call``); ``None``: none did
    :param hints: per turn, when its caller expects the conversation's next turn
        (``KVMeta.next_turn``, absolute time; NaN: no hint); ``None``: no caller hints
    :raises ValueError: on a non-positive budget, size or cap, or a negative window/warmup
    """
    if host_bytes <= 0 or bytes_per_token <= 0 or history_cap <= 0:
        raise ValueError("host_bytes, bytes_per_token and history_cap must be positive")
    if window < 0 or warmup < 0:
        raise ValueError("window and warmup must be >= 0")
    tokens = [min(c, history_cap) for c in turns.context_after().tolist()]
    count = len(tokens)
    tools = [False] * count if tool_calls is None else [bool(x) for x in tool_calls]
    told: list[float | None] = [None] * count
    if hints is not None:
        told = [None if math.isnan(h) else float(h) for h in hints]
    if len(tools) != count or len(told) != count:
        raise ValueError(f"tool_calls and hints need one value per turn ({count})")
    return _run(turns, policy, _Histories(tokens, bytes_per_token, tools, told), host_bytes,
               window=window, warmup=warmup)  # fmt: skip


_History = tuple[int, int, bool, float | None, int, int | None]
"""What :meth:`_Histories.history` returns."""


class _Histories:
    """How host memory holds the conversations' histories, for :func:`_run`: here each
    conversation holds its whole history (``tokens[i]`` after turn ``i``), as its own
    bytes. :class:`tieredkv.sim.forest` holds ranges shared by several conversations
    once. The replay calls, per turn: :meth:`history`; :meth:`hold`; :meth:`leaves` for
    every victim, then :meth:`evicted` after each batch; then :meth:`stays` (admitted) or
    :meth:`refused`."""

    __slots__ = ("_bpt", "_tokens", "_told", "_tools", "residency", "resident", "used", "view")

    def __init__(
        self,
        tokens: list[int],
        bytes_per_token: int,
        tools: list[bool] | None = None,
        told: list[float | None] | None = None,
    ) -> None:
        self._tokens = tokens
        self._bpt = bytes_per_token
        self._tools = tools
        self._told = told
        self.used = 0
        """Bytes host memory holds now."""
        self.resident: dict[str, int] = {}
        """Resident conversation -> its history's bytes (the replay keeps it)."""

    def attach(self, view: _View, residency: Residency) -> None:
        """The replay's view and notifier (for a model that tells the policy of changes to
        other conversations than the one accessed)."""
        self.view = view
        self.residency = residency

    def history(self, i: int, session: str) -> _History:
        """Turn ``i``'s conversation's history after the turn: its bytes and tokens, whether
        the turn ended in a tool call, the caller's hint, its bytes another conversation
        lists and its share of the stored bytes (``None``: all of them)."""
        tokens = self._tokens[i]
        tools, told = self._tools, self._told
        return (
            tokens * self._bpt,
            tokens,
            tools[i] if tools is not None else False,
            told[i] if told is not None else None,
            0,
            None,
        )

    def hold(self, i: int, session: str, was: int | None, meta: KVMeta, now: float) -> KVMeta:
        """Hold the history of turn ``i`` in place of the one the conversation had resident
        (``was`` bytes; ``None``: none); the metadata to publish."""
        self.used += meta.nbytes - (was or 0)
        return meta

    def stays(self, session: str, meta: KVMeta, now: float) -> KVMeta:
        """The conversation was admitted with ``meta``; the metadata to admit it with."""
        return meta

    def leaves(self, session: str, nbytes: int) -> None:
        """The resident conversation's history (``nbytes``) was evicted."""
        self.used -= nbytes

    def evicted(self, now: float, but: str) -> None:
        """A batch of victims left (a model tells the policy of what that changed)."""

    def refused(self, session: str, nbytes: int, now: float) -> None:
        """The conversation's new history (``nbytes``) could not be admitted."""
        self.used -= nbytes


def _run(
    turns: Turns,
    policy: Eviction,
    store: _Histories,
    host_bytes: int,
    *,
    window: int = 30,
    warmup: int = 0,
) -> ReplayResult:
    """The replay's one loop: ``turns`` through ``policy``, host memory holding histories
    as ``store`` models it (:func:`replay`; :func:`tieredkv.sim.forest.replay_forest`).

    A victim may free less than its history (a model that shares bytes): room is asked of
    the policy again until the conversation fits or the policy has nothing more."""
    users = turns.user.tolist()
    names = {u: f"u{u}" for u in set(users)}
    sessions = [names[u] for u in users]
    times = turns.time.tolist()
    answers = turns.answer.tolist()
    queries = turns.query.tolist()
    rounds = turns.round_index.tolist()
    nxt = turns.next_index().tolist()
    tiers = (
        TierInfo(name=_HOST, level=0, capacity=host_bytes),
        TierInfo(name="ssd", level=1, capacity=2**62),
    )
    view = _View(sessions, window, tiers)
    metas = view._metas
    # every notification in the one order (publish, then the policy)
    residency = Residency(view, [policy])
    accessed = residency.accessed
    admitted = residency.admitted
    removed = residency.removed
    store.attach(view, residency)
    resident = store.resident
    history: dict[str, int] = {}  # session -> bytes of its history after its latest turn
    hits = misses = hit_bytes = miss_bytes = evictions = rejected = 0
    victims = policy.victims
    for i, session in enumerate(sessions):
        now = times[i]
        was = resident.get(session)
        if rounds[i] and i >= warmup:
            # The history this turn needs is what the previous turn left behind.
            if was is None:
                misses += 1
                miss_bytes += history[session]
            else:
                hits += 1
                hit_bytes += was
        n = nxt[i]
        view._i = i
        nbytes, tokens, tool_call, next_turn, shared, share = store.history(i, session)
        history[session] = nbytes
        meta = advance_meta(
            metas.get(session),
            session=session,
            tier=_HOST,
            copies=(_HOST,),
            nbytes=nbytes,
            tokens=tokens,
            turns=rounds[i] + 1,
            now=now,
            access=True,
            answer=answers[i],
            turn_tokens=queries[i] + answers[i],
            next_access=times[n] if n >= 0 else None,
            accesses=rounds[i] + 1,
            tool_call=tool_call,
            next_turn=next_turn,
            shared_bytes=shared,
            share_bytes=share,
        )
        meta = store.hold(i, session, was, meta, now)
        if store.used <= host_bytes:  # it fits: the access, then the admission
            accessed(meta, now, 0)
            resident[session] = nbytes
            store.stays(session, meta, now)
            continue
        accessed(meta, now)  # the access first; then room is made; then the admission
        fits = False
        if nbytes <= host_bytes:
            protected = frozenset((session,))
            while True:
                chosen = victims(store.used - host_bytes, now, view, protected)
                if not chosen:
                    break
                for victim in chosen:
                    store.leaves(victim, resident.pop(victim))
                    removed(victim, 0)
                evictions += len(chosen)
                store.evicted(now, session)
                if store.used <= host_bytes:
                    fits = True
                    break
        if fits:
            resident[session] = nbytes
            admitted(store.stays(session, meta, now), now, 0)
        else:
            rejected += 1
            store.refused(session, nbytes, now)
            if was is not None:  # it cannot grow in place: it leaves host memory
                del resident[session]
                removed(session, 0)
    return ReplayResult(
        policy=policy.name,
        host_bytes=host_bytes,
        turns=len(sessions),
        hits=hits,
        misses=misses,
        hit_bytes=hit_bytes,
        miss_bytes=miss_bytes,
        evictions=evictions,
        rejected=rejected,
    )
