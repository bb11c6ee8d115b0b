"""Workloads whose conversations share history, and the eviction-only replay over them.

A :class:`Forest` is a turn stream (:class:`~tieredkv.sim.trace.Turns`) plus, per turn, the
*ranges* its conversation's history is made of after the turn: ``(key, tokens)`` pairs in
order, whose tokens add up to the turn's context. Two conversations listing the same key
share that range, as a fork lists its parent's segments in the live cache
(``docs/explanation/forest.md``). Ranges shared here:

- **a shared system prompt** (:class:`SharedPromptWorkload`): every conversation of an
  application starts with the same prompt; and **edit forks**: a fraction of turns fork
  the conversation at that turn (the user edits that message, or regenerates from it): the
  fork lists the parent's history before the turn, then its own turns;
- **the Mooncake conversation trace's prefix blocks** (:func:`read_mooncake_forest`): a
  request's complete 512-token blocks are ranges keyed by their ``hash_ids`` (equal ids
  are the same prefix), so every conversation shares block 0 and any longer common prefix.

:func:`replay_forest` replays a forest through an eviction policy and a host byte budget
the way :func:`~tieredkv.sim.replay.replay` replays turns, with storage counted per unique
range when ``sharing`` is on: a range is held once while any resident conversation lists
it, and leaves host memory with the last of them. The policy sees what the live cache
shows it: ``KVMeta.shared_bytes`` (the bytes of a conversation's history that another
conversation's history also lists) and so, through
:func:`~tieredkv.policies.base.freed_bytes`, what evicting it frees. With ``sharing`` off
every conversation holds its own copy of everything it lists: the replay is then exactly
:func:`~tieredkv.sim.replay.replay` (same hits, misses, evictions).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

import msgspec
import numpy as np

from ..meta import KVMeta
from ..policies.base import Eviction
from .replay import OPT_13B_BYTES_PER_TOKEN, ReplayResult, _Histories, _History, _run
from .synthetic import SyntheticWorkload
from .trace import Turns
from .workloads import _BLOCK, mooncake_conversations, read_mooncake_records

__all__ = [
    "Forest",
    "ForestReplayResult",
    "Ranges",
    "SharedPromptWorkload",
    "read_mooncake_forest",
    "replay_forest",
]

Ranges = tuple[tuple[Hashable, int], ...]
"""A conversation's history as ``(key, tokens)`` ranges, in order."""

_HOST = "host"


class Forest:
    """Turns and, per turn (in the turns' order), the ranges of its conversation's history
    after the turn.

    :raises ValueError: unless there is one range list per turn whose tokens add up to the
        turn's context (:meth:`~tieredkv.sim.trace.Turns.context_after`), and every key has
        one size wherever it is listed
    """

    __slots__ = ("ranges", "turns")

    def __init__(self, turns: Turns, ranges: Sequence[Ranges]) -> None:
        if len(ranges) != len(turns):
            raise ValueError(
                f"a forest needs one range list per turn ({len(turns)}), got {len(ranges)}"
            )
        context = turns.context_after().tolist()
        sizes: dict[Hashable, int] = {}
        for i, (rs, c) in enumerate(zip(ranges, context, strict=True)):
            if sum(t for _, t in rs) != c:
                raise ValueError(
                    f"turn {i}: its ranges hold {sum(t for _, t in rs)} tokens, its context {c}"
                )
            for key, t in rs:
                if sizes.setdefault(key, t) != t:
                    raise ValueError(f"range {key!r} is listed with {sizes[key]} and {t} tokens")
        self.turns = turns
        self.ranges: list[Ranges] = list(ranges)

    def unique_tokens(self) -> int:
        """Tokens of the distinct ranges of every conversation's final history: what
        storing every history once per range holds."""
        sizes: dict[Hashable, int] = {}
        for rs in self._finals().values():
            sizes.update(rs)
        return sum(sizes.values())

    def _finals(self) -> dict[int, Ranges]:
        # in time order, a conversation's last turn comes last: it wins
        return dict(zip(self.turns.user.tolist(), self.ranges, strict=True))

    def total_tokens(self) -> int:
        """Tokens of every conversation's final history added up: what storing each
        conversation's own copy holds."""
        return sum(sum(t for _, t in rs) for rs in self._finals().values())


