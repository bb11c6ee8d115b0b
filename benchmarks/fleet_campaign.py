"""The fleet campaign: replicas in processes of their own share one redis-server while it is
killed and restarted (empty, or from its append-only file), stalled (SIGSTOP), and loses
manifests (as ``maxmemory`` evicts them); replicas are killed and come back, leases
expire, and several replicas write the same conversations at once. Afterwards a checker
compares every history a replica served with the log of what was acknowledged (issue 22's
invariants I1-I4), and ``tieredkv fsck`` checks what the server holds.

    .venv/bin/python benchmarks/fleet_campaign.py --duration 300 --seed 1 \
        --layout host+ssd+redis --secret --unkeyed-replica

prints the counts and exits 1 if the checker found anything. ``--layout`` is one of the
tier layouts the Redis how-to describes (:data:`LAYOUTS`: host + Redis, SSD + Redis,
host + SSD + Redis, host + Redis with a host tier smaller than one turn, and host + Redis
with SSD below Redis);
``--secret`` gives every replica the same ``secret=``, and ``--unkeyed-replica`` adds one
replica without it (misconfigured: it must be refused before it writes). The test command runs a
short, seeded one (``tests/integration/test_fleet_campaign.py``).

What is checked, per conversation (every turn names itself: :mod:`tests.fleet`):

* every history a load served is exactly one that an append acknowledged on some replica
  (the history it extended, plus its turn): never a splice, never a turn of another
  conversation, never a turn whose append failed (but see below), never a changed byte;
* no load serves a history older than one acknowledged to the fleet (a ``flush()`` that
  returned) before the load began, unless the server lost data in between (an empty
  restart, a lost manifest): those turns are counted as lost by the server, and anything
  else is counted as a lost acknowledged turn;
* every exception a replica saw is one the contract names (a miss, a transient
  ``TierIOError``, a refusal), no task exception was left unretrieved, and every replica
  closed its cache and ended cleanly when the campaign stopped it (``unclean-end``);
* every operation returned or raised within :data:`BOUND` seconds under
  ``anyio.fail_after`` (a watchdog thread records a call that cannot be cancelled, and
  ends the replica); the longest is reported;
* several ``flush()`` calls under way at once each hear of a turn refused that they
  waited for (else one returns as if it were committed: the loss check finds it);
* an append that failed never claims its turn is kept; one whose commit into Redis may
  have been made all the same (its reply lost, the server not reachable since:
  ``TierIOError.maybe_committed``) may be in a history, as an append under way may;
* no replica with the secret finds a history damaged (no fault forges one: a damaged
  history means a replica wrote what the others refuse), and the replica without the
  secret commits nothing.

Besides the conversations ``c0``, ``c1``, ... the replicas make *forks* ``f0``, ``f1``, ...
(``append(..., parent=...)``) of any conversation they hold, another replica's included,
at a token count inside one of its turns or at its end; forks of forks; and they drop
conversations (a parent while its forks live, too). A fork's history is its parent's
first tokens (the tags and token counts of those turns, logged when the fork is made)
then its own turns, checked like any other: a load of a fork serves exactly one that was
acknowledged, the inherited part byte for byte, or a miss. A drop is, for the loss check,
like a manifest the server lost: the conversation's earlier histories may be gone after it.

Replicas are local-first (inclusive mode): an append is acknowledged when it returns; a
``flush()`` that returns acknowledges it to the fleet. Half the appends whose history the
replica knows pass ``expected_tokens`` (its tokens): one stored must then have extended
exactly that many, and a refusal (``HistoryLengthError``) is a failed append like any other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the campaign reuses the tests' turns and server
    sys.path.insert(0, str(ROOT))

from tests.fleet import runs, turn  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

from tieredkv.backends.redis import conversation_tag  # noqa: E402

ALLOWED = {
    "SessionNotFoundError",  # a miss: the history could not be found or proven current
    "HistoryLostError",  # the history an append extends was lost since (told once)
    "HistoryLengthError",  # expected_tokens: the cache holds another history than the view
    "TierIOError",  # the server away or stalled: nothing happened, or the turn waits here
    "CommitDelayedError",
    "StaleWriterError",  # another replica took the conversation over
    "LeaseHeldError",
    "HistoryConflictError",  # the shared history is not the one this replica read
    "TurnRefusedError",  # turns acknowledged here were refused (reported once)
    "UnauthenticatedWriterError",  # (the replica without the secret) refused before it wrote
}
"""The exceptions a replica may see: each a TieredKVError saying what to do."""

FAULTS = {"stall": 3, "kill-aof": 2, "replica-kill": 2, "kill-empty": 1, "lose-manifest": 1}
"""Fault kinds and their weights."""

OPERATIONS = ("append", "load", "flush", "drop")
"""The operations the checker counts (those a caller sees complete or fail)."""

TOKENS = (16, 16, 16, 256, 256, 1024)
"""Turn sizes (tokens of 256 bytes): 4 KiB, 64 KiB (one value) and 256 KiB (four)."""

LAYOUTS = {
    "host+redis": {"host": 4 << 20},
    "ssd+redis": {"host": 0, "ssd": True},
    "host+ssd+redis": {"host": 4 << 20, "ssd": True},
    "full-host+redis": {"host": 128 << 10},
    "host+redis+ssd": {"host": 4 << 20, "ssd below": True},
}
"""A replica's tiers around the shared one: the Redis how-to's layouts, a host tier
smaller than the largest turn (conversations go straight to Redis, and load from it), and
an SSD tier below Redis (what the server loses of a replica's turns may still be there:
the replica serves them from it, and commits them again)."""

LATE_START = 60.0
"""Seconds past ``duration`` the faults go on, at least, while the replicas have not done
``min_operations`` or the replica without the secret has not started (on a loaded
machine a replica process takes many seconds to start)."""

BOUND = 30.0
"""Seconds any operation may take (the longest legitimate wait is a takeover's, under
``lease_ttl``, plus the server's ``timeout`` per try)."""


@dataclass
class Options:
    duration: float = 300.0
    seed: int = 1
    replicas: int = 3
    conversations: int = 8
    forks: int = 4
    """Fork keys (``f0``, ...); 0: no forks, no drops."""
    lease_ttl: float = 1.0
    timeout: float = 0.5
    host: int = 4 << 20
    fault_every: tuple[float, float] = (0.8, 2.5)
    layout: str = "host+redis"
    secret: bool = False
    unkeyed_replica: bool = False
    """One more replica, without the secret (with ``secret``)."""
    min_operations: int = 0
    """Keep the faults going past ``duration`` (up to three times it, and at least
    :data:`LATE_START` seconds more) until the replicas have completed this many
    operations: a loaded machine still gets a campaign of size."""


@dataclass
class Result:
    """The campaign's counts."""

    operations: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """Loads that served a history older than one acknowledged to the fleet."""
    lost_turns: set[tuple[str, int]] = field(default_factory=set)
    lost_to_server: set[tuple[str, int]] = field(default_factory=set)
    unexpected: Counter[str] = field(default_factory=Counter)
    tracebacks: list[str] = field(default_factory=list)
    """The first lines where unexpected exceptions came from (traceback, message)."""
    errors: Counter[str] = field(default_factory=Counter)
    longest: float = 0.0
    """The longest operation, seconds."""
    concurrent_flushes: int = 0
    unkeyed_refused: int = 0
    """Times the replica without the secret was refused (at open, or a commit)."""
    lease_expiries: int = 0
    forks: int = 0
    """Forks made (acknowledged), and loads that served a fork."""
    fork_loads: int = 0
    drops: int = 0
    refused: int = 0
    unproven: int = 0
    expecting: set[int] = field(default_factory=set)
    """Tags of the appends that passed ``expected_tokens``."""
    expecting_stored: int = 0
    fsck: str = ""
    story: list[str] = field(default_factory=list)
    """What the logs say of the first wrong history's turns (each append of them, begun and
    ended, and the faults meanwhile): a failure in CI, whose logs are gone, can be read."""

    @property
    def clean(self) -> bool:
        return not (self.wrong or self.lost or self.unexpected)

    def lines(self) -> list[str]:
        ops = ", ".join(f"{k} {v:,}" for k, v in sorted(self.operations.items()))
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        errors = ", ".join(f"{k} {v:,}" for k, v in sorted(self.errors.items())) or "none"
        return [
            f"operations: {sum(self.operations.values()):,} ({ops})",
            f"faults: {sum(self.faults.values())} ({faults}); lease expiries: "
            f"{self.lease_expiries}",
            f"forks made: {self.forks}; loads of a fork served: {self.fork_loads}; drops: "
            f"{self.drops}; appends with expected_tokens: {len(self.expecting):,} "
            f"({self.expecting_stored:,} stored)",
            f"errors callers saw: {errors}; refused turns reported: {self.refused}; "
            f"unproven misses: {self.unproven}",
            f"wrong histories: {len(self.wrong)}",
            f"lost acknowledged turns: {len(self.lost_turns)} (beyond the "
            f"{len(self.lost_to_server)} the server itself lost in empty restarts and lost "
            f"manifests)",
            f"longest operation: {self.longest:.2f} s (bound {BOUND:.0f} s); concurrent "
            f"flushes: {self.concurrent_flushes}; the replica without the secret refused: "
            f"{self.unkeyed_refused}",
            f"unexpected exception types: {sum(self.unexpected.values())}"
            + (f" ({dict(self.unexpected)})" if self.unexpected else ""),
            *([f"fsck of the prefix afterwards: {self.fsck}"] if self.fsck else []),
            *(f"  wrong: {w}" for w in self.wrong[:10]),
            *(f"    {line}" for line in self.story),
            *(f"  older: {w}" for w in self.lost[:10]),
            *(f"  unexpected: {t}" for t in self.tracebacks[:3]),
        ]


# -- a replica ------------------------------------------------------------------------------


class _Log:
    def __init__(self, path: Path, rid: int, inc: int) -> None:
        self._file = path.open("a", buffering=1)
        self._base = {"r": rid, "i": inc}

    def __call__(self, **record: Any) -> None:
        self._file.write(json.dumps({**self._base, **record}) + "\n")

    def close(self) -> None:
        self._file.close()


def _tiers(args: dict[str, Any]) -> list[Any]:
    """A replica's tiers: its layout's own tiers over the shared RedisTier."""
    from tieredkv import HostMemoryTier, SSDTier
    from tieredkv.backends.redis import RedisTier

    spec = LAYOUTS[args["layout"]]
    key = bytes.fromhex(args["secret"]) if args.get("secret") else None
    tiers: list[Any] = []
    if spec["host"]:
        tiers.append(HostMemoryTier(spec["host"]))
    if spec.get("ssd"):
        tiers.append(SSDTier(args["ssd"], 64 << 20, fsync=False, secret=key))
    shared = RedisTier(
        args["url"],
        1 << 40,
        prefix=args["prefix"],
        value_size=64 << 10,
        lease_ttl=args["lease_ttl"],
        timeout=args["timeout"],
        recover=False,
        secret=key,
    )
    if spec.get("ssd below"):
        return [*tiers, shared, SSDTier(args["ssd"], 64 << 20, fsync=False, secret=key)]
    return [*tiers, shared]


class _Watchdog:
    """Ends the process if an operation runs past :data:`BOUND` plus a grace (a call that
    ``anyio.fail_after`` could not cancel), logging it first."""

    def __init__(self, log: _Log) -> None:
        import threading

        self._log = log
        self._lock = threading.Lock()
        self._ops: dict[int, tuple[str, float]] = {}
        self._next = 0
        threading.Thread(target=self._watch, daemon=True).start()

    def begin(self, op: str) -> int:
        with self._lock:
            self._next += 1
            self._ops[self._next] = (op, time.monotonic())
            return self._next

    def end(self, ticket: int) -> None:
        with self._lock:
            self._ops.pop(ticket, None)

    def _watch(self) -> None:
        import os

        while True:
            time.sleep(1.0)
            now = time.monotonic()
            with self._lock:
                hung = [(op, now - t0) for op, t0 in self._ops.values() if now - t0 > BOUND + 15]
            if hung:
                self._log(op="hang", what=hung[0][0], seconds=hung[0][1])
                os._exit(3)


def _shared(tiers: Sequence[Any]) -> Any:
    """The shared (Redis) tier among a replica's tiers (the last, or above an SSD tier)."""
    from tieredkv.backends.redis import RedisTier

    return next(t for t in tiers if isinstance(t, RedisTier))


def _state(cache: Any) -> dict[str, Any]:
    """What the cache and its shared tier hold, for the log of an unexpected exception."""
    from tieredkv.payload import RETIRED_SEQ

    core = cache._core
    shared = _shared(core.tiers)
    return {
        "sessions": {
            k: {
                "primary": s.primary,
                "busy": core.busy.get(k, 0),
                "base": s.base,
                "segs": [[*g.key, sorted(g.tiers), sorted(u.key for u in g.users)] for g in s.segs],
            }
            for k, s in core.sessions.items()
        },
        "retired": {k: [list(g.key) for g in r.segs] for k, r in core.retired.items()},
        "markers listed": {k: sorted(r.markers) for k, r in core.retired.items()},
        "markers stored": {  # (the retirement markers each local tier holds)
            tier.name: sorted(
                k
                for k in {*core.sessions, *core.retired}
                if tier.persistent and tier.contains((k, RETIRED_SEQ))
            )
            for tier in core.tiers
            if tier is not shared
        },
        "reserved": [list(k) for k in shared._reserved],
        "committed": [list(k) for k in shared._committed],
        "holders": {f"{k[0]}:{k[1]}": sorted(v) for k, v in shared._holders.items()},
    }


async def replica(args: dict[str, Any]) -> None:
    """One replica: random appends, loads, flushes (sometimes several at once) and idle
    spells, every one logged and bounded."""
    import asyncio

    from tieredkv import TieredKVCache
    from tieredkv.errors import SessionNotFoundError, TurnRefusedError

    rid, inc = args["rid"], args["inc"]
    rng = random.Random(args["seed"] * 1000003 + rid * 101 + inc)
    log = _Log(Path(args["log"]), rid, inc)
    stop = asyncio.Event()  # SIGTERM: finish the operation under way, close, exit
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.set_exception_handler(lambda _loop, ctx: log(op="unretrieved", msg=str(ctx)[:300]))
    watchdog = _Watchdog(log)
    forks = [f"f{i}" for i in range(args.get("forks", 0))]
    convs = [f"c{i}" for i in range(args["conversations"])] + forks
    views: dict[str, list[int] | None] = {c: [] for c in convs}  # what this cache holds
    shapes: dict[str, list[tuple[int, int]]] = {}
    """Per conversation, the (tag, tokens) of the turns of its view, where known."""
    since: dict[str, float] = dict.fromkeys(convs, time.monotonic())
    """When the view's history was last read from the server (or, from none, begun)."""
    counter = 0
    while not stop.is_set():
        cache = TieredKVCache(_tiers(args), mode="inclusive")
        try:
            await cache.open()
            break
        except Exception as exc:  # the server is down (or refuses this replica): try again
            log(op="open", ok=False, err=type(exc).__name__, msg=str(exc)[:200])
            await anyio.sleep(0.2)
    else:
        return
    log(op="open", ok=True, t0=time.monotonic())

    def failed(exc: Exception, **record: Any) -> None:
        if getattr(exc, "maybe_committed", False):  # (a commit whose reply was lost)
            record["maybe"] = True
        record.update(t1=time.monotonic(), ok=False, err=type(exc).__name__, msg=str(exc)[:200])
        if record["err"] not in ALLOWED and not _allowed_for_forks(record):
            # an unexpected exception: the report shows where it came from
            record["tb"] = "".join(traceback.format_exception(exc))[-3000:]
            record["state"] = _state(cache)
        log(**record)

    async def flush(t0: float, together: int) -> None:
        covers = {c: [since[c], v] for c, v in views.items() if v}
        ticket = watchdog.begin("flush")
        try:
            with anyio.fail_after(BOUND):
                await cache.flush()
        except TurnRefusedError as exc:
            failed(exc, op="flush", t0=t0, refused=[s for s, _ in exc.refusals], n=together)
            for session, _ in exc.refusals:
                views[session] = None
        except Exception as exc:
            failed(exc, op="flush", t0=t0, n=together)
        else:
            log(op="flush", t0=t0, t1=time.monotonic(), ok=True, covers=covers, n=together)
        finally:
            watchdog.end(ticket)

    async def fork(t0: float, key: str | None = None) -> None:
        """A fork ``key`` (default: an ``f<i>`` this replica holds nothing of) of a
        conversation it holds, at a point inside one of its turns or at its end."""
        nonlocal counter
        free = [f for f in forks if views[f] == []] if key is None else [key]
        parents = [c for c in convs if views[c] and [t for t, _ in shapes.get(c, ())] == views[c]]
        if not free or not parents:
            return
        conv, parent = rng.choice(free), rng.choice(parents)
        shape = shapes[parent]
        k = rng.randrange(len(shape))
        inherited = [*shape[:k], (shape[k][0], rng.randint(1, shape[k][1]))]
        counter += 1
        tag = (rid * 1000 + inc) * 100000 + counter
        tokens = rng.choice(TOKENS)
        at = sum(n for _, n in inherited)
        log(
            op="append",
            ph="begin",
            t0=t0,
            conv=conv,
            tag=tag,
            tokens=tokens,
            base=[t for t, _ in inherited],
            fork=parent,
            inherited=inherited,
        )
        views[parent] = None  # (the fork reads the parent's current history: load it again)
        ticket = watchdog.begin("fork")
        try:
            with anyio.fail_after(BOUND):
                await cache.append(
                    conv, turn(tag, tokens), answer_tokens=1, parent=parent, parent_tokens=at
                )
        except Exception as exc:
            failed(exc, op="append", ph="end", t0=t0, conv=conv, tag=tag, fork=parent)
            views[conv] = None
        else:
            log(op="append", ph="end", t0=t0, t1=time.monotonic(), conv=conv, tag=tag, ok=True)
            views[conv], since[conv] = [*(t for t, _ in inherited), tag], t0
            shapes[conv] = [*inherited, (tag, tokens)]
        finally:
            watchdog.end(ticket)
        if views[conv] is None:
            return
        # the cache forked the parent's current history: another replica may have dropped
        # it and begun another under its key since this one read it. What the fork holds
        # here (its own copy: no server needed) says which history it started from
        ticket = watchdog.begin("load")
        try:
            with anyio.fail_after(BOUND):
                got = runs(await cache.load(conv))
        except Exception:  # (not counted: the fork op's own check)
            views[conv] = None  # (what the cache holds of it now is not known)
            return
        finally:
            watchdog.end(ticket)
        now = time.monotonic()
        log(op="fork-checked", t0=now, tag=tag)  # (a fork not checked: _unchecked_forks)
        took = rebased(got, (tag, tokens), inherited)
        if took is not None:
            log(op="rebase", t0=now, conv=conv, tag=tag, fork=parent, inherited=took)
        # (another replica's history of the key may have replaced the fork meanwhile: its
        # turn is then refused, and reported by a later call)
        views[conv], shapes[conv] = [t for t, _ in got], got

    try:
        while not stop.is_set():
            conv = rng.choice(convs)
            view = views[conv]
            r = rng.random()
            t0 = time.monotonic()
            if view is None or r < 0.35:
                before = cache.stats().unproven
                ticket = watchdog.begin("load")
                try:
                    with anyio.fail_after(BOUND):
                        history = await cache.load(conv)
                except SessionNotFoundError as exc:
                    unproven = cache.stats().unproven > before
                    failed(exc, op="load", t0=t0, conv=conv, unproven=unproven)
                    views[conv] = None if unproven else []
                    since[conv] = t0
                except Exception as exc:
                    failed(exc, op="load", t0=t0, conv=conv)
                    views[conv] = None
                else:
                    got = runs(history)
                    log(op="load", t0=t0, t1=time.monotonic(), conv=conv, ok=True, turns=got)
                    views[conv], since[conv] = [tag for tag, _ in got], t0
                    shapes[conv] = got
                finally:
                    watchdog.end(ticket)
            elif forks and (r < 0.41 or (r < 0.85 and conv in forks and not view)):
                await fork(t0, None if r < 0.41 else conv)  # (a fork key begins as a fork)
            elif forks and r < 0.43:
                ticket = watchdog.begin("drop")
                try:
                    with anyio.fail_after(BOUND):
                        await cache.drop(conv)
                except Exception as exc:
                    failed(exc, op="drop", t0=t0, conv=conv)
                    views[conv] = None
                else:
                    log(op="drop", t0=t0, t1=time.monotonic(), conv=conv, ok=True)
                    views[conv], since[conv] = [], t0
                finally:
                    watchdog.end(ticket)
            elif r < 0.85:
                counter += 1
                tag = (rid * 1000 + inc) * 100000 + counter
                tokens = rng.choice(TOKENS)
                # half the appends say how long the history they extend is, where this
                # replica knows it (its view's tokens): the cache must then refuse a turn
                # after any other history (HistoryLengthError), not only a lost one
                shape = shapes.get(conv) if view else []
                expected: int | None = None
                if shape is not None and [t for t, _ in shape] == view and rng.random() < 0.5:
                    expected = sum(n for _, n in shape)
                log(
                    op="append",
                    ph="begin",
                    t0=t0,
                    conv=conv,
                    tag=tag,
                    tokens=tokens,
                    base=view,
                    expected=expected,
                )
                ticket = watchdog.begin("append")
                try:
                    with anyio.fail_after(BOUND):
                        stored = await cache.append(
                            conv, turn(tag, tokens), answer_tokens=1, expected_tokens=expected
                        )
                except Exception as exc:
                    failed(exc, op="append", ph="end", t0=t0, conv=conv, tag=tag)
                    views[conv] = None
                else:
                    t1 = time.monotonic()
                    log(op="append", ph="end", t0=t0, t1=t1, conv=conv, tag=tag, ok=True)
                    if shapes.get(conv) is not None and [t for t, _ in shapes[conv]] == view:
                        shapes[conv] = [*shapes[conv], (tag, tokens)]
                    meta = cache.channel.get(conv)
                    if meta is None or meta.turns != len(view) + 1:
                        log(op="inconsistent", conv=conv, base=view, turns=meta and meta.turns)
                    elif expected is not None and stored.tokens != expected + tokens:
                        log(op="inconsistent", conv=conv, base=view, tokens=stored.tokens)
                    views[conv] = [*view, tag]
                    if not view:
                        since[conv] = t0
                finally:
                    watchdog.end(ticket)
            elif r < 0.95:
                together = 1 if rng.random() < 0.6 else rng.choice((2, 3))
                async with anyio.create_task_group() as tg:
                    for _ in range(together):
                        tg.start_soon(flush, t0, together)
            else:  # idle: long enough, sometimes, for the lease to run out
                await anyio.sleep(rng.uniform(0, 2 * args["lease_ttl"]))
                log(op="idle", t0=t0, t1=time.monotonic())
            await anyio.sleep(rng.uniform(0, 0.01))
    finally:
        st = cache.stats()
        shared = _shared(cache.tiers)
        damaged = st.tiers[cache.tiers.index(shared)].corrupt - shared.missing
        log(op="stats", refused=st.refused, unproven=st.unproven, errors=st.errors, damaged=damaged)
        with anyio.CancelScope(shield=True):
            await cache.aclose()
        log.close()


# -- the campaign ---------------------------------------------------------------------------


async def campaign(opts: Options, workdir: Path) -> Result:
    """Run the campaign in ``workdir`` (a fresh directory); return its counts."""
    rng = random.Random(opts.seed)
    server = RedisServer(workdir, persistent=True)
    await anyio.to_thread.run_sync(server.start)
    prefix = f"fleet{opts.seed}"
    faults: list[dict[str, Any]] = []
    procs: dict[int, anyio.abc.Process] = {}
    incarnations: Counter[int] = Counter()

    secret = bytes(range(32)).hex() if opts.secret else None
    unkeyed = opts.replicas if opts.secret and opts.unkeyed_replica else None
    """The replica without the secret (its rid), if any."""

    async def spawn(rid: int) -> None:
        incarnations[rid] += 1
        ssd = workdir / f"ssd-{rid}-{incarnations[rid]}"
        ssd.mkdir()
        args = {
            "layout": opts.layout,
            "ssd": str(ssd),
            "secret": None if rid == unkeyed else secret,
            "rid": rid,
            "inc": incarnations[rid],
            "seed": opts.seed,
            "url": server.url,
            "prefix": prefix,
            "log": str(workdir / f"replica-{rid}.jsonl"),
            "conversations": opts.conversations,
            "forks": opts.forks,
            "lease_ttl": opts.lease_ttl,
            "timeout": opts.timeout,
            "host": opts.host,
        }
        err = (workdir / f"replica-{rid}.stderr").open("ab")
        procs[rid] = await anyio.open_process(
            [sys.executable, __file__, "--replica", json.dumps(args)],
            stdin=None,
            stdout=err,
            stderr=err,
            cwd=ROOT,
        )
        err.close()

    try:
        for rid in range(opts.replicas):
            await spawn(rid)
        if unkeyed is not None:  # it joins a fleet whose replicas marked the prefix
            for _ in range(600):  # (up to 2 minutes)
                if await anyio.to_thread.run_sync(_marked, server, prefix):
                    break
                await anyio.sleep(0.2)
            await spawn(unkeyed)
        extra = [k for k, w in FAULTS.items() for _ in range(w - 1)]
        deadline = time.monotonic() + opts.duration
        cycle: list[str] = []
        while True:
            await anyio.sleep(rng.uniform(*opts.fault_every))
            now = time.monotonic()
            if now >= deadline and (
                now >= deadline + max(2 * opts.duration, LATE_START)
                or (
                    _completed(workdir, opts.replicas) >= opts.min_operations
                    and (unkeyed is None or _read(workdir / f"replica-{unkeyed}.jsonl"))
                )
            ):
                break
            if not cycle:  # every kind once (in a random order), then the weighted rest
                cycle = rng.sample(extra, len(extra)) + rng.sample(list(FAULTS), len(FAULTS))
            kind = cycle.pop()
            record = {"kind": kind, "t0": time.monotonic()}
            if kind == "stall":
                server.pause()
                await anyio.sleep(rng.uniform(0.2, 1.5))
                server.resume()
            elif kind in ("kill-aof", "kill-empty"):
                await anyio.to_thread.run_sync(server.kill)
                record["loss"] = kind == "kill-empty"
                await anyio.sleep(rng.uniform(0.1, 1.0))
                await anyio.to_thread.run_sync(
                    lambda: server.restart(empty=kind == "kill-empty")  # noqa: B023
                )
            elif kind == "lose-manifest":
                keys = [f"c{i}" for i in range(opts.conversations)]
                conv = rng.choice(keys + [f"f{i}" for i in range(opts.forks)])
                with server.client() as client:
                    client.delete(f"{prefix}:{{{conversation_tag(conv)}}}:m")
                record["conv"] = conv
            else:  # replica-kill
                rid = rng.randrange(len(procs))
                with contextlib.suppress(ProcessLookupError):  # (ended by itself)
                    procs[rid].send_signal(signal.SIGKILL)
                await procs[rid].wait()
                await anyio.sleep(rng.uniform(0.2, 1.0))
                await spawn(rid)
            record["t1"] = time.monotonic()
            faults.append(record)
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):  # (one that ended by itself:
                proc.terminate()  # its status is reported below)
        ends: list[dict[str, Any]] = []
        for rid, proc in procs.items():
            with anyio.move_on_after(120):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            # an exception as it closed (see its .stderr), or a close past 120 s; a replica
            # still starting (no handler for SIGTERM yet: nothing to close) ends by it
            if proc.returncode not in (0, -signal.SIGTERM):
                ends.append({"r": rid, "op": "unclean-end", "status": proc.returncode})
        (workdir / "ends.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ends))
        final = await _final_loads(server.url, prefix, opts, secret, workdir)
        fsck = await anyio.to_thread.run_sync(_fsck, server.url, prefix, secret)
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.kill()
        if server.proc is not None:
            server.resume()
        await anyio.to_thread.run_sync(server.stop)
    (workdir / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in faults))
    (workdir / "final.jsonl").write_text("".join(json.dumps(r) + "\n" for r in final))
    result = check_directory(workdir, opts)
    result.fsck = fsck
    return result


