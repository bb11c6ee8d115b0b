"""The default eviction ("bidaw"): tool calls and hints learned apart, priority, on_hint,
and the duel with LRU."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies import AdaptiveBidaw, BidawEviction, Hinted
from tieredkv.policies.adaptive_bidaw import SMOOTH_FROM
from tieredkv.sim.trace import Turns

GB = 10**9


def meta(
    session: str,
    nbytes: int = GB,
    *,
    answer: int = 40,
    turns: int = 1,
    tool: bool = False,
    next_turn: float | None = None,
    priority: int = 0,
    last: float = 0.0,
    query: int = 0,
) -> KVMeta:
    return KVMeta(
        session=session,
        tier="host",
        nbytes=nbytes,
        turns=turns,
        prev_answer_tokens=answer,
        turn_tokens=query + answer,
        tool_call=tool,
        next_turn=next_turn,
        priority=priority,
        last_access=last,
    )


def learn(p: AdaptiveBidaw, rounds: int, *, tool_signal: bool) -> None:
    """The same 40-token answers: people come back after all the others (~3 C of traffic),
    tool calls after ~0.3 C (at C = 40 GB). The tool flag is given only with
    ``tool_signal``. Nothing is admitted: only what the policy learns is looked at."""
    rng = random.Random(2)
    users = [f"u{i}" for i in range(120)]
    tools = {u: i < 5 for i, u in enumerate(users)}
    due = {u: rng.uniform(0, 300) for u in users}
    turns = dict.fromkeys(users, 0)
    traffic = 0.0
    for t in range(rounds):
        u = min(due, key=due.__getitem__)
        traffic = max(traffic, due[u]) + 1
        turns[u] += 1
        p.on_access(u, meta(u, turns=turns[u], tool=tools[u] and tool_signal), float(t))
        due[u] = traffic + (rng.uniform(8, 16) if tools[u] else rng.uniform(250, 350))


def test_tool_calls_are_learned_apart_from_answers_of_the_same_length() -> None:
    p = AdaptiveBidaw(capacity=40 * GB, refresh_every=64)
    learn(p, 6000, tool_signal=True)
    answer, tool = p.bucket_of(40), p.bucket_of(40) + len(p.answer_edges) + 1
    assert p.kind_of(answer) == "answer"
    assert p.kind_of(tool) == "tool"
    people, agents = p.observed(answer), p.observed(tool)
    assert people
    assert agents
    assert sorted(agents)[len(agents) // 2] < 0.5 * 40 * GB < sorted(people)[len(people) // 2]
    table_tool, table_people = p.table(tool), p.table(answer)
    assert table_tool is not None
    assert table_people is not None
    assert table_tool[0] > 0.9 > table_people[0]  # a fresh tool call: back within C
    # the paper's policy, on the same stream, has one bucket for both
    paper = BidawEviction(capacity=40 * GB, refresh_every=64)
    learn(paper, 6000, tool_signal=True)  # type: ignore[arg-type]
    mixed = paper.observed(paper.bucket_of(40))
    assert len(mixed) == len(people) + len(agents)


def test_a_tool_call_back_soon_is_ranked_by_the_memory_time_it_holds() -> None:
    """Per byte alone, a large conversation whose tool returns within 0.3 C is worth less
    than a small one whose person reads for 3 C; but it holds its bytes for a tenth of the
    time. Tool calls are ranked by potential per byte times C over the expected time held,
    so the person's conversation goes first."""
    p = AdaptiveBidaw(capacity=40 * GB, refresh_every=64, duel_block=10**9, ranking="potential")
    learn(p, 6000, tool_signal=True)
    answer, tool = p.bucket_of(40), p.bucket_of(40) + len(p.answer_edges) + 1
    table_tool, table_people = p.table(tool), p.table(answer)
    assert table_tool is not None
    assert table_people is not None
    assert table_people[0] > 0
    size, small = 20 * GB, int(20 * GB * table_people[0] / table_tool[0] / 1.5)
    channel = MetadataChannel([TierInfo(name="host", level=0, capacity=40 * GB)])
    for name, m in (("agent", meta("agent", size, tool=True)), ("person", meta("person", small))):
        channel.put(m)
        p.on_access(name, m, 6000.0)
        p.on_admit(name, m, 6000.0)
    assert p.potential("agent") == table_tool[0]
    assert p.potential("agent") / size < p.potential("person") / small  # type: ignore[operator]
    assert p.victims(1, 6000.0, channel) == ["person"]


