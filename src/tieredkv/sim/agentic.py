"""An agentic workload: tool-call loops mixed with human conversations, and the callers'
hints about when each conversation comes back.

A person reads an answer before replying, so the gap before their next turn grows with the
answer's length (what Bidaw's eviction learns from). An agent does not read: when its
answer is a *tool call*, the next turn comes when the tool returns, in seconds or in
minutes whatever the answer's length. :class:`AgenticWorkload` generates both kinds of
conversation, seeded:

- **human conversations**: :class:`~tieredkv.sim.synthetic.SyntheticWorkload`'s users
  (read-then-type gaps, shaped like the Bidaw trace);
- **agent conversations**: a person gives a task; the model answers with tool calls
  (``tool_tokens``, 20-80 tokens, uniform) until it gives the final answer. A tool runs
  ``long_tool_seconds`` (1-10 minutes, uniform) with probability ``long_tool_share``
  (25%), else seconds (lognormal, median ``short_tool_median``, capped below a minute);
  its result is the next turn's query. After the final answer the person reads it and
  types the next task, as a human conversation's user does.

**Hints.** A fraction ``hinted`` of the agent conversations have a caller that says, after
each tool call, when the tool will return (``hint``: seconds from the turn to the next);
of those, a fraction ``wrong`` give hints that are wrong: the duration of another tool
drawn from the same distribution, unrelated to this one. Correct hints are the tool's
actual duration. No caller hints a person's reading time (it cannot know it): turns that
end in a final answer, and every human turn, carry no hint.

:class:`AgenticTurns` holds the turns (:class:`~tieredkv.sim.trace.Turns`) with, per turn,
whether it ended in a tool call, the hint, and whether an agent ran it; :func:`replay_agentic`
replays it through an eviction policy (:func:`tieredkv.sim.replay.replay` with the tool
flags and the hints).
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import numpy.typing as npt

from ..policies.base import Eviction
from .replay import ReplayResult, replay
from .synthetic import SyntheticWorkload, _lognormal_int
from .trace import Turns

__all__ = ["AgenticTurns", "AgenticWorkload", "replay_agentic"]

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


class AgenticTurns:
    """Turns of an agentic workload, in time order, with per-turn columns.

    :param turns: the turns
    :param tool_call: the turn's answer is a tool call
    :param hint: seconds from the turn to the next one, as its caller hinted (NaN: no hint)
    :param agent: the turn belongs to an agent conversation
    :raises ValueError: if a column's length differs from the turns'
    """

    __slots__ = ("agent", "hint", "tool_call", "turns")

    def __init__(
        self, turns: Turns, tool_call: BoolArray, hint: FloatArray, agent: BoolArray
    ) -> None:
        if not len(tool_call) == len(hint) == len(agent) == len(turns):
            raise ValueError("tool_call, hint and agent need one value per turn")
        self.turns = turns
        self.tool_call = tool_call
        self.hint = hint
        self.agent = agent

    def __len__(self) -> int:
        return len(self.turns)

    def hinted_times(self) -> FloatArray:
        """Per turn, the absolute time its caller expects the next turn (NaN: no hint)."""
        return self.turns.time + self.hint


class AgenticWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """Parameters of the human + agent workload; :meth:`generate` makes the turns.

    :param users: conversations, human and agent together
    :param arrival_rate: new conversations per second (Poisson arrivals)
    :param agent_share: fraction of the conversations run by an agent
    :param tasks_median: median tasks per agent conversation (lognormal, sigma 0.6)
    :param tasks_max: most tasks of one agent conversation
    :param tools_median: median tool calls per task (lognormal, sigma 0.6)
    :param tools_max: most tool calls of one task
    :param tool_tokens: tool-call answer tokens, uniform in this closed range
    :param long_tool_share: fraction of the tools that run ``long_tool_seconds``
    :param long_tool_seconds: a long tool's run time, uniform in this range
    :param short_tool_median: median run time of a short tool, seconds (lognormal)
    :param short_tool_sigma: lognormal shape of a short tool's run time
    :param short_tool_max: a short tool's run time at most, seconds
    :param result_median: median tokens of a tool's result (the next turn's query)
    :param result_max: most tokens of a tool's result
    :param final_median: median tokens of a task's final answer
    :param final_max: most tokens of a task's final answer
    :param hinted: fraction of the agent conversations whose caller hints tool durations
    :param wrong: fraction of the hinting callers whose hints are wrong
    :param human: the human conversations' shape (``users``, ``arrival_rate`` and ``seed``
        are set from this workload's)
    :param seed: seed of the random generator
    """

    users: int = 2000
    arrival_rate: float = 1.0
    agent_share: float = 0.5
    tasks_median: float = 4.0
    tasks_max: int = 40
    tools_median: float = 5.0
    tools_max: int = 60
    tool_tokens: tuple[int, int] = (20, 80)
    long_tool_share: float = 0.25
    long_tool_seconds: tuple[float, float] = (60.0, 600.0)
    short_tool_median: float = 4.0
    short_tool_sigma: float = 0.8
    short_tool_max: float = 50.0
    result_median: float = 60.0
    result_max: int = 1000
    final_median: float = 60.0
    final_max: int = 424
    hinted: float = 0.0
    wrong: float = 0.0
    human: SyntheticWorkload = SyntheticWorkload()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.users < 0 or self.arrival_rate <= 0:
            raise ValueError("users must be >= 0 and arrival_rate > 0 (conversations per second)")
        for name in ("agent_share", "long_tool_share", "hinted", "wrong"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} is a fraction: it must be in [0, 1] (got {value})")
        lo, hi = self.tool_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"tool_tokens must be a range 1 <= low <= high (got {lo}, {hi})")
        slo, shi = self.long_tool_seconds
        if not 0 < slo <= shi:
            raise ValueError(f"long_tool_seconds must be 0 < low <= high (got {slo}, {shi})")
        medians = (
            self.tasks_median,
            self.tools_median,
            self.short_tool_median,
            self.result_median,
            self.final_median,
        )
        if min(medians) <= 0 or self.short_tool_sigma < 0 or self.short_tool_max <= 0:
            raise ValueError("medians and short_tool_max must be positive, sigma >= 0")
        if min(self.tasks_max, self.tools_max, self.result_max, self.final_max) < 1:
            raise ValueError("tasks_max, tools_max, result_max and final_max must be >= 1")

    def tool_seconds(self, rng: np.random.Generator, size: int) -> FloatArray:
        """``size`` tool run times drawn from the workload's distribution, seconds."""
        long = rng.random(size) < self.long_tool_share
        short = rng.lognormal(math.log(self.short_tool_median), self.short_tool_sigma, size)
        out = np.where(
            long,
            rng.uniform(*self.long_tool_seconds, size),
            np.clip(short, 0.5, self.short_tool_max),
        )
        return out.astype(np.float64)

    def generate(self) -> AgenticTurns:
        """The turns of every conversation, sorted by time."""
        rng = np.random.default_rng(self.seed)
        n_agents = round(self.users * self.agent_share)
        n_humans = self.users - n_agents
        cols: dict[str, list[np.ndarray]] = {
            k: [] for k in ("user", "time", "query", "answer", "round", "tool", "hint", "agent")
        }
        if n_humans:
            people = msgspec.structs.replace(
                self.human,
                users=n_humans,
                arrival_rate=self.arrival_rate * n_humans / self.users,
                seed=self.seed + 1,
            ).generate()
            m = len(people)
            for key, col in (
                ("user", people.user),
                ("time", people.time),
                ("query", people.query),
                ("answer", people.answer),
                ("round", people.round_index),
                ("tool", np.zeros(m, dtype=bool)),
                ("hint", np.full(m, np.nan)),
                ("agent", np.zeros(m, dtype=bool)),
            ):
                cols[key].append(col)
        if n_agents:
            for key, col in self._agents(rng, n_agents, first_user=n_humans).items():
                cols[key].append(col)
        joined = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
        order = np.argsort(joined["time"], kind="stable")
        turns = Turns(
            joined["user"][order].astype(np.int64),
            joined["time"][order].astype(np.float64),
            joined["query"][order].astype(np.int64),
            joined["answer"][order].astype(np.int64),
            joined["round"][order].astype(np.int64),
        )
        return AgenticTurns(
            turns,
            joined["tool"][order].astype(bool),
            joined["hint"][order].astype(np.float64),
            joined["agent"][order].astype(bool),
        )

    def _agents(self, rng: np.random.Generator, n: int, first_user: int) -> dict[str, np.ndarray]:
        rate = self.arrival_rate * n / self.users
        starts = np.cumsum(rng.exponential(1.0 / rate, size=n))
        tasks = _lognormal_int(rng, self.tasks_median, 0.6, n, self.tasks_max)
        hinting = rng.random(n) < self.hinted
        wrong = hinting & (rng.random(n) < self.wrong)
        human = self.human
        user: list[int] = []
        time: list[float] = []
        query: list[int] = []
        answer: list[int] = []
        rounds: list[int] = []
        tool: list[bool] = []
        hint: list[float] = []
        for a in range(n):
            t = float(starts[a])
            r = 0
            for _ in range(int(tasks[a])):
                calls = int(_lognormal_int(rng, self.tools_median, 0.6, 1, self.tools_max)[0])
                durations = self.tool_seconds(rng, calls)
                decoys = self.tool_seconds(rng, calls)
                results = _lognormal_int(rng, self.result_median, 0.8, calls, self.result_max)
                calls_tokens = rng.integers(self.tool_tokens[0], self.tool_tokens[1] + 1, calls)
                task_query = int(_lognormal_int(rng, human.query_median, human.query_sigma, 1,
                                                human.query_max)[0])  # fmt: skip
                for j in range(calls + 1):
                    user.append(first_user + a)
                    time.append(t)
                    query.append(task_query if j == 0 else int(results[j - 1]))
                    rounds.append(r)
                    r += 1
                    if j < calls:  # a tool call: back when the tool returns
                        answer.append(int(calls_tokens[j]))
                        tool.append(True)
                        gap = float(durations[j])
                        told = float(decoys[j]) if wrong[a] else gap
                        hint.append(told if hinting[a] else math.nan)
                    else:  # the final answer: the person reads it, then types the next task
                        final = int(_lognormal_int(rng, self.final_median, 0.85, 1,
                                                   self.final_max)[0])  # fmt: skip
                        answer.append(final)
                        tool.append(False)
                        hint.append(math.nan)
                        typing = float(rng.lognormal(math.log(human.type_median), human.type_sigma))
                        gap = human.read_seconds_per_token * final + typing
                    t += gap
        return {
            "user": np.asarray(user, dtype=np.int64),
            "time": np.asarray(time, dtype=np.float64),
            "query": np.asarray(query, dtype=np.int64),
            "answer": np.asarray(answer, dtype=np.int64),
            "round": np.asarray(rounds, dtype=np.int64),
            "tool": np.asarray(tool, dtype=bool),
            "hint": np.asarray(hint, dtype=np.float64),
            "agent": np.ones(len(user), dtype=bool),
        }


def replay_agentic(
    workload: AgenticTurns, policy: Eviction, *, hints: bool = True, **kwargs: object
) -> ReplayResult:
    """Replay an agentic workload through ``policy`` (:func:`tieredkv.sim.replay.replay`),
    each turn carrying whether it ended in a tool call and, with ``hints``, its caller's
    hint; ``kwargs`` go to the replay (``host_bytes`` is required)."""
    return replay(
        workload.turns,
        policy,
        tool_calls=workload.tool_call,
        hints=workload.hinted_times() if hints else None,
        **kwargs,  # type: ignore[arg-type]
    )