def check_directory(workdir: Path, opts: Options) -> Result:
    """Run :func:`check` on the logs a campaign left in ``workdir`` (``--check DIR``)."""
    records = [r for path in sorted(workdir.glob("*.jsonl")) for r in _read(path)]
    faults = [r for r in records if "kind" in r]
    return check([r for r in records if "kind" not in r], faults, opts)


async def _final_loads(
    url: str, prefix: str, opts: Options, secret: str | None, workdir: Path
) -> list[dict[str, Any]]:
    """With the faults over: two fresh replicas load every conversation once, one with
    room for it, one with a host tier smaller than a turn (it loads straight from Redis),
    each call under a bound, in a process of their own (a load that cannot be cancelled
    is recorded as a hang, and the process ended)."""
    args = {"url": url, "prefix": prefix, "conversations": opts.conversations}
    args["forks"] = opts.forks
    args |= {"secret": secret, "out": str(workdir / "final-loads.json")}
    proc = await anyio.open_process(
        [sys.executable, __file__, "--final", json.dumps(args)], stdin=None, cwd=ROOT
    )
    with anyio.move_on_after(2 * opts.conversations * BOUND + 60):
        await proc.wait()
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    if proc.returncode != 0:  # (its watchdog ended it: a load that cannot be cancelled)
        return [{"r": "final", "op": "hang", "what": "final load"}]
    path = anyio.Path(workdir / "final-loads.json")
    records: list[dict[str, Any]] = (
        json.loads(await path.read_text()) if await path.exists() else []
    )
    return records


