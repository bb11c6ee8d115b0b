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

from ..meta import TierInfo, advance_meta
from ..policies.base import Eviction
from ..residency import Residency
from .replay import OPT_13B_BYTES_PER_TOKEN, ReplayResult, _View
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

    :raises ValueError: on a non-positive budget or size, or a negative window/warmup
    """
    if host_bytes <= 0 or bytes_per_token <= 0:
        raise ValueError("host_bytes and bytes_per_token must be positive")
    if window < 0 or warmup < 0:
        raise ValueError("window and warmup must be >= 0")
    turns = forest.turns
    users = turns.user.tolist()
    names = {u: f"u{u}" for u in set(users)}
    sessions = [names[u] for u in users]
    times = turns.time.tolist()
    answers = turns.answer.tolist()
    rounds = turns.round_index.tolist()
    nxt = turns.next_index().tolist()
    if sharing:
        lists: list[Ranges] = forest.ranges
    else:  # every conversation lists a copy of its own
        lists = [
            tuple(((s, k), t) for k, t in rs) for s, rs in zip(sessions, forest.ranges, strict=True)
        ]
    tiers = (
        TierInfo(name=_HOST, level=0, capacity=host_bytes),
        TierInfo(name="ssd", level=1, capacity=2**62),
    )
    view = _View(sessions, window, tiers)
    metas = view._metas
    residency = Residency(view, [policy])
    accessed = residency.accessed
    admitted = residency.admitted
    removed = residency.removed
    victims = policy.victims
    size: dict[Hashable, int] = {}  # range -> bytes
    listers: dict[Hashable, set[str]] = {}  # range -> conversations whose history lists it
    listed: dict[str, Ranges] = {}  # conversation -> its history's ranges
    shared: dict[str, int] = {}  # conversation -> bytes of its ranges another one lists
    holders: dict[Hashable, set[str]] = {}  # held range -> resident conversations listing it
    here: dict[str, int] = {}  # resident -> bytes of its ranges another resident lists
    resident: dict[str, int] = {}  # resident conversation -> its history bytes
    history: dict[str, int] = {}
    used = logical = peak = peak_logical = 0
    hits = misses = hit_bytes = miss_bytes = evictions = rejected = 0
    prefix_bytes = prefix_hit_bytes = 0
    moved: set[str] = set()  # residents whose bytes shared in host memory changed

    def hold(session: str, rs: Ranges) -> None:
        nonlocal used
        for key, _ in rs:
            who = holders.get(key)
            if who is None:
                used += size[key]
                holders[key] = {session}
            elif session not in who:
                if len(who) == 1:  # its one holder no longer frees it alone
                    (other,) = who
                    here[other] = here.get(other, 0) + size[key]
                    moved.add(other)
                who.add(session)

    def release(session: str, keys: Iterable[Hashable]) -> None:
        nonlocal used
        for key in keys:
            who = holders[key]
            who.discard(session)
            if not who:
                del holders[key]
                used -= size[key]
            elif len(who) == 1:  # its last holder now frees it with itself
                (other,) = who
                here[other] = here.get(other, 0) - size[key]
                moved.add(other)

    def republish(now: float, but: str) -> None:
        """Tell the policy what evicting each resident whose shared bytes moved frees."""
        for other in sorted(moved):
            if other != but and other in resident:
                m = metas[other] = msgspec.structs.replace(
                    metas[other], tier_shared=(here.get(other, 0),)
                )
                admitted(m, now, 0)
        moved.clear()

    def evict(chosen: list[str], now: float, but: str) -> None:
        nonlocal evictions, logical
        for v in chosen:
            logical -= resident.pop(v)
            release(v, {k for k, _ in listed[v]})
            here.pop(v, None)
            removed(v, 0)
        evictions += len(chosen)
        republish(now, but)

    for i, session in enumerate(sessions):
        now = times[i]
        was = resident.get(session)
        if rounds[i] and i >= warmup:
            if was is None:
                misses += 1
                miss_bytes += history[session]
            else:
                hits += 1
                hit_bytes += was
        # the history's ranges now, and what that changes in others' shared bytes
        new = lists[i]
        old = listed.get(session, ())
        changed: set[str] = set()
        new_keys = {k for k, _ in new}
        old_keys = {k for k, _ in old}
        for key, t in new:
            if key in old_keys:
                continue
            size[key] = t * bytes_per_token
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
        listed[session] = new
        mine = shared[session] = sum(size[k] for k, _ in new if len(listers[k]) > 1)
        share = sum(size[k] // len(listers[k]) for k, _ in new)
        tokens = sum(t for _, t in new)
        nbytes = tokens * bytes_per_token
        history[session] = nbytes
        n = nxt[i]
        view._i = i
        if not rounds[i] and i >= warmup:  # a first turn: what it shares is a prefix
            for key, _ in new:
                if len(listers[key]) > 1:
                    prefix_bytes += size[key]
                    if key in holders:
                        prefix_hit_bytes += size[key]
        hold(session, new)  # the new history first: what it shares with the old one stays held
        if was is not None:
            release(session, old_keys - new_keys)
            logical -= was
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
            next_access=times[n] if n >= 0 else None,
            accesses=rounds[i] + 1,
            shared_bytes=mine,
            tier_shared=(sum(size[k] for k in new_keys if len(holders[k]) > 1),),
            share_bytes=share,
        )
        for other in sorted(changed - {session}):  # a fork now shares (or no longer) its history
            m = msgspec.structs.replace(metas[other], shared_bytes=shared[other])
            if other in resident:
                moved.discard(other)
                m = msgspec.structs.replace(m, tier_shared=(here.get(other, 0),))
                admitted(m, now, 0)
            else:
                residency.published(m)
        republish(now, session)
        if used <= host_bytes:
            accessed(meta, now, 0)
            resident[session] = nbytes
            here[session] = meta.tier_shared[0]
            logical += nbytes
        else:
            accessed(meta, now)
            fits = False
            if nbytes <= host_bytes:
                protected = frozenset((session,))
                while True:
                    chosen = victims(used - host_bytes, now, view, protected)
                    if not chosen:
                        break
                    evict(chosen, now, session)
                    if used <= host_bytes:
                        fits = True
                        break
            if fits:
                resident[session] = nbytes
                logical += nbytes
                here[session] = mine_here = sum(size[k] for k in new_keys if len(holders[k]) > 1)
                if mine_here != meta.tier_shared[0]:
                    meta = msgspec.structs.replace(meta, tier_shared=(mine_here,))
                admitted(meta, now, 0)
            else:
                rejected += 1
                release(session, new_keys)
                here.pop(session, None)
                republish(now, session)
                if was is not None:  # it cannot grow in place: it leaves host memory
                    del resident[session]
                    removed(session, 0)
        peak = max(peak, used)
        peak_logical = max(peak_logical, logical)
    bpt = bytes_per_token
    return ForestReplayResult(
        replay=ReplayResult(
            policy=policy.name,
            host_bytes=host_bytes,
            turns=len(sessions),
            hits=hits,
            misses=misses,
            hit_bytes=hit_bytes,
            miss_bytes=miss_bytes,
            evictions=evictions,
            rejected=rejected,
        ),
        sharing=sharing,
        peak_stored_bytes=peak,
        peak_logical_bytes=peak_logical,
        unique_bytes=forest.unique_tokens() * bpt,
        total_bytes=forest.total_tokens() * bpt,
        prefix_bytes=prefix_bytes,
        prefix_hit_bytes=prefix_hit_bytes,
    )
