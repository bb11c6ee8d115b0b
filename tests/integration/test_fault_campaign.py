"""The project's own fault campaign: cancellation of every kind and I/O errors at the os
calls, over many sessions at once, then an invariant check and a byte-for-byte check.

Each session is driven by one task that runs random operations one after another (many
sessions run at once), so the model of what is stored stays exact: an operation that
returns is acknowledged; one that raises a cancellation or a :class:`TieredKVError` must
have left no trace, which is checked right away (a drop that was cancelled either did
nothing or completed). Afterwards ``tests.invariants.problems`` compares the cache's
index, every tier's index, the files, the channel and the policies, every acknowledged
byte is loaded back, and the cache is reopened on the same directory and checked again.

The quick, seeded variant runs in the test command. A longer one is the same tests with
``TIEREDKV_CAMPAIGN_SCALE`` set (documented in docs/explanation/architecture.md)::

    TIEREDKV_CAMPAIGN_SCALE=20 .venv/bin/pytest tests/integration/test_fault_campaign.py -s

Each test prints its counts: operations, faults injected, cancellations, wrong bytes,
lost sessions, unexpected exceptions.

The ``forest`` variants make a share of the operations forks (of plain conversations, of
forks, at a point inside a stored turn), parent drops and loads of forks, and check the
closed directory with ``fsck`` (no dangling reference) before and after the reopen::

    TIEREDKV_CAMPAIGN_SCALE=10 .venv/bin/pytest tests/integration/test_fault_campaign.py \
        -s -k forest

The operations and faults are drawn from fixed seeds; ``TIEREDKV_CAMPAIGN_SEED=n`` shifts
them all by ``n``, for another draw (the interleaving of the sessions also depends on
timing, so two runs of one seed may differ).
"""

from __future__ import annotations

import errno
import os
import random
import time
from collections import Counter
from pathlib import Path

import anyio
import pytest
import torch

from tests.cancellation import CANCELS as KINDS
from tests.cancellation import cancellable
from tests.faults import FaultInjector
from tests.invariants import Model, problems, wrong_bytes
from tieredkv import (
    HostMemoryTier,
    PinLimitError,
    RetentionHint,
    SSDTier,
    TieredKVCache,
    TieredKVError,
)
from tieredkv._cache.state import Seg
from tieredkv.errors import SessionNotFoundError
from tieredkv.fsck import FsckReport, check_directory
from tieredkv.meta import Demoted, Event, Evicted

KIB = 1024
SCALE = int(os.environ.get("TIEREDKV_CAMPAIGN_SCALE", "1"))
CANCELS = (*KINDS, "none")
SEED = int(os.environ.get("TIEREDKV_CAMPAIGN_SEED", "0"))
pytestmark = pytest.mark.timeout(120 * SCALE)
"""The project's 120 s per test, scaled with the campaign (a longer run would time out:
at ``TIEREDKV_CAMPAIGN_SCALE=10`` on a busy machine the 400 opens of
``test_seeded_io_errors_at_open_lose_nothing`` took longer)."""
forests = pytest.mark.parametrize(
    "forest", [pytest.param(False, id="plain"), pytest.param(True, id="forest")]
)