async def final_loads(args: dict[str, Any]) -> None:
    """The final loads (``--final``), written to ``args["out"]``; the process ends (status
    3) if one runs past :data:`BOUND` plus a grace."""
    watchdog = _Watchdog(_Log(Path(args["out"] + ".log"), -1, 0))
    keys = [f"c{i}" for i in range(args["conversations"])]
    keys += [f"f{i}" for i in range(args.get("forks", 0))]
    out = await _loads(args["url"], args["prefix"], keys, args["secret"], watchdog)
    await anyio.Path(args["out"]).write_text(json.dumps(out))


async def _loads(
    url: str, prefix: str, keys: list[str], secret: str | None, watchdog: _Watchdog
) -> list[dict[str, Any]]:
    from tieredkv import HostMemoryTier, TieredKVCache
    from tieredkv.backends.redis import RedisTier
    from tieredkv.errors import SessionNotFoundError

    key = bytes.fromhex(secret) if secret else None
    out = []
    for host in (256 << 20, 64 << 10):
        shared = RedisTier(
            url, 1 << 40, prefix=prefix, value_size=64 << 10, recover=False, secret=key
        )
        async with TieredKVCache([HostMemoryTier(host), shared], mode="inclusive") as cache:
            for conv in keys:
                t0 = time.monotonic()
                record: dict[str, Any] = {"r": "final", "op": "load", "conv": conv, "t0": t0}
                ticket = watchdog.begin("final load")
                try:
                    with anyio.fail_after(BOUND):
                        turns = runs(await cache.load(conv))
                except SessionNotFoundError:
                    record.update(ok=False, err="SessionNotFoundError", t1=time.monotonic())
                except Exception as exc:
                    record.update(ok=False, err=type(exc).__name__, t1=time.monotonic())
                else:
                    record.update(ok=True, turns=turns, t1=time.monotonic())
                finally:
                    watchdog.end(ticket)
                out.append(record)
    return out