def test_density_ranking_weighs_the_seconds_a_conversation_holds_its_bytes() -> None:
    """A large conversation whose tool returns within seconds holds its bytes for a tenth
    of the time a person reading for minutes does. Conversations are ranked by hits per
    byte per second of memory: the person's conversation goes first unless it is small
    enough to hold fewer byte-seconds per hit."""
    p = AdaptiveBidaw(capacity=40 * GB, refresh_every=64, duel_block=10**9, ranking="density")
    learn(p, 6000, tool_signal=True)
    answer, tool = p.bucket_of(40), p.bucket_of(40) + len(p.answer_edges) + 1
    people, agents = p.observed_seconds(answer), p.observed_seconds(tool)
    assert sorted(agents)[len(agents) // 2] * 10 < sorted(people)[len(people) // 2]
    tables = p.density(tool), p.density(answer)
    assert tables[0] is not None
    assert tables[1] is not None
    # just accessed: the density at 0 s elapsed (every answer is 40 tokens, so no reading
    # rate can be fitted and the delay past it is the elapsed time)
    assert p.read_rate == 0.0
    dense_tool = tables[0][p.density_grid(tool).index(0.0)]
    dense_people = tables[1][p.density_grid(answer).index(0.0)]
    assert dense_tool > 10 * dense_people > 0
    size, small = 20 * GB, int(20 * GB * dense_people / dense_tool * 1.5)
    channel = MetadataChannel([TierInfo(name="host", level=0, capacity=40 * GB)])
    for name, m in (("agent", meta("agent", size, tool=True)), ("person", meta("person", small))):
        channel.put(m)
        p.on_access(name, m, 6000.0)
        p.on_admit(name, m, 6000.0)
    assert p.victims(1, 6000.0, channel) == ["person"]
    # a person's conversation a sixth of that size holds fewer byte-seconds per hit
    p.on_remove("person")
    tiny = meta("person", small // 6)
    channel.put(tiny)
    p.on_admit("person", tiny, 6000.0)
    assert p.victims(1, 6000.0, channel) == ["agent"]


def test_a_hint_is_learned_by_its_class_and_a_late_hint_moves_the_session() -> None:
    p = AdaptiveBidaw(capacity=10 * GB)
    assert isinstance(p, Hinted)
    p.on_access("a", meta("a", next_turn=100.0, last=0.0), 0.0)  # hinted: 100 s
    hinted = 2 * (len(p.answer_edges) + 1) + 6  # the class [64, 128) s
    assert p._seen["a"].bucket == hinted
    p.on_admit("a", meta("a"), 0.0)
    p.on_hint("a", meta("a", tool=True, last=0.0), 5.0)  # hint withdrawn: a tool call
    assert p.kind_of(p._seen["a"].bucket) == "tool"
    p.on_hint("nobody", meta("nobody", next_turn=3.0), 5.0)  # unknown: ignored
    assert "nobody" not in p._seen


def test_hints_are_judged_when_their_time_passes_and_superseded_ones_are_let_go() -> None:
    """Every outstanding hint is judged once, when its slack runs out or its conversation
    comes back (a reference model here), while 300 conversations re-hint again and again:
    the superseded deadlines are moved out a few per hint, and never pile up."""
    p = AdaptiveBidaw(capacity=10 * GB)
    rng = random.Random(5)
    due: dict[str, tuple[float, float]] = {}
    kept = told = 0.0
    decay = 0.5 ** (1.0 / p.samples)

    def judge(on_time: bool) -> None:
        nonlocal kept, told
        kept, told = kept * decay + on_time, told * decay + 1.0

    def tick(now: float) -> None:
        for s, (w, d) in list(due.items()):
            if w + d < now:
                del due[s]
                judge(False)

    now = 0.0
    drains = 0
    for step in range(30_000):
        now += rng.expovariate(20.0)
        s = f"c{rng.randrange(300)}"
        hint = None if rng.random() < 0.05 else now + rng.choice((0.5, 5.0, 60.0, 600.0))
        m = meta(s, next_turn=hint, last=now)
        draining = bool(p._draining)  # (private: the move of deadlines is what is tested)
        tick(now)
        if step % 7 == 0:
            p.on_hint(s, m, now)
        else:
            p.on_access(s, m, now)
            if s in due:
                w, d = due.pop(s)
                judge(abs(now - w) <= d)
        if hint is None:
            due.pop(s, None)
        else:
            due[s] = (hint, max(p.hint_slack, 0.25 * (hint - now)))
        drains += bool(p._draining) and not draining
        assert p.hint_trust() == (kept + 4.0) / (told + 4.0)
        assert len(p._deadlines) + len(p._draining) <= 4 * len(due) + 200
    assert drains >= 10
    assert told > 50


def test_priority_weighs_the_score() -> None:
    view = MetadataChannel([TierInfo(name="host", level=0, capacity=40 * GB)])
    p = AdaptiveBidaw(capacity=40 * GB, refresh_every=64, duel_block=10**9)  # learned order
    learn(p, 3000, tool_signal=True)
    # three fresh tool calls, alike but for their priority (the oldest first)
    for i, (s, prio) in enumerate((("high", 2), ("mid", 0), ("low", -2))):
        m = meta(s, priority=prio, tool=True)
        view.put(m)
        p.on_access(s, m, 3000.0 + i)
        p.on_admit(s, m, 3000.0 + i)
    potentials = {s: p.potential(s) for s in ("high", "mid", "low")}
    assert len(set(potentials.values())) == 1
    assert potentials["low"]
    assert p.victims(GB, 3003.0, view) == ["low"]
    assert p.victims(3 * GB, 3003.0, view) == ["low", "mid", "high"]


def test_the_duel_hands_eviction_to_lru_order_and_back() -> None:
    view = MetadataChannel([TierInfo(name="host", level=0, capacity=3 * GB)])
    p = AdaptiveBidaw(capacity=3 * GB, duel_block=10, duel_retry=2)
    for i, s in enumerate("abc"):
        m = meta(s, turns=1)
        view.put(m)
        p.on_access(s, m, float(i))
        p.on_admit(s, m, float(i))
    p.on_access("a", meta("a", turns=1), 3.0)  # a is now the most recent
    for _ in range(10):  # one block lost to the shadow: not enough
        p._score_duel(False, True)
    assert p.mode == "learned"
    for _ in range(10):  # a second in a row
        p._score_duel(False, True)
    assert p.mode == "recency"
    assert p.victims(2 * GB, 4.0, view) == ["b", "c"]
    view.update("b", pinned_until=10.0)
    assert p.victims(2 * GB, 4.0, view) == ["c", "a"]
    assert p.victims(3 * GB, 4.0, view) is None
    for _ in range(20):  # two blocks in LRU order: a trial of the learned order
        p._score_duel(True, True)
    assert p.mode == "learned"
    for _ in range(10):  # the trial lost: back at once, and the next trial waits longer
        p._score_duel(False, True)
    assert p.mode == "recency"
    for _ in range(20):
        p._score_duel(True, True)
    assert p.mode == "recency"
    for _ in range(20):  # four blocks
        p._score_duel(True, True)
    assert p.mode == "learned"
    for _ in range(10):  # a trial won: the learned order stays
        p._score_duel(True, True)
    assert p.mode == "learned"
    for _ in range(10):  # one block lost outside a trial is not enough
        p._score_duel(False, True)
    assert p.mode == "learned"


def test_bad_parameters_say_what_to_fix() -> None:
    with pytest.raises(ValueError, match="hint_edges must be positive"):
        AdaptiveBidaw(hint_edges=(4, 2))
    with pytest.raises(ValueError, match="duel_block"):
        AdaptiveBidaw(duel_block=0)


def test_the_duel_counts_a_promoted_miss_as_a_miss() -> None:
    """The live cache promotes a miss before it notifies the load's access: the policy
    must not count it as its own hit."""
    p = AdaptiveBidaw(capacity=10 * GB, duel_block=10**9)
    p.on_access("a", meta("a", turns=1), 0.0)  # append of turn 1
    p.on_admit("a", meta("a", turns=1), 0.0)
    p.on_access("a", meta("a", turns=1), 1.0)  # load of turn 2: resident, a hit
    assert p._duel == [1, 1, 1]
    p.on_access("a", meta("a", turns=2), 2.0)  # append of turn 2 (no reuse counted)
    p.on_remove("a")  # demoted
    p.on_access("b", meta("b", turns=1), 3.0)
    p.on_admit("a", meta("a", turns=2), 4.0)  # promoted for its load...
    p.on_access("a", meta("a", turns=2), 4.0)  # ...which is a miss
    assert p._duel == [2, 1, 2]


def test_an_unknown_ranking_is_refused() -> None:
    with pytest.raises(ValueError, match="ranking must be one of"):
        AdaptiveBidaw(ranking="seconds")


def test_the_rankings_duel_and_the_tier_follows_the_one_that_hits_more() -> None:
    """By default the tier evicts by one ranking and a shadow of the same capacity by the
    other; the shadow's decayed lead in hits past ``rival_margin`` swaps them."""
    p = AdaptiveBidaw(capacity=3 * GB, rival_margin=2.5, rival_half_life=10**6)
    assert (p.ranking, p.order, p.switches) == ("auto", "potential", 0)
    for i, s in enumerate("abcd"):  # the shadow holds what fits, the newest included
        p.on_access(s, meta(s), float(i))
        assert set(p.rival_sessions()) == set("abcd"[: i + 1][-3:])
    for _ in range(2):
        p._score_rivals(False, True)
    assert p.order == "potential"
    p._score_rivals(True, True)  # both hit: no lead gained
    p._score_rivals(False, True)  # a lead of 3 (2.5 and a little decay)
    assert (p.order, p.switches) == ("density", 1)
    for _ in range(10):  # the tier's own hits: the lead is bounded below by the margin
        p._score_rivals(True, False)
    for _ in range(4):
        p._score_rivals(False, True)
    assert p.order == "density"
    for _ in range(2):  # from -2.5 to +3.5
        p._score_rivals(False, True)
    assert (p.order, p.switches) == ("potential", 2)
    with pytest.raises(ValueError, match="rival_margin"):
        AdaptiveBidaw(rival_margin=0)


def test_on_the_mooncake_head_the_potential_keeps_the_tier() -> None:
    """On the Mooncake trace's head the hit density in time never leads (no conversation
    is gone for long enough to count as gone within it), so the default decides exactly
    as the hit potential alone."""
    from tieredkv.sim.replay import replay
    from tieredkv.sim.workloads import read_mooncake

    turns = read_mooncake(
        Path(__file__).resolve().parents[1] / "data/mooncake/conversation_trace_head1500.jsonl"
    )
    warmup = len(turns) // 10
    auto = AdaptiveBidaw()
    hits = replay(turns, auto, host_bytes=100 * GB, warmup=warmup).hits
    alone = replay(turns, AdaptiveBidaw(ranking="potential"), host_bytes=100 * GB, warmup=warmup)
    density = replay(turns, AdaptiveBidaw(ranking="density"), host_bytes=100 * GB, warmup=warmup)
    assert (auto.order, auto.switches) == ("potential", 0)
    assert hits == alone.hits > density.hits


def read_and_type(p: AdaptiveBidaw, until: float) -> None:
    """People who read 1 s per token of the previous answer (113 to 159 tokens, one
    answer bucket) and then type for 5 to 10 s, and always come back."""
    rng = random.Random(3)
    users = [f"u{i}" for i in range(200)]
    answers = {u: rng.randint(113, 159) for u in users}
    due = {u: rng.uniform(0, 150) for u in users}
    turns = dict.fromkeys(users, 0)
    while True:
        u = min(due, key=due.__getitem__)
        now = due[u]
        if now > until:
            return
        turns[u] += 1
        answers[u] = rng.randint(113, 159)
        p.on_access(u, meta(u, answer=answers[u], turns=turns[u], last=now), now)
        due[u] = now + answers[u] + rng.uniform(5, 10)


def test_the_reading_time_is_learned_per_token_and_each_session_is_shifted_by_its_own() -> None:
    """Within one answer bucket (113 to 159 tokens) the gap is 1 s per token plus 5-10 s.
    The policy learns the rate, and ranks each session by the delay elapsed past its own
    reading time: a 113-token reader 135 s after its turn is late (its user would have
    been back by 123 s), a 159-token one 105 s after its turn is still reading (back in
    59-64 s), so the late one goes first; 35 s earlier it was the other way round. By the
    bucket's distribution of gaps (118 to 169 s) the late one would still be due and the
    reader, 105 s in, the least likely."""
    p = AdaptiveBidaw(capacity=40 * GB, refresh_every=64, duel_block=10**9, ranking="density")
    read_and_type(p, 3000.0)
    assert p.read_rate == pytest.approx(1.0, abs=0.02)
    channel = MetadataChannel([TierInfo(name="host", level=0, capacity=40 * GB)])
    for name, answer, at in (("short", 113, 3000.0), ("long", 159, 3030.0)):
        m = meta(name, answer=answer, turns=3, last=at)
        channel.put(m)
        p.on_access(name, m, at)
        p.on_admit(name, m, at)
    # at 3,100 s the short one's reader is 13-18 s from the next turn, the long one's 89 s
    assert p.victims(1, 3100.0, channel) == ["long"]
    for i in range(8):  # traffic meanwhile: residents are rescored as it flows
        p.on_access(f"new{i}", meta(f"new{i}", last=3135.0), 3135.0)
    assert p.victims(1, 3135.0, channel) == ["short"]


def test_a_persons_delays_are_smoothed_once_the_window_holds_enough_of_them() -> None:
    """With fewer than SMOOTH_FROM gaps of persons' turns the table is the empirical one
    (as with ``smooth_delays=False``); past it, the smoothed one, which has no staircase:
    its density changes smoothly from one delay to the next."""

    def fed(until: float, smooth: bool) -> AdaptiveBidaw:
        p = AdaptiveBidaw(
            capacity=40 * GB,
            refresh_every=64,
            duel_block=10**9,
            ranking="density",
            smooth_delays=smooth,
        )
        read_and_type(p, until)
        return p

    assert AdaptiveBidaw().smooth_delays  # the default
    bucket = AdaptiveBidaw().bucket_of(130)
    few, few_plain = fed(800.0, True), fed(800.0, False)
    assert 64 <= len(few._gaps) < SMOOTH_FROM
    assert few.density(bucket) == few_plain.density(bucket)
    many, many_plain = fed(3000.0, True), fed(3000.0, False)
    assert len(many._gaps) >= SMOOTH_FROM
    rough, fine = many_plain.density(bucket), many.density(bucket)
    assert rough is not None
    assert fine is not None
    # a delay of 5-10 s: the empirical table steps at each sample, the smoothed one does not
    grid = many.density_grid(bucket)
    span = [k for k, x in enumerate(grid) if 4.0 <= x <= 11.0]

    def jumps(row: list[float]) -> float:
        return max(abs(row[k + 1] - row[k]) for k in span[:-1])

    assert jumps(fine) < 0.5 * jumps(rough)


def reading(p: AdaptiveBidaw, rounds: int) -> None:
    """Users who read: the traffic before a user's next turn is half a GB per token of
    its previous answer, 10 tokens (5 GB) or 60 (30 GB), every session 1 GB."""
    rng = random.Random(3)
    answers = {f"u{i}": 10 if i % 2 else 60 for i in range(40)}
    due = {u: rng.uniform(0, 30) for u in answers}
    turns = dict.fromkeys(answers, 0)
    traffic = 0.0
    for t in range(rounds):
        u = min(due, key=due.__getitem__)
        traffic = max(traffic, due[u]) + 1
        turns[u] += 1
        p.on_access(u, meta(u, answer=answers[u], turns=turns[u]), float(t))
        due[u] = traffic + 0.5 * answers[u] * rng.uniform(0.8, 1.2)


def test_a_bucket_without_samples_of_its_own_is_placed_by_its_answers_length() -> None:
    """Distances seen after answers of 10 and 60 tokens only: with the read prior, a bucket
    of shorter answers (5 tokens) starts with a higher potential than the pooled prior
    gives every bucket, one of longer answers (200 tokens) with a lower one."""
    tables: dict[bool, tuple[float, float]] = {}
    for read_prior in (True, False):
        p = AdaptiveBidaw(capacity=16 * GB, refresh_every=64, read_prior=read_prior)
        reading(p, 400)
        assert not p.observed(p.bucket_of(5))
        assert not p.observed(p.bucket_of(200))
        assert p.observed(p.bucket_of(10))
        assert p.observed(p.bucket_of(60))
        shorter, longer = p.table(p.bucket_of(5)), p.table(p.bucket_of(200))
        assert shorter is not None
        assert longer is not None
        tables[read_prior] = (shorter[0], longer[0])
    (short, long), (pooled_short, pooled_long) = tables[True], tables[False]
    assert pooled_short == pytest.approx(pooled_long)  # without: the same prior for both
    assert short > pooled_short + 0.1
    assert long < pooled_long - 0.2


def arrivals(
    p: AdaptiveBidaw,
    until: float,
    seed: int,
    *,
    turns_of: Callable[[random.Random], int],
    query_of: Callable[[random.Random], int] = lambda rng: 0,
    leaves: Callable[[random.Random, int], bool] = lambda rng, query: False,
) -> None:
    """A new user every second, with ``turns_of`` turns at most, 20 to 40 s apart, every
    answer 40 tokens: a turn's new input is ``query_of`` tokens, after which the user
    leaves early if ``leaves``."""
    rng = random.Random(seed)
    due: dict[str, tuple[float, int, int]] = {}  # user -> (next turn, turns so far, of)
    now, n = 0.0, 0
    while now < until:
        now += 1.0
        user = f"u{n}"
        n += 1
        due[user] = (now, 0, turns_of(rng))
        for u, (at, turns, of) in sorted(due.items(), key=lambda kv: kv[1][0]):
            if at > now:
                break
            query = query_of(rng)
            p.on_access(u, meta(u, turns=turns + 1, last=at, query=query), at)
            if turns + 1 == of or leaves(rng, query):
                del due[u]
            else:
                due[u] = (at + rng.uniform(20, 40), turns + 1, of)


def arrive_and_mostly_leave(p: AdaptiveBidaw, until: float) -> None:
    """A new user every second; three in four ask once and never come back, the others
    ask six times, 20 to 40 s apart (the Mooncake conversation trace's shape: a
    conversation that has come back is likelier to come back again). Every answer is 40
    tokens, so the answer's length says nothing."""
    arrivals(p, until, 5, turns_of=lambda rng: 1 if rng.random() < 0.75 else 6)


def test_the_chance_of_coming_back_is_learned_by_the_turns_so_far() -> None:
    """Answers of one length, one gap distribution: what separates a user who comes back
    from one who leaves is how many turns the conversation already has. With turn classes
    (the default) a first turn is worth less than a third turn, so it goes first, although
    it is a second nearer its likely return; pooled over turns (``turn_edges=()``) the two
    are alike but for that second, and the third-turn conversation goes."""
    chosen = {}
    for edges in ((), (1, 2, 3, 5, 8)):
        p = AdaptiveBidaw(
            capacity=40 * GB, refresh_every=64, duel_block=10**9, ranking="density",
            turn_edges=edges,
        )  # fmt: skip
        arrive_and_mostly_leave(p, 3000.0)
        if edges:
            classes = [p.turn_class(t) for t in (1, 2, 3, 4, 5, 6, 8, 9, 100)]
            assert classes == [0, 1, 2, 3, 3, 4, 4, 5, 5]
        channel = MetadataChannel([TierInfo(name="host", level=0, capacity=40 * GB)])
        for name, turns, at in (("first", 1, 3000.0), ("third", 3, 3001.0)):
            m = meta(name, turns=turns, last=at)
            channel.put(m)
            p.on_access(name, m, at)
            p.on_admit(name, m, at)
        chosen[edges] = p.victims(1, 3011.0, channel)
    assert chosen == {(): ["third"], (1, 2, 3, 5, 8): ["first"]}
    with pytest.raises(ValueError, match="turn_edges"):
        AdaptiveBidaw(turn_edges=(2, 2))
    with pytest.raises(ValueError, match="turn_edges"):
        AdaptiveBidaw(turn_edges=(0, 3))


def ask_long_and_leave(p: AdaptiveBidaw, until: float) -> None:
    """A new user every second, each with six turns 20 to 40 s apart, every answer 40
    tokens; a user's turn brings a new input of 100 tokens, or of 5,000 (a document) with
    which the user leaves in three cases in four: what separates a user who comes back
    from one who leaves is the length of the latest turn's input (the Mooncake trace's
    shape: a later turn that adds 2,000 tokens or more is followed 13-21% of the time, one
    that adds under 500 57%)."""
    arrivals(
        p, until, 11, turns_of=lambda rng: 6,
        query_of=lambda rng: 5000 if rng.random() < 0.3 else 100,
        leaves=lambda rng, query: query == 5000 and rng.random() < 0.75,
    )  # fmt: skip


def test_the_chance_of_coming_back_is_learned_by_the_latest_turns_new_input() -> None:
    """Answers of one length, one gap distribution: a user who just sent a long input
    (``turn_tokens - prev_answer_tokens``) is likely gone. With the query classes (the
    default) that conversation goes first, although it is a second nearer its likely
    return; without them (``query_edges=()``) the two are alike but for that second, and
    the one with the short input goes."""
    chosen = {}
    for edges in ((), (250, 1000, 4000)):
        p = AdaptiveBidaw(
            capacity=40 * GB, refresh_every=64, duel_block=10**9, ranking="density",
            query_edges=edges,
        )  # fmt: skip
        ask_long_and_leave(p, 3000.0)
        channel = MetadataChannel([TierInfo(name="host", level=0, capacity=40 * GB)])
        for name, query, at in (("long", 5000, 3000.0), ("short", 100, 3001.0)):
            m = meta(name, turns=2, last=at, query=query)
            channel.put(m)
            p.on_access(name, m, at)
            p.on_admit(name, m, at)
        chosen[edges] = p.victims(1, 3011.0, channel)
        if edges:
            assert [p.query_class(meta("x", query=q)) for q in (0, 249, 250, 999, 4000)] == [
                0, 0, 1, 1, 3,
            ]  # fmt: skip
            assert p.reader_class(meta("x", turns=2, query=5000)) == 1 + 3 * 3
    assert chosen == {(): ["short"], (250, 1000, 4000): ["long"]}
    assert AdaptiveBidaw().query_edges == (250, 1000, 4000)  # the default
    # an unknown input (0 tokens: a publisher that does not say) is in the first class
    assert AdaptiveBidaw().query_class(KVMeta(session="x", tier="host")) == 0
    with pytest.raises(ValueError, match="query_edges"):
        AdaptiveBidaw(query_edges=(1000, 1000))
    with pytest.raises(ValueError, match="query_edges"):
        AdaptiveBidaw(query_edges=(0, 300))


def leavers(until: int) -> Turns:
    """:func:`arrive_and_mostly_leave`'s users as a turn stream: histories of 2,000
    tokens (every conversation the same size), a new user every second."""
    rng = random.Random(5)
    user, time, query, answer, index = [], [], [], [], []
    for n in range(until):
        at = float(n)
        for r in range(1 if rng.random() < 0.75 else 6):
            user.append(n)
            time.append(at)
            query.append(2000)
            answer.append(40)
            index.append(r)
            at += rng.uniform(20, 40)
    return Turns(user, time, query, answer, index)


def test_returns_the_potential_has_forgotten_still_count_in_the_duel_of_the_rankings() -> None:
    """Users come back 20-40 s after a turn, past the potential's horizon in bytes of
    traffic (four host capacities), so the potential forgets every one of them and keeps
    almost nothing that comes back. The duel of the two rankings counts those returns too
    (the density in time holds them: it learns in seconds, and which turns come back), so
    the tier goes to the density."""
    from tieredkv.sim.replay import replay

    turns = leavers(3000)
    warmup = len(turns) // 10
    auto = AdaptiveBidaw()
    hits = replay(turns, auto, host_bytes=20 * GB, warmup=warmup).hits
    potential = replay(turns, AdaptiveBidaw(ranking="potential"), host_bytes=20 * GB, warmup=warmup)
    assert (auto.order, auto.switches) == ("density", 1)
    assert hits > 5 * potential.hits