def turn(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 96 KiB per token: segments of 96-384 KiB, some copied in worker threads
    return {
        "k": torch.randint(0, 256, (tokens, 48 * KIB), dtype=torch.uint8, generator=g),
        "v": torch.randint(0, 256, (tokens, 48 * KIB), dtype=torch.uint8, generator=g),
    }


def make_cache(
    directory: Path, mode: str, *, fsync: bool, max_pinned_bytes_per_group: int | None = None
) -> TieredKVCache:
    # a host tier that holds about four sessions: moves up and down all the time; an SSD
    # tier large enough that nothing acknowledged is ever lost for want of room
    tiers = [HostMemoryTier(1536 * KIB), SSDTier(directory, 512 << 20, fsync=fsync)]
    return TieredKVCache(
        tiers,
        mode=mode,  # type: ignore[arg-type]
        max_pinned_bytes_per_group=max_pinned_bytes_per_group,
    )


def tokens(turns: list[dict[str, torch.Tensor]]) -> int:
    return sum(t["k"].shape[0] for t in turns)


def prefix(turns: list[dict[str, torch.Tensor]], n: int) -> list[dict[str, torch.Tensor]]:
    """The first ``n`` tokens of a history, as the segments a fork at ``n`` lists: whole
    turns, then the first tokens of the turn the fork point falls in."""
    out: list[dict[str, torch.Tensor]] = []
    for t in turns:
        if n <= 0:
            break
        length = t["k"].shape[0]
        out.append(t if length <= n else {name: x[:n] for name, x in t.items()})
        n -= length
    return out


class Campaign:
    """Drives random operations on many sessions and keeps the model of what is stored.

    With ``forest``, a share of the operations are forks: a task forks a stored
    conversation (a plain one, a fork, an idle one or one another task is working on, at
    its end or at a point inside a stored turn) and goes on with the fork, leaving its
    previous conversation idle; another task may later take an idle conversation up again
    (and append to it, load it, drop it: a parent drop while forks list its turns). The
    model of a fork is its parent's first N acknowledged tokens, cut as the segments it
    lists, then its own turns, so the check of every load is byte for byte and the turn
    count is the cache's. A dropped conversation's key is not used again (a parent's key
    stays taken while forks list its turns): the task goes on under a new one.
    """

    def __init__(
        self, cache: TieredKVCache, seed: int, *, cancel: bool, forest: bool = False
    ) -> None:
        self.cache = cache
        self.rng = random.Random(seed)
        self.cancel = cancel
        self.forest = forest
        self.model: Model = {}
        self.counts: Counter[str] = Counter({"wrong bytes": 0, "lost": 0})
        if forest:
            self.counts.update({"forks": 0, "fork loads": 0, "parent drops": 0})
        self.unexpected: list[str] = []
        self.doing: dict[str, str] = {}  # session -> the operation under way on it
        self.parents: dict[str, str] = {}  # fork -> its parent (acknowledged forks)
        self.owners: dict[str, list[str]] = {}  # session -> the owner of each model turn
        # fork -> (the conversation it was forked from, its fork point)
        self.points: dict[str, tuple[str, int]] = {}
        self.idle: list[str] = []  # stored conversations no task drives now
        self.names = 0

    def turns(self, session: str) -> int:
        meta = self.cache.channel.get(session)
        return meta.turns if meta is not None and meta.tier is not None else 0

    def fresh(self, base: str) -> str:
        self.names += 1
        return f"{base.split('.')[0]}.{self.names}"

    async def drive(self, session: str, ops: int) -> None:
        self.model.setdefault(session, [])
        for i in range(ops):
            session = await self.step(session, i)

    async def step(self, session: str, i: int) -> str:
        """One operation on ``session``; the session the task goes on with."""
        rng, cache, model = self.rng, self.cache, self.model
        kind = rng.choice(CANCELS) if self.cancel else "none"
        delay = rng.choice((0.0, 0.0005, 0.001, 0.002, 0.005, 0.02))
        if self.forest:
            r = rng.random()
            if r < 0.15:
                return await self.fork(session, i, kind, delay)
            if r < 0.2 and self.idle:  # take an idle conversation up again
                other = self.idle.pop(rng.randrange(len(self.idle)))
                if model[session]:
                    self.idle.append(session)
                return other
        r = rng.random()
        if self.forest and self.forked(session) and rng.random() < 0.2:
            r = 1.0  # a parent drop: its forks keep what they list
        before = list(model[session])
        self.counts["operations"] += 1
        failed = False
        try:
            if r < 0.5 or not before:
                new = turn(rng.randint(1, 4), rng.randrange(1 << 30))
                op = self.doing[session] = "append"
                done, _ = await cancellable(
                    kind, delay, lambda: cache.append(session, new, answer_tokens=i + 1)
                )
                if done:
                    model[session].append(new)
                    self.owners.setdefault(session, []).append(session)
            elif r < 0.75:
                op = self.doing[session] = "load"
                done, got = await cancellable(kind, delay, lambda: cache.load(session))
                if done:
                    self.check_bytes(session, got)
            elif r < 0.85:
                op = self.doing[session] = "load_into"
                n = tokens(before)
                out = {name: torch.zeros(n + 3, 48 * KIB, dtype=torch.uint8) for name in "kv"}
                done, got = await cancellable(kind, delay, lambda: cache.load_into(session, out))
                if done:
                    assert got == n
                    self.check_bytes(session, {k: v[:n] for k, v in out.items()})
            elif r < 0.95:
                op = self.doing[session] = "prefetch"
                done, _ = await cancellable(kind, delay, lambda: cache.prefetch(session))
            else:
                op = self.doing[session] = "drop"
                forked = self.forked(session)
                done, _ = await cancellable(kind, delay, lambda: cache.drop(session))
                if done or not cache.contains(session):
                    model[session] = []
                    self.owners[session] = []
                    if forked:
                        self.counts["parent drops"] += 1
        except SessionNotFoundError:
            if before:
                self.counts["lost"] += 1
                self.unexpected.append(f"{session} lost after {len(before)} acknowledged turns")
                model[session] = []
            return session
        except TieredKVError as exc:  # an I/O error: the operation must have left no trace
            self.counts[f"error:{type(exc).__name__}"] += 1
            done, failed = False, True
        except Exception as exc:
            self.unexpected.append(f"{op} of {session}: {type(exc).__name__}: {exc}")
            return session
        finally:
            self.doing.pop(session, None)
        if not (done or failed):
            self.counts["cancelled"] += 1
        if done and op in ("load", "load_into") and session in self.parents:
            self.counts["fork loads"] += 1
        self.agree(session, f"{op} of {session} ({'done' if done else 'not done'}, {kind})")
        if self.forest and before and not model[session]:  # dropped: its key stays taken
            session = self.fresh(session)
            model[session] = []
        return session

    def forked(self, session: str) -> bool:
        """Whether a stored fork lists turns of ``session``."""
        return any(p == session and self.model[f] for f, p in self.parents.items())

    def agree(self, session: str, what: str) -> None:
        """The cache's turn count of ``session`` is the model's (else stop checking it)."""
        if self.turns(session) != len(self.model[session]):
            self.unexpected.append(
                f"{what}: cache has {self.turns(session)} turns, "
                f"acknowledged {len(self.model[session])}"
            )
            self.model[session] = []  # resynchronise is impossible: stop checking this one
            self.counts["mismatch"] += 1

    async def fork(self, session: str, i: int, kind: str, delay: float) -> str:
        """Fork a stored conversation into a new one; go on with the fork if it was made."""
        rng, model = self.rng, self.model
        stored = sorted(s for s, t in model.items() if t)
        if not stored:
            return session
        parent = rng.choice(stored)
        history = list(model[parent])  # fixed: its key is never reused after a drop
        owners = list(self.owners[parent])
        total = tokens(history)
        at = total if rng.random() < 0.3 else rng.randint(1, total)
        child = self.fresh(session)
        model[child] = []
        new = turn(rng.randint(1, 3), rng.randrange(1 << 30))
        self.counts["operations"] += 1
        self.doing[child] = "fork"
        failed = False
        try:
            done, _ = await cancellable(
                kind,
                delay,
                lambda: self.cache.append(
                    child, new, answer_tokens=i + 1, parent=parent, parent_tokens=at
                ),
            )
        except SessionNotFoundError:  # the parent was dropped meanwhile
            self.counts["forks of a dropped parent"] += 1
            done = False
        except TieredKVError as exc:
            self.counts[f"error:{type(exc).__name__}"] += 1
            done, failed = False, True
        except Exception as exc:
            self.unexpected.append(f"fork of {parent} at {at}: {type(exc).__name__}: {exc}")
            return session
        finally:
            self.doing.pop(child, None)
        if not (done or failed):
            self.counts["cancelled"] += 1
        if done:
            listed = prefix(history, at)
            model[child] = [*listed, new]
            self.owners[child] = [*owners[: len(listed)], child]
            self.parents[child] = parent
            self.points[child] = (parent, at)
            meta = self.cache.channel[child]
            if (meta.parent, meta.parent_tokens) != (parent, at):
                self.unexpected.append(f"{child}: forked from {parent} at {at}, meta {meta}")
            self.counts["forks"] += 1
            if parent in self.parents:
                self.counts["forks of forks"] += 1
            if at not in {tokens(history[:k]) for k in range(len(history) + 1)}:
                self.counts["forks inside a turn"] += 1
        self.agree(child, f"fork {child} of {parent} at {at} ({'done' if done else 'not done'})")
        if not model[child]:
            return session  # stays in the model, empty: checked as not stored
        if model[session]:
            self.idle.append(session)
        return child

    def check_bytes(self, session: str, got: dict[str, torch.Tensor]) -> None:
        for name in ("k", "v"):
            want = torch.cat([t[name] for t in self.model[session]])
            if not torch.equal(got[name], want):
                self.counts["wrong bytes"] += 1
                self.unexpected.append(
                    f"{session}: loaded {name} differs ({self.where(session, got[name], name)})"
                )

    def where(self, session: str, got: torch.Tensor, name: str) -> str:
        """Which acknowledged turns of ``session`` a load got wrong, and whose they are."""
        bad, at = [], 0
        owners = self.owners.get(session, [])
        for i, t in enumerate(self.model[session]):
            n = t[name].shape[0]
            if not torch.equal(got[at : at + n], t[name]):
                bad.append(f"turn {i} ({owners[i] if i < len(owners) else '?'}'s)")
            at += n
        return f"{', '.join(bad) or 'none'} of {len(self.model[session])} turns differ"

    async def run(self, sessions: int, ops: int) -> None:
        async with anyio.create_task_group() as tg:
            for i in range(sessions):
                tg.start_soon(self.drive, f"s{i}", ops)


async def settle_and_check(cache: TieredKVCache, campaign: Campaign) -> None:
    await cache.flush()
    found = problems(cache)
    assert not found, "\n".join(found)
    bad = await wrong_bytes(cache, campaign.model)
    campaign.counts["wrong bytes"] += len(bad)
    assert not bad, "\n".join(bad)


async def reopen_and_check(directory: Path, mode: str, campaign: Campaign) -> None:
    """After a clean close, what the SSD kept is exactly what was acknowledged: every
    session (in inclusive mode it was written through, in exclusive mode the close wrote
    down what only host memory held; the SSD tier has room for all). ``fsck`` finds no
    damage (no dangling reference: every fork's inherited turns are there), before and
    after the reopen; turns of a dropped parent that no fork lists any more are at most
    reclaimable, and the reopen deletes them."""
    stored = sorted(k for k, v in campaign.model.items() if v)
    before = await fsck_clean(directory, stored)
    campaign.counts["fsck reclaimable"] += before.reclaimable
    async with make_cache(directory, mode, fsync=False) as again:
        assert list((directory / "tmp").iterdir()) == []  # cleared at open
        found = problems(again)
        assert not found, "\n".join(found)
        for session in again.sessions():
            turns = campaign.model.get(session, [])
            meta = again.channel[session]
            assert meta.turns == len(turns), (session, meta.turns, len(turns))
        assert sorted(again.sessions()) == stored
        for fork, point in campaign.points.items():
            # a restart names the parent each fork was given, and its fork point
            if campaign.model[fork]:
                meta = again.channel[fork]
                assert (meta.parent, meta.parent_tokens) == point, (fork, point, meta)
        assert not await wrong_bytes(
            again, {k: v for k, v in campaign.model.items() if again.contains(k)}
        )
    assert (await fsck_clean(directory, stored)).reclaimable == 0


async def fsck_clean(directory: Path, stored: list[str]) -> FsckReport:
    """fsck of the closed directory: no damage, nothing unreadable or stray, and the
    conversations it would recover are the stored ones (a retired parent is listed as
    retired, kept for its forks)."""
    found = await anyio.to_thread.run_sync(check_directory, directory)
    assert found.damaged == []
    assert found.unreadable == []
    assert found.stray == 0
    names = {s.session for s in found.sessions} - set(found.retired)
    assert sorted(names) == stored, (sorted(names), stored)
    return found


def report(name: str, campaign: Campaign, injector: FaultInjector | None = None) -> None:
    counts = dict(campaign.counts)
    if injector is not None:
        counts["faults injected"] = injector.total_injected
    counts["unexpected exceptions"] = len(campaign.unexpected)
    print(f"\n{name}: {counts}")


@forests
@pytest.mark.parametrize("mode", ["exclusive", "inclusive"])
async def test_cancellation_storm_leaves_every_part_agreeing(
    ssd_dir: Path, mode: str, forest: bool
) -> None:
    """Native (task.cancel, asyncio.timeout, wait_for) and anyio cancellation at random
    moments of appends, loads, prefetches and drops on 8 sessions at once: nothing
    cancelled leaves a trace, nothing acknowledged is lost or served wrong."""
    async with make_cache(ssd_dir, mode, fsync=False) as cache:
        campaign = Campaign(cache, seed=SEED + 31 * len(mode), cancel=True, forest=forest)
        await campaign.run(sessions=8, ops=20 * SCALE)
        report(f"cancellation storm ({mode}{', forks' * forest})", campaign)
        assert not campaign.unexpected, "\n".join(campaign.unexpected[:10])
        assert campaign.counts["cancelled"] >= 20  # really cancelled, many times
        await settle_and_check(cache, campaign)
    await reopen_and_check(ssd_dir, mode, campaign)


@forests
@pytest.mark.parametrize("mode", ["exclusive", "inclusive"])
async def test_random_io_errors_lose_nothing_acknowledged(
    ssd_dir: Path, mode: str, forest: bool
) -> None:
    """EIO and ENOSPC at 3% of the SSD tier's os calls (and cancellations) while 8 sessions
    append, load, prefetch and drop: every failed operation left no trace, every
    acknowledged byte loads back, and the parts of the cache agree."""
    async with make_cache(ssd_dir, mode, fsync=True) as cache:
        campaign = Campaign(cache, seed=SEED + 7 + len(mode), cancel=True, forest=forest)
        with FaultInjector(seed=SEED + 11, rate=0.03, errnos=(errno.EIO, errno.ENOSPC)) as faults:
            await campaign.run(sessions=8, ops=20 * SCALE)
            faults.clear()
            report(f"random I/O errors ({mode}{', forks' * forest})", campaign, faults)
            assert faults.total_injected >= 5
            assert not campaign.unexpected, "\n".join(campaign.unexpected[:10])
            await settle_and_check(cache, campaign)
    await reopen_and_check(ssd_dir, mode, campaign)


class PinCampaign(Campaign):
    """The campaign with pins: 15% of the operations pin the session (a TTL of 10 ms
    to 1 s, or until released; in pin group ``g0``, ``g1`` or none) or release it. A
    subscriber to the cache's events counts every *violation*: a pinned session (its pin
    not yet expired at the event's time) demoted or evicted from its tier to make room for
    another, and, after every operation and at every such event, pinned bytes over
    ``max_pinned_bytes``, or a group's over ``max_pinned_bytes_per_group``.

    A pinned session moved down *by its own append* (the session with its new turn did
    not fit in its tier, the other residents being pinned or busy: in exclusive mode a
    session lives in one tier) is no eviction; it is counted apart ("moved by its own
    append"), and so is one pinned while its move down was already under way ("pinned
    while moving down": the move had started before the pin)."""

    def __init__(self, cache: TieredKVCache, seed: int, *, forest: bool) -> None:
        super().__init__(cache, seed, cancel=True, forest=forest)
        self.counts.update({"violations": 0, "pins": 0, "pins refused": 0, "releases": 0})
        self.peak = 0  # the most pinned bytes seen
        self.group_peak = 0  # the most pinned bytes of one group seen
        self.moving: set[str] = set()  # pinned while a move down was under way
        self.violations: list[str] = []
        cache.channel.subscribe(self.watch)

    def watch(self, event: Event) -> None:
        if isinstance(event, Demoted | Evicted):
            self.counts["moves"] += 1
            meta = self.cache.channel.get(event.session)
            own = self.doing.get(event.session) == "append" and isinstance(event, Demoted)
            late = event.session in self.moving
            self.moving.discard(event.session)
            if meta is not None and meta.pinned(event.time) and own:
                self.counts["moved by its own append"] += 1
            elif meta is not None and meta.pinned(event.time) and late:
                self.counts["pinned while moving down"] += 1
            elif meta is not None and meta.pinned(event.time):
                self.counts["violations"] += 1
                self.violations.append(f"pinned {event.session} moved: {event!r}")
            elif meta is not None and meta.pinned_until is not None:
                self.counts["moves after the pin ended"] += 1
            self.check_bound(event.time)

    def check_bound(self, now: float) -> None:
        """The bytes of the distinct segments pinned conversations list (a fork's shared
        turns count once, as the cache counts them), in all and per group."""
        channel, sessions = self.cache.channel, self.cache._core.sessions
        held: dict[str | None, set[Seg]] = {None: set()}
        for session, until in channel.pins.items():
            meta, s = channel.get(session), sessions.get(session)
            if until > now and meta is not None and s is not None:
                held[None].update(s.segs)
                if meta.pin_group is not None:
                    held.setdefault(meta.pin_group, set()).update(s.segs)
        nbytes = {group: sum(seg.length for seg in segs) for group, segs in held.items()}
        pinned = nbytes.pop(None)
        self.peak = max(self.peak, pinned)
        if pinned > self.cache.max_pinned_bytes:
            self.counts["violations"] += 1
            self.violations.append(f"{pinned} pinned bytes > {self.cache.max_pinned_bytes}")
        bound = self.cache.max_pinned_bytes_per_group
        for group, n in nbytes.items():
            self.group_peak = max(self.group_peak, n)
            if bound is not None and n > bound:
                self.counts["violations"] += 1
                self.violations.append(f"group {group}: {n} pinned bytes > {bound}")

    async def step(self, session: str, i: int) -> str:
        rng = self.rng
        if rng.random() < 0.15 and self.model[session] and self.cache.contains(session):
            self.counts["operations"] += 1
            if rng.random() < 0.25:
                self.cache.hint(session, RetentionHint(pin=False))
                self.counts["releases"] += 1
            else:
                ttl = rng.choice((0.01, 0.1, 0.5, 1.0, None))
                group = rng.choice(("g0", "g1", None))
                flight = self.cache.channel[session].in_flight
                try:
                    self.cache.hint(session, RetentionHint(pin=True, ttl=ttl, group=group))
                    self.counts["pins"] += 1
                    if flight is not None and flight.kind == "demote":
                        self.moving.add(session)
                except PinLimitError as exc:
                    self.counts["pins refused" if exc.group is None else "refused by a group"] += 1
        else:
            session = await super().step(session, i)
        self.check_bound(time.monotonic())
        return session


async def test_a_pin_given_while_victims_move_holds(ssd_dir: Path) -> None:
    """Room for a new conversation takes two victims, chosen in one call (LRU: x, then y);
    y is pinned while x is being moved (a subscriber to x's move pins y, as another task
    could during that await). The pin must hold: y stays in host memory."""
    tiers = [HostMemoryTier(12 * KIB), SSDTier(ssd_dir, 8 << 20, fsync=False)]
    async with TieredKVCache(tiers, eviction="lru", max_pinned_bytes=8 * KIB) as cache:
        for i, name in enumerate("xyz"):
            await cache.append(name, {"kv": torch.full((2, KIB), i, dtype=torch.uint8)},
                               answer_tokens=5)  # fmt: skip
        moved: list[str] = []

        def pin_y(event: Event) -> None:
            if isinstance(event, Demoted):
                moved.append(event.session)
                if event.session == "x":
                    cache.hint("y", RetentionHint(pin=True, ttl=60))

        cache.channel.subscribe(pin_y)
        await cache.append("w", {"kv": torch.full((6, KIB), 9, dtype=torch.uint8)},
                           answer_tokens=5)  # fmt: skip
        assert moved[0] == "x"
        assert cache.channel["y"].pinned(time.monotonic())
        assert cache.where("y") == "host", f"pinned y was moved: {moved}"


@forests
@pytest.mark.parametrize("mode", ["exclusive", "inclusive"])
async def test_pins_hold_under_cancellations_and_io_errors(
    ssd_dir: Path, mode: str, forest: bool
) -> None:
    """Pins given and released at random while 8 sessions append, load, prefetch and drop
    under cancellations and EIO/ENOSPC at 3% of the SSD tier's os calls: no pinned session
    leaves its tier before its TTL, pinned bytes never pass the bound, and nothing
    acknowledged is lost."""
    # (a group may hold a third of what all pins may: its bound binds before the other)
    async with make_cache(
        ssd_dir, mode, fsync=False, max_pinned_bytes_per_group=256 * KIB
    ) as cache:
        campaign = PinCampaign(cache, seed=SEED + 34 + len(mode), forest=forest)
        with FaultInjector(seed=SEED + 34, rate=0.03, errnos=(errno.EIO, errno.ENOSPC)) as faults:
            await campaign.run(sessions=8, ops=40 * SCALE)
            faults.clear()
            name = f"pins under faults ({mode}{', forks' * forest}, bound {cache.max_pinned_bytes})"
            report(name, campaign, faults)
            print(f"most pinned bytes: {campaign.peak}, of one group: {campaign.group_peak}")
            assert not campaign.unexpected, "\n".join(campaign.unexpected[:10])
            # pins were given and the bounds were met (which share is refused varies with
            # the run's timing and seed: 4-18 of about 30 given at scale 1 with forks, and
            # 1 of 28-34 at seeds 336 and 402, the global bound refusing 23-32; of those
            # refused, 1-14 by a group's bound)
            assert campaign.counts["pins"] >= 1
            given = ("pins", "pins refused", "refused by a group")
            assert sum(campaign.counts[k] for k in given) >= 10
            assert campaign.counts["moves"] >= 10  # the host tier really churned
            assert faults.total_injected >= 5
            await settle_and_check(cache, campaign)
    await reopen_and_check(ssd_dir, mode, campaign)
    assert campaign.violations == []


SITES = ("open", "pwrite", "fsync", "replace", "preadv", "unlink", "mkdir")
"""The os calls the SSD tier makes under this script (checked: each is called)."""


@pytest.mark.slow  # 1-3 s per call of the site, 7 sites: CI runs it
@forests
@pytest.mark.parametrize("site", SITES)
async def test_an_io_error_at_each_call_of_a_site(tmp_path: Path, site: str, forest: bool) -> None:
    """For one os call site, fail its 1st, 2nd, ... call in turn (one fresh cache each) under
    a fixed script of appends, moves, loads and drops; after each, the parts agree and every
    acknowledged byte is there, before and after a reopen."""
    calls = runs = operations = injected = 0
    for n in range(1, 1 + 5 * SCALE):
        directory = tmp_path / f"{site}-{n}"
        directory.mkdir()
        async with make_cache(directory, "exclusive", fsync=True) as cache:
            campaign = Campaign(cache, seed=n, cancel=False, forest=forest)
            with FaultInjector(seed=n) as faults:
                faults.fail_nth(site, n)
                await campaign.run(sessions=4, ops=10)
                calls = max(calls, faults.calls[site])
                injected += faults.total_injected
                faults.clear()
            runs += 1
            operations += campaign.counts["operations"]
            assert not campaign.unexpected, (n, campaign.unexpected[:5])
            await settle_and_check(cache, campaign)
        await reopen_and_check(directory, "exclusive", campaign)
        # the script makes fewer calls of this site than n (the tasks share one random
        # stream, so which operations run depends on how they interleave: under a loaded
        # machine a seed's run of the forest script once made no call of os.unlink at all,
        # and the next seed is tried rather than none)
        if calls and n > calls:
            break
    assert injected >= 1, f"the script never calls os.{site} (in {runs} runs)"
    print(f"\nos.{site}: {runs} runs, {operations} operations, {injected} faults injected")


@pytest.mark.slow  # 40 opens under seeded faults per mode: CI runs it
@pytest.mark.parametrize("mode", ["exclusive", "inclusive"])
async def test_seeded_io_errors_at_open_lose_nothing(tmp_path: Path, mode: str) -> None:
    """Issue 22, case 12: 40 opens of a cache holding 6 conversations, with 2% of the SSD
    tier's os calls failing (EIO) during each open; an open that fails is retried (faults
    still on). After each successful open (faults paused): nothing is in quarantine/ (no
    readable file was set aside), every acknowledged turn loads back exactly, then two
    conversations get one more turn and the cache closes. Before, 8-10 acknowledged turns
    were lost per 40 opens, quarantined and deleted as gaps."""
    directory = tmp_path / "ssd"
    rng = random.Random(22)
    model: Model = {f"s{i}": [] for i in range(6)}
    counts: Counter[str] = Counter({"lost turns": 0, "quarantined": 0, "wrong bytes": 0})

    async def extend(cache: TieredKVCache, sessions: list[str]) -> None:
        for session in sessions:
            g = torch.Generator().manual_seed(rng.randrange(1 << 30))
            new = {
                n: torch.randint(0, 256, (2, 8 * KIB), dtype=torch.uint8, generator=g) for n in "kv"
            }
            await cache.append(session, new, answer_tokens=1)
            model[session].append(new)
            counts["acknowledged turns"] += 1

    cache = make_cache(directory, mode, fsync=False)
    async with cache:
        for _ in range(3):
            await extend(cache, sorted(model))
    with FaultInjector(seed=2022, rate=0.02, errnos=(errno.EIO,)) as faults:
        for _ in range(40 * SCALE):
            cache = make_cache(directory, mode, fsync=False)
            for _attempt in range(50):
                try:
                    await cache.open()
                    break
                except TieredKVError:
                    counts["failed opens"] += 1
            else:
                raise AssertionError("the cache would not open in 50 tries")
            counts["opens"] += 1
            with faults.paused():
                counts["quarantined"] += len(list((directory / "quarantine").iterdir()))
                for session, turns in model.items():
                    try:
                        got = await cache.load(session)
                    except SessionNotFoundError:
                        counts["lost turns"] += len(turns)
                        continue
                    counts["lost turns"] += len(turns) - cache.channel[session].turns
                    for name in ("k", "v"):  # compared as bytes: torch.equal is slow here
                        want = b"".join(t[name].numpy().tobytes() for t in turns)
                        if got[name].numpy().tobytes() != want:
                            counts["wrong bytes"] += 1
                await extend(cache, rng.sample(sorted(model), 2))
                await cache.aclose()
        counts["faults injected"] = faults.total_injected
    print(f"\nseeded I/O errors at open ({mode}): {dict(counts)}")
    assert counts["faults injected"] > 40
    assert (counts["lost turns"], counts["quarantined"], counts["wrong bytes"]) == (0, 0, 0)