def _fsck(url: str, prefix: str, secret: str | None) -> str:
    from tieredkv.fsck_redis import check_prefix

    report = check_prefix(url, prefix, secret=bytes.fromhex(secret) if secret else None)
    return (
        f"{report.segments} good segment(s) in {len(report.sessions)} conversation(s), "
        f"{len(report.damaged)} damaged, {report.pending} pending and {report.leaked} leaked "
        f"value(s) (leaked: those of manifests the campaign deleted), {report.reclaimable} "
        f"reclaimable segment(s) (kept for a fork whose manifest the campaign deleted)"
        + "".join(f"; damaged {d.path}: {d.problem}" for d in report.damaged[:3])
    )


def _marked(server: RedisServer, prefix: str) -> bool:
    """Whether a replica with the secret has marked the prefix authenticated."""
    with server.client() as client:
        return bool(client.exists(f"{prefix}:auth"))


def _completed(workdir: Path, replicas: int) -> int:
    """Operations the replicas have completed so far (their logs, read while they write)."""
    records = [r for rid in range(replicas) for r in _read(workdir / f"replica-{rid}.jsonl")]
    return sum(1 for r in records if _is_operation(r))


def _is_operation(record: dict[str, Any]) -> bool:
    """Whether a log record is an operation a caller saw complete or fail (not its start)."""
    return record.get("op") in OPERATIONS and record.get("ph") != "begin"


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a replica killed mid-write
            continue
    return out


