"""The child process of test_serve_imports: the serving loop with no transformers at all.

Run as ``python engine_without_transformers.py DIR``. With ``transformers`` blocked, it
serves three conversations through :class:`~tieredkv.serve.ServingEngine` twice, with a
cache (host memory over an SSD tier in ``DIR``) and as the no-cache baseline, through
:class:`TokenAdapter`: an adapter of another "library" whose model answers from every
token of the conversation, so an answer is right only if the engine gave the adapter the
right history. It prints ``ok <restored tokens>`` when both runs answered alike.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.modules["transformers"] = None  # type: ignore[assignment]  # as if not installed

import anyio  # noqa: E402
import torch  # noqa: E402

from tieredkv import HostMemoryTier, SSDTier, TieredKVCache  # noqa: E402
from tieredkv.policies import BidawScheduler  # noqa: E402
from tieredkv.serve import ServingEngine, TurnRequest  # noqa: E402


@dataclass(frozen=True)
class TokenResult:
    answer: tuple[int, ...]
    restored_tokens: int
    recomputed_tokens: int


def answer_to(tokens: Sequence[int], n: int) -> tuple[int, ...]:
    """The "model": each answer token depends on every token before it."""
    seen = list(tokens)
    for _ in range(n):
        seen.append(sum((i + 1) * t for i, t in enumerate(seen)) % 251)
    return tuple(seen[len(tokens) :])


class TokenAdapter:
    """Stores a conversation's token ids (``ids``, token dimension 0) as its "KV"."""

    async def chat_turn(
        self,
        cache: TieredKVCache,
        session: str,
        query: list[int],
        *,
        max_new_tokens: int,
        history: list[int],
    ) -> TokenResult:
        restored: list[int] = []
        if session in cache:
            restored = (await cache.load(session))["ids"].tolist()
        recomputed = history[len(restored) :] if restored != history else []
        answer = answer_to(restored + recomputed + query, max_new_tokens)
        new = torch.tensor(recomputed + query + list(answer), dtype=torch.int64)
        await cache.append(session, {"ids": new}, answer_tokens=max_new_tokens, token_dim=0)
        return TokenResult(answer, len(restored), len(recomputed))

    async def recompute(self, tokens: list[int], *, max_new_tokens: int) -> Sequence[int]:
        return answer_to(tokens, max_new_tokens)


async def main(directory: Path) -> None:
    requests = [
        (0.01 * k, TurnRequest(session=f"u{k % 3}", query=(k, k + 1, 7), answer_tokens=5))
        for k in range(12)
    ]
    answers: list[dict[tuple[str, int], tuple[int, ...]]] = []
    restored = 0
    for recompute in (False, True):
        tiers = [HostMemoryTier(8192), SSDTier(directory / str(recompute), 1 << 24)]
        async with TieredKVCache(tiers) as cache:
            engine = ServingEngine(TokenAdapter(), cache, BidawScheduler(), recompute=recompute)
            served = await engine.run(requests)
            if not recompute:
                assert cache.stats().demotions > 0  # some histories came back from the SSD
        turns: dict[str, int] = {}
        run: dict[tuple[str, int], tuple[int, ...]] = {}
        for turn in sorted(served, key=lambda t: t.start):
            turns[turn.session] = turns.get(turn.session, -1) + 1
            run[(turn.session, turns[turn.session])] = turn.answer
            restored += turn.restored_tokens
        answers.append(run)
    assert answers[0] == answers[1], answers
    loaded = [
        name
        for name, module in sys.modules.items()
        if module is not None
        and (name == "transformers" or name.startswith(("transformers.", "tieredkv.integrations.")))
    ]
    assert loaded == ["tieredkv.integrations.forward"], loaded  # tieredkv.serve re-exports it
    print("ok", restored)


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