def _sorted(
    user: list[int],
    time: list[float],
    query: list[int],
    answer: list[int],
    rounds: list[int],
    ranges: list[Ranges],
) -> Forest:
    turns = Turns(user, time, query, answer, rounds)
    order = np.argsort(np.asarray(time, dtype=np.float64), kind="stable").tolist()  # as Turns
    return Forest(turns, [ranges[i] for i in order])


class SharedPromptWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """Conversations of the synthetic workload (:class:`SyntheticWorkload`, ``base``) that
    all start with one system prompt of ``prompt_tokens``, with edit forks.

    Each turn after a conversation's first forks it with probability ``fork_fraction``:
    ``fork_delay`` seconds after that turn's answer the user edits the turn's message (or
    regenerates from it), which starts a new conversation listing the parent's history
    before the turn, then its own turns: the edited query and its answer, and a geometric
    number of later turns (mean ``fork_turns``) with the base workload's think times.
    Forks are made from the base conversations (a fork of a fork is the same case for the
    storage). A turn's query counts the prompt in a conversation's first turn and, in a
    fork's first turn, the inherited history (what a server without sharing would
    prefill).

    :param base: the conversations (users, arrivals, turn shapes, think times, seed)
    :param prompt_tokens: the shared system prompt
    :param fork_fraction: probability that a turn after the first forks
    :param fork_turns: mean turns of a fork, at least 1
    :param fork_delay: seconds from the forked turn's arrival to the fork's first turn
    """

    base: SyntheticWorkload = SyntheticWorkload(users=200, arrival_rate=0.2)
    prompt_tokens: int = 2048
    fork_fraction: float = 0.05
    fork_turns: float = 2.0
    fork_delay: float = 20.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0 (got {self.prompt_tokens})")
        if not 0 <= self.fork_fraction <= 1:
            raise ValueError(f"fork_fraction must be in [0, 1] (got {self.fork_fraction})")
        if not self.fork_turns >= 1 or self.fork_delay < 0:
            raise ValueError("fork_turns must be >= 1 and fork_delay >= 0")

    def generate(self) -> Forest:
        """The conversations and their forks, sorted by time."""
        base = self.base.generate()
        rng = np.random.default_rng([self.base.seed, 1])
        prompt: Ranges = (("prompt", self.prompt_tokens),) if self.prompt_tokens else ()
        user: list[int] = []
        time: list[float] = []
        query: list[int] = []
        answer: list[int] = []
        rounds: list[int] = []
        ranges: list[Ranges] = []
        by_user = np.lexsort((base.round_index, base.user)).tolist()
        b_user = base.user.tolist()
        b_time = base.time.tolist()
        b_query = base.query.tolist()
        b_answer = base.answer.tolist()
        b_round = base.round_index.tolist()
        forks = 0
        next_id = base.users()
        history: Ranges = ()
        think = self.base
        for i in by_user:
            u, r, q, a, t = b_user[i], b_round[i], b_query[i], b_answer[i], b_time[i]
            if r == 0:
                history = prompt
            elif rng.random() < self.fork_fraction:
                # an edit of this turn's message: a fork listing the history before it
                f = next_id + forks
                forks += 1
                inherited = sum(n for _, n in history)
                fh = history
                ft = t + self.fork_delay
                fq, fa = q, a
                n_turns = int(rng.geometric(1.0 / self.fork_turns))
                for fr in range(n_turns):
                    if fr:
                        ft += think.read_seconds_per_token * fa + float(
                            rng.lognormal(math.log(think.type_median), think.type_sigma)
                        )
                        fq = int(
                            np.clip(
                                np.rint(
                                    rng.lognormal(math.log(think.query_median), think.query_sigma)
                                ),
                                1,
                                think.query_max,
                            )
                        )
                        fa = int(
                            np.clip(
                                np.rint(
                                    rng.lognormal(math.log(think.answer_median), think.answer_sigma)
                                ),
                                1,
                                think.answer_max,
                            )
                        )
                    fh = (*fh, (("turn", f, fr), fq + fa))
                    user.append(f)
                    time.append(ft)
                    query.append(fq + (inherited if fr == 0 else 0))
                    answer.append(fa)
                    rounds.append(fr)
                    ranges.append(fh)
            history = (*history, (("turn", u, r), q + a))
            user.append(u)
            time.append(t)
            query.append(q + (self.prompt_tokens if r == 0 else 0))
            answer.append(a)
            rounds.append(r)
            ranges.append(history)
        return _sorted(user, time, query, answer, rounds, ranges)