# -- the checker ----------------------------------------------------------------------------


def check(records: list[dict[str, Any]], faults: list[dict[str, Any]], opts: Options) -> Result:
    """Compare every served history with the acknowledged ones (see the module docstring)."""
    result = Result()
    result.faults = Counter(f["kind"] for f in faults)
    tags: dict[int, tuple[str, int]] = {}
    failed: set[int] = set()
    possible: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    acked: dict[str, list[tuple[float, float, tuple[int, ...]]]] = defaultdict(list)
    """Per conversation: (when a flush returned, since when the history it acknowledged
    was on the server at the latest, that history)."""
    # when the server lost data (some moment between a fault's start and end), per
    # conversation (None: every conversation)
    losses: dict[str | None, list[tuple[float, float]]] = defaultdict(list)
    inherited: dict[str, set[tuple[int, int]]] = defaultdict(set)
    """Per fork key, the (tag, tokens) of its forks' inherited turns (the last maybe cut)."""
    for f in faults:
        if f.get("loss"):
            losses[None].append((f["t0"], f["t1"]))
        if f["kind"] == "lose-manifest":
            losses[f["conv"]].append((f["t0"], f["t1"]))
    unkeyed = opts.replicas if opts.secret and opts.unkeyed_replica else None

    def writer(tag: int) -> int:
        return tag // 100000 // 1000

    for r in records:
        op = r.get("op")
        if r.get("r") == unkeyed and unkeyed is not None:
            if (op == "open" and r.get("err") == "InvalidArgumentError") or (
                not r.get("ok", True) and "no secret" in r.get("msg", "")
            ):
                result.unkeyed_refused += 1
            if op == "flush" and r["ok"]:
                own = [t for _, v in r["covers"].values() for t in v if writer(t) == unkeyed]
                if own:
                    result.unexpected["unauthenticated-commit"] += 1
        if op == "flush" and r.get("n", 1) > 1:
            result.concurrent_flushes += 1
        if "t1" in r and "t0" in r and _is_operation(r):
            result.longest = max(result.longest, r["t1"] - r["t0"])
        if op == "hang":
            result.unexpected[f"hang in {r['what']}"] += 1
        elif op == "append" and not r.get("ok", True) and "is kept" in r.get("msg", ""):
            result.unexpected["failed append said kept"] += 1
        elif op == "stats" and r.get("damaged", 0) > 0 and r.get("r") != unkeyed:
            result.unexpected["damaged history"] += r["damaged"]
        if op == "append" and r["ph"] == "begin" and r.get("expected") is not None:
            result.expecting.add(r["tag"])
        elif op == "append" and r["ph"] == "end" and r["ok"] and r["tag"] in result.expecting:
            result.expecting_stored += 1
        if op == "append" and r["ph"] == "begin":
            tags[r["tag"]] = (r["conv"], r["tokens"])
            if r["base"] is not None:
                possible[r["conv"]].add((*r["base"], r["tag"]))
            if "fork" in r:
                inherited[r["conv"]].update((t, n) for t, n in r["inherited"])
        elif op == "rebase":  # (the fork started from the parent's newer history)
            possible[r["conv"]].add((*(t for t, _ in r["inherited"]), r["tag"]))
            inherited[r["conv"]].update((t, n) for t, n in r["inherited"])
        elif op == "drop" and r["ok"]:
            losses[r["conv"]].append((r["t0"], r["t1"]))
            result.drops += 1
        elif op == "append" and not r["ok"] and not r.get("maybe"):
            failed.add(r["tag"])  # (one that may have been committed may be in a history)
        elif op == "flush" and r["ok"]:
            for conv, (began, view) in r["covers"].items():
                acked[conv].append((r["t1"], began, tuple(view)))
        elif op == "idle" and r["t1"] - r["t0"] > opts.lease_ttl:
            result.lease_expiries += 1
        elif op == "stats":
            result.refused += r["refused"]
            result.unproven += r["unproven"]
        elif op in ("unretrieved", "inconsistent", "unclean-end"):
            result.unexpected[op] += 1
        if _is_operation(r):
            result.operations[r["op"]] += 1
            if not r.get("ok", True):
                result.errors[r["err"]] += 1
                if r["err"] not in ALLOWED and not _allowed_for_forks(r):
                    result.unexpected[r["err"]] += 1
                    result.tracebacks.append(
                        f"replica {r.get('r')} {op} {r.get('conv', '')}: {r.get('msg', '')}\n"
                        + r.get("tb", "(no traceback)")
                    )
    sizes = {r["tag"]: r["tokens"] for r in records if r.get("op") == "append" and "tokens" in r}
    _unchecked_forks(records, sizes, possible, inherited)
    for conv in possible:  # a failed append left no trace: no history holds its turn
        possible[conv] = {h for h in possible[conv] if h[-1] not in failed}
    _check_forks(records, sizes, possible, failed, inherited, result)

    def lost_between(conv: str, start: float, end: float) -> bool:
        return any(t1 > start and t0 < end for t0, t1 in (*losses[None], *losses[conv]))

    for r in records:
        if r.get("op") != "load" or not r["ok"]:
            continue
        conv, served = r["conv"], tuple(tag for tag, _ in r["turns"])
        where = f"replica {r['r']} at {r['t0']:.3f} loaded {conv} = {list(served)}"
        wrong = [
            (tag, n)
            for tag, n in r["turns"]
            if tags.get(tag) != (conv, n) and (tag, n) not in inherited[conv]
        ]
        if any(tags.get(tag, ("",))[0] != conv for tag, _ in r["turns"]):
            result.fork_loads += 1
        if wrong:
            result.wrong.append(f"{where}: turns of another conversation or size {wrong}")
        elif served not in possible[conv]:
            result.wrong.append(f"{where}: not a history any append acknowledged")
        if result.wrong and not result.story:
            result.story = _story(records, faults, set(served), r)
        before = [a for a in acked[conv] if a[0] < r["t0"]]
        if before:
            t, began, floor = max(before)
            # (a loss since that history was read from the server may have taken it)
            if not lost_between(conv, began, r["t1"]) and served[: len(floor)] != floor:
                result.lost.append(f"{where}: older than {list(floor)}, acknowledged at {t:.3f}")
                result.lost_turns.update((conv, tag) for tag in floor if tag not in served)
    for f in faults:  # the acknowledged turns the server itself lost
        hit: list[str] = list(acked) if f.get("loss") else [f["conv"]] if "conv" in f else []
        for conv in hit:
            before = [a for a in acked.get(conv, []) if a[1] < f["t1"]]
            if before:
                result.lost_to_server.update((conv, tag) for tag in max(before)[2])
    return result


def rebased(
    got: list[tuple[int, int]], own: tuple[int, int], inherited: list[tuple[int, int]]
) -> list[tuple[int, int]] | None:
    """What a fork whose turn is ``own`` inherited, by the history its check loaded
    (``got``), if not ``inherited`` (the replica's view of its parent): the cache forked
    the parent's current history. Found wherever the fork's turn is in ``got``: another
    replica may have taken the fork over and appended after it before the check."""
    if own not in got:
        return None  # (another history of the key replaced the fork: its turn is refused)
    took = got[: got.index(own)]
    return None if took == [tuple(x) for x in inherited] else took


def _story(
    records: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    tags: set[int],
    load: dict[str, Any],
) -> list[str]:
    """The records of the appends of ``tags`` (begun, ended, failed), of the loads and drops
    of their conversations that came before ``load``, and the faults up to it, in time
    order, one line each: enough to tell which step made a wrong history."""
    convs = {r["conv"] for r in records if r.get("tag") in tags and "conv" in r}
    keep = ("r", "i", "op", "ph", "conv", "tag", "base", "fork", "inherited", "ok", "err")
    lines: list[tuple[float, str]] = []
    for r in records:
        about = r.get("tag") in tags or (
            r.get("op") in ("load", "drop", "rebase") and r.get("conv") in convs
        )
        if not about or r.get("t0", 0.0) > load["t0"]:
            continue
        brief = {k: r[k] for k in keep if k in r}
        if r.get("op") == "load" and r.get("ok"):
            brief["turns"] = [t for t, _ in r["turns"]]
        if not r.get("ok", True):
            brief["msg"] = r.get("msg", "")[:120]
        when = r.get("t1", r.get("t0", 0.0))
        lines.append((when, f"{when:.3f} {json.dumps(brief)}"))
    lines.extend(
        (f["t0"], f"{f['t0']:.3f}-{f['t1']:.3f} fault {json.dumps(f)}")
        for f in faults
        if f["t0"] <= load["t0"]
    )
    return [line for _, line in sorted(lines)][-60:]