def read_mooncake_forest(path: str, *, time_scale: float = 1.0, limit: int | None = None) -> Forest:
    """The Mooncake conversation trace as a forest: the turns of
    :func:`~tieredkv.sim.workloads.read_mooncake`, each history listing the request's
    complete 512-token prefix blocks by ``hash_ids`` (shared with every conversation whose
    requests carry the same ids) and the rest (the partial block, the answer, and tokens
    not covered by the request's input) as the conversation's own range."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive (got {time_scale})")
    records = read_mooncake_records(path, limit=limit)
    convs = mooncake_conversations(records)
    user: list[int] = []
    time: list[float] = []
    query: list[int] = []
    answer: list[int] = []
    rounds: list[int] = []
    ranges: list[Ranges] = []
    state: dict[int, tuple[int, int]] = {}  # conversation -> (turns, context after)
    for rec, conv in zip(records, convs, strict=True):
        n, context = state.get(conv, (0, 0))
        inp = int(rec["input_length"])  # type: ignore[call-overload]
        out = max(1, int(rec["output_length"]))  # type: ignore[call-overload]
        q = max(1, inp - context)
        hashes = rec.get("hash_ids")
        ids = [int(h) for h in hashes] if isinstance(hashes, list) else []
        full = min(len(ids), inp // _BLOCK)
        after = context + q + out
        blocks: Ranges = tuple((("block", h), _BLOCK) for h in ids[:full])
        ranges.append((*blocks, (("own", conv, n), after - full * _BLOCK)))
        user.append(conv)
        time.append(int(rec["timestamp"]) / 1000.0 / time_scale)  # type: ignore[call-overload]
        query.append(q)
        answer.append(out)
        rounds.append(n)
        state[conv] = (n + 1, after)
    return _sorted(user, time, query, answer, rounds, ranges)


class ForestReplayResult(msgspec.Struct, frozen=True, kw_only=True):
    """One :func:`replay_forest`: the replay's counts and the bytes host memory held.

    :param replay: hits, misses, evictions (as :func:`~tieredkv.sim.replay.replay` counts)
    :param sharing: whether a shared range was stored once
    :param peak_stored_bytes: the most bytes host memory held
    :param peak_logical_bytes: the most history bytes of the resident conversations added
        up (what they would hold with no range stored once)
    :param unique_bytes: bytes of the distinct ranges of the conversations' final
        histories (:meth:`Forest.unique_tokens`)
    :param total_bytes: every conversation's final history added up
    :param prefix_bytes: bytes of counted first turns' histories that another conversation
        lists (a shared prompt, a fork's inherited history; 0 without sharing)
    :param prefix_hit_bytes: the part of ``prefix_bytes`` host memory held at the turn (a
        first turn counts as neither hit nor miss: this is what sharing serves it)
    """

    replay: ReplayResult
    sharing: bool
    peak_stored_bytes: int
    peak_logical_bytes: int
    unique_bytes: int
    total_bytes: int
    prefix_bytes: int = 0
    prefix_hit_bytes: int = 0


def replay_forest(
    forest: Forest,
    policy: Eviction,
    *,
    host_bytes: int,
    sharing: bool = True,
    bytes_per_token: int = OPT_13B_BYTES_PER_TOKEN,
    window: int = 30,
    warmup: int = 0,
) -> ForestReplayResult:
    """Replay ``forest`` through ``policy`` with ``host_bytes`` of host memory, storing a
    range listed by several resident conversations once (``sharing``) or once per
    conversation (as :func:`~tieredkv.sim.replay.replay` does, with no history cap).

    Hits and misses count as in :func:`~tieredkv.sim.replay.replay`: a turn after a
    conversation's first is a hit if its conversation's whole history is resident (a
    fork's first turn is a first turn, counted in neither mode). Admitting a conversation
    takes the bytes of its ranges not already held; evicting one frees the ranges no other
    resident conversation lists, so a victim may free less than its history: room is
    asked of the policy again until the conversation fits or the policy has nothing more.
    It is the plain replay's loop with another model of what host memory holds (ranges,
    not whole histories).

    :raises ValueError: on a non-positive budget or size, or a negative window/warmup
    """
    if host_bytes <= 0 or bytes_per_token <= 0:
        raise ValueError("host_bytes and bytes_per_token must be positive")
    if window < 0 or warmup < 0:
        raise ValueError("window and warmup must be >= 0")
    store = _SharedRanges(forest, sharing, bytes_per_token, warmup)
    result = _run(forest.turns, policy, store, host_bytes, window=window, warmup=warmup)
    bpt = bytes_per_token
    return ForestReplayResult(
        replay=result,
        sharing=sharing,
        peak_stored_bytes=store.peak,
        peak_logical_bytes=store.peak_logical,
        unique_bytes=forest.unique_tokens() * bpt,
        total_bytes=forest.total_tokens() * bpt,
        prefix_bytes=store.prefix_bytes,
        prefix_hit_bytes=store.prefix_hit_bytes,
    )


class _SharedRanges(_Histories):
    """Host memory holding each range once while any resident conversation lists it
    (``sharing``), or once per conversation listing it: the residency model of
    :func:`replay_forest`. It publishes each conversation's ``shared_bytes`` (ranges another
    conversation lists), ``tier_shared`` (ranges another *resident* conversation lists) and
    ``share_bytes``, and tells the policy again of a resident whose ``tier_shared``
    changed (a sharer joined or left host memory)."""

    def __init__(self, forest: Forest, sharing: bool, bytes_per_token: int, warmup: int) -> None:
        turns = forest.turns
        sessions = [f"u{u}" for u in turns.user.tolist()]
        super().__init__([], bytes_per_token)
        if sharing:
            self._lists: list[Ranges] = forest.ranges
        else:  # every conversation lists a copy of its own
            self._lists = [
                tuple(((s, k), t) for k, t in rs)
                for s, rs in zip(sessions, forest.ranges, strict=True)
            ]
        self._first = [not r for r in turns.round_index.tolist()]
        self._warmup = warmup
        self._size: dict[Hashable, int] = {}  # range -> bytes
        self._listers: dict[Hashable, set[str]] = {}  # range -> conversations listing it
        self._listed: dict[str, Ranges] = {}  # conversation -> its history's ranges
        self._shared: dict[str, int] = {}  # conversation -> bytes of ranges another lists
        self._holders: dict[Hashable, set[str]] = {}  # held range -> residents listing it
        self._here: dict[str, int] = {}  # resident -> bytes of ranges another resident lists
        self._moved: set[str] = set()  # residents whose bytes shared in host memory changed
        self._changed: set[str] = set()  # conversations whose shared_bytes changed
        self._old: Ranges = ()
        self.logical = self.peak = self.peak_logical = 0
        self.prefix_bytes = self.prefix_hit_bytes = 0

    def history(self, i: int, session: str) -> _History:
        size, listers, shared = self._size, self._listers, self._shared
        new = self._lists[i]
        old = self._old = self._listed.get(session, ())
        changed = self._changed
        new_keys = {k for k, _ in new}
        old_keys = {k for k, _ in old}
        for key, t in new:
            if key in old_keys:
                continue
            size[key] = t * self._bpt
            who = listers.setdefault(key, set())
            if len(who) == 1:
                (other,) = who
                shared[other] += size[key]
                changed.add(other)
            who.add(session)
        for key in old_keys - new_keys:
            who = listers[key]
            who.discard(session)
            if len(who) == 1:
                (other,) = who
                shared[other] -= size[key]
                changed.add(other)
        self._listed[session] = new
        mine = shared[session] = sum(size[k] for k, _ in new if len(listers[k]) > 1)
        share = sum(size[k] // len(listers[k]) for k, _ in new)
        tokens = sum(t for _, t in new)
        if self._first[i] and i >= self._warmup:  # a first turn: what it shares is a prefix
            for key, _ in new:
                if len(listers[key]) > 1:
                    self.prefix_bytes += size[key]
                    if key in self._holders:
                        self.prefix_hit_bytes += size[key]
        return tokens * self._bpt, tokens, False, None, mine, share

    def hold(self, i: int, session: str, was: int | None, meta: KVMeta, now: float) -> KVMeta:
        new = self._lists[i]
        self._take(session, new)  # the new history first: what it shares with the old stays
        if was is not None:
            self._release(session, {k for k, _ in self._old} - {k for k, _ in new})
            self.logical -= was
        meta = msgspec.structs.replace(meta, tier_shared=(self._resident_shared(new),))
        metas = self.view._metas
        for other in sorted(self._changed - {session}):  # a fork now shares (or no longer)
            m = msgspec.structs.replace(metas[other], shared_bytes=self._shared[other])
            if other in self.resident:
                self._moved.discard(other)
                m = msgspec.structs.replace(m, tier_shared=(self._here.get(other, 0),))
                self.residency.admitted(m, now, 0)
            else:
                self.residency.published(m)
        self._changed.clear()
        self.evicted(now, session)
        return meta

    def stays(self, session: str, meta: KVMeta, now: float) -> KVMeta:
        here = self._here[session] = self._resident_shared(self._listed[session])
        if here != meta.tier_shared[0]:  # victims left since: it holds more alone
            meta = msgspec.structs.replace(meta, tier_shared=(here,))
        self.logical += meta.nbytes
        self._settle()
        return meta

    def leaves(self, session: str, nbytes: int) -> None:
        self.logical -= nbytes
        self._release(session, {k for k, _ in self._listed[session]})
        self._here.pop(session, None)

    def evicted(self, now: float, but: str) -> None:
        """Tell the policy what evicting each resident whose shared bytes moved frees."""
        metas = self.view._metas
        for other in sorted(self._moved):
            if other != but and other in self.resident:
                m = metas[other] = msgspec.structs.replace(
                    metas[other], tier_shared=(self._here.get(other, 0),)
                )
                self.residency.admitted(m, now, 0)
        self._moved.clear()

    def refused(self, session: str, nbytes: int, now: float) -> None:
        self._release(session, {k for k, _ in self._listed[session]})
        self._here.pop(session, None)
        self.evicted(now, session)
        self._settle()

    def _settle(self) -> None:
        self.peak = max(self.peak, self.used)
        self.peak_logical = max(self.peak_logical, self.logical)

    def _resident_shared(self, rs: Ranges) -> int:
        holders = self._holders
        return sum(self._size[k] for k in {k for k, _ in rs} if len(holders[k]) > 1)

    def _take(self, session: str, rs: Ranges) -> None:
        holders, here = self._holders, self._here
        for key, _ in rs:
            who = holders.get(key)
            if who is None:
                self.used += self._size[key]
                holders[key] = {session}
            elif session not in who:
                if len(who) == 1:  # its one holder no longer frees it alone
                    (other,) = who
                    here[other] = here.get(other, 0) + self._size[key]
                    self._moved.add(other)
                who.add(session)

    def _release(self, session: str, keys: Iterable[Hashable]) -> None:
        holders, here = self._holders, self._here
        for key in keys:
            who = holders[key]
            who.discard(session)
            if not who:
                del holders[key]
                self.used -= self._size[key]
            elif len(who) == 1:  # its last holder now frees it with itself
                (other,) = who
                here[other] = here.get(other, 0) - self._size[key]
                self._moved.add(other)