def _allowed_for_forks(r: dict[str, Any]) -> bool:
    """Errors only forks and drops may meet: a fork's first turn that does not fit in its
    parent's tier, a fork point past the parent's current history (another replica
    dropped it and began a shorter one), an append under a key whose forks keep its
    dropped history."""
    err, msg = r["err"], r.get("msg", "")
    fork = "fork" in r and (
        err == "CapacityError" or (err == "InvalidArgumentError" and "parent_tokens is" in msg)
    )
    return fork or (err == "InvalidArgumentError" and "forks still list its history" in msg)


def _unchecked_forks(
    records: list[dict[str, Any]],
    sizes: dict[int, int],
    possible: dict[str, set[tuple[int, ...]]],
    inherited: dict[str, set[tuple[int, int]]],
) -> None:
    """A fork its replica did not check once made (killed first, or the check's load
    failed): the cache forked the parent's history current then, which may be newer than
    the replica's view of it (a rebase, which the check would have logged). Every cut at
    the fork's token count of a history the parent could have had is a history the fork
    may have (its own turn after it). ``sizes``: each turn's tokens, by tag."""
    checked = {r["tag"] for r in records if r.get("op") in ("fork-checked", "rebase")}
    taken: dict[str, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for conv, runs_ in inherited.items():  # (as logged: not the cuts added below)
        for tag, n in runs_:
            taken[conv][tag].add(n)
    for r in records:
        if r.get("op") != "append" or r.get("ph") != "begin" or "fork" not in r:
            continue
        if r["tag"] in checked:
            continue
        at = sum(n for _, n in r["inherited"])
        cuts: set[tuple[tuple[int, int], ...]] = set()
        for h in possible[r["fork"]]:
            cuts.update(_cuts(h, at, sizes, taken[r["fork"]]))
        for cut in cuts:
            inherited[r["conv"]].update(cut)
            possible[r["conv"]].add((*(t for t, _ in cut), r["tag"]))


def _cuts(
    history: tuple[int, ...], at: int, sizes: dict[int, int], taken: dict[int, set[int]]
) -> list[tuple[tuple[int, int], ...]]:
    """The first ``at`` tokens of ``history`` as (tag, tokens) runs, the last maybe cut:
    one per way of sizing its turns (their full size, or what the conversation, a fork
    too, inherited of them: ``taken``)."""
    out: list[tuple[tuple[int, int], ...]] = []
    stack: list[tuple[int, int, tuple[tuple[int, int], ...]]] = [(0, 0, ())]
    while stack:
        i, done, runs_ = stack.pop()
        if i == len(history):
            continue
        tag = history[i]
        for n in {sizes.get(tag, 0), *taken.get(tag, ())}:
            if n <= 0:
                continue
            if done + n >= at:
                out.append((*runs_, (tag, at - done)))
            else:
                stack.append((i + 1, done + n, (*runs_, (tag, n))))
    return out


def _check_forks(
    records: list[dict[str, Any]],
    sizes: dict[int, int],
    possible: dict[str, set[tuple[int, ...]]],
    failed: set[int],
    inherited: dict[str, set[tuple[int, int]]],
    result: Result,
) -> None:
    """Every acknowledged fork starts from a history its parent could have had: its
    inherited turns are a prefix of one acknowledged there (the last maybe cut), each
    turn as long as it is there (its full size, or what the parent, a fork too, inherited
    of it)."""
    rebased = {r["tag"]: r for r in records if r.get("op") == "rebase"}
    for r in records:
        if r.get("op") != "append" or r.get("ph") != "begin" or "fork" not in r:
            continue
        if r["tag"] in failed:
            continue
        result.forks += 1
        r = rebased.get(r["tag"], r)
        base = tuple(t for t, _ in r["inherited"])
        there = inherited[r["fork"]]

        def length(tag: int, there: set[tuple[int, int]] = there) -> set[int]:
            return {sizes.get(tag, 0)} | {n for t, n in there if t == tag}

        whole = all(n in length(t) for t, n in r["inherited"][:-1])
        last, cut = r["inherited"][-1]
        if not (
            whole
            and 1 <= cut <= max(length(last))
            and any(h[: len(base)] == base for h in possible[r["fork"]])
        ):
            result.wrong.append(
                f"fork {r['conv']} (tag {r['tag']}) of {r['fork']} inherits {r['inherited']}: "
                f"not the start of any history acknowledged there"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of faults (300)")
    parser.add_argument("--seed", type=int, default=1, help="the faults' and workload's seed (1)")
    parser.add_argument("--replicas", type=int, default=3, help="replica processes (3)")
    parser.add_argument("--conversations", type=int, default=8, help="conversations (8)")
    parser.add_argument(
        "--forks", type=int, default=4, help="fork keys (4; 0: no forks and no drops)"
    )
    parser.add_argument(
        "--min-operations",
        type=int,
        default=0,
        metavar="N",
        help="keep the faults going past --duration (up to 3x, or 60 s more) until N operations "
        "completed (0)",
    )
    parser.add_argument(
        "--layout", choices=list(LAYOUTS), default="host+redis", help="the replicas' tiers"
    )
    parser.add_argument("--secret", action="store_true", help="replicas use secret=")
    parser.add_argument(
        "--unkeyed-replica",
        action="store_true",
        help="with --secret: one more replica, without the secret",
    )
    parser.add_argument(
        "--fault-every",
        type=float,
        nargs=2,
        default=(0.8, 2.5),
        metavar=("MIN", "MAX"),
        help="seconds between faults (0.8 2.5)",
    )
    parser.add_argument("--keep", metavar="DIR", help="keep the logs in DIR")
    parser.add_argument("--check", metavar="DIR", help="only check the logs kept in DIR")
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    parser.add_argument("--final", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica:
        anyio.run(replica, json.loads(args.replica))
        return 0
    if args.final:
        anyio.run(final_loads, json.loads(args.final))
        return 0
    if args.check:
        checked = Options(
            replicas=args.replicas, secret=args.secret, unkeyed_replica=args.unkeyed_replica
        )
        result = check_directory(Path(args.check), checked)
        print("\n".join(result.lines()))
        return 0 if result.clean else 1
    opts = Options(
        duration=args.duration,
        seed=args.seed,
        replicas=args.replicas,
        conversations=args.conversations,
        forks=args.forks,
        min_operations=args.min_operations,
        layout=args.layout,
        secret=args.secret,
        unkeyed_replica=args.unkeyed_replica,
        fault_every=tuple(args.fault_every),
    )
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fleet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    try:
        result = anyio.run(campaign, opts, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"fleet campaign: layout {opts.layout}"
        + (" with secret" if opts.secret else "")
        + (" and a replica without it" if opts.unkeyed_replica else "")
        + f", seed {opts.seed}, {opts.replicas} replicas, {opts.conversations} "
        f"conversations and {opts.forks} fork keys, {opts.duration:.0f} s of faults "
        f"({time.monotonic() - began:.0f} s in all)"
    )
    for line in result.lines():
        print(line)
    return 0 if result.clean else 1


if __name__ == "__main__":
    sys.exit(main())
