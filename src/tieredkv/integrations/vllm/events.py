"""KV events for routers: what the connector stores and evicts, per medium.

With vLLM's ``kv_events_config`` on, the scheduler side publishes, through vLLM's own
event publisher, a ``BlockStored`` for the blocks of every turn the workers stored and a
``BlockRemoved`` for blocks that leave a tier, so that a cache-aware router (vLLM's
router, llm-d, Dynamo) can send a returning turn to the replica that holds it. The
events carry vLLM's own block hashes of the request (the ones its prefix cache and its
own events use, so a router that hashes prompts as vLLM does finds them), with
``medium`` ``"CPU"`` for the host-memory tier and ``"STORAGE"`` for the tiers below it,
and the tier's name (``"host"``, ``"ssd"``, ``"redis"``) as ``ownership``.

Histories stored before a restart are not announced again: their sidecars hold token ids,
not vLLM's hashes (which, with a non-cryptographic hash function, vLLM seeds per
process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ...meta import KVMeta
from .ops import WorkerReport
from .worker import HOST

__all__ = ["KVEvents"]

MEDIA = {HOST: "CPU"}
"""vLLM's medium for each tier name (every other tier is ``"STORAGE"``)."""


@dataclass
class _Turn:
    hashes: list[Any]  # vLLM's external block hashes, from block 0
    tokens: list[int]
    lora_id: int | None
    lora_name: str | None


@dataclass
class _Stored:
    hashes: list[Any] = field(default_factory=list)  # the stored blocks, from block 0
    tokens: list[int] = field(default_factory=list)
    lora_id: int | None = None
    lora_name: str | None = None
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> blocks announced there


class KVEvents:
    """The events of the connector's stores and evictions, taken by vLLM each step.

    A turn's new blocks are announced in host memory when the workers report them stored
    (a turn lands there first), and in a lower tier once the cache reports a copy there;
    a conversation that leaves a tier (evicted, or its copy outdated while a new turn is
    written) is removed from it, every block at once.

    :param block_size: tokens per block
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._turns: dict[str, _Turn] = {}  # request -> its hashes, until stored
        self._stored: dict[str, _Stored] = {}  # session -> what was announced
        self._events: list[Any] = []

    def finishing(
        self,
        req_id: str,
        hashes: Sequence[Any],
        tokens: Sequence[int],
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """A request's turn will be saved: keep vLLM's hashes of its blocks."""
        self._turns[req_id] = _Turn(list(hashes), list(tokens), lora_id, lora_name)

    def update(self, report: WorkerReport | None) -> None:
        """The workers' report: turns stored, placements changed, conversations gone."""
        if report is None:
            return
        for req_id, session, blocks, ok in report.stored:
            turn = self._turns.pop(req_id, None)
            if not ok or turn is None or len(turn.hashes) < blocks:
                continue
            stored = self._stored.setdefault(session, _Stored())
            start = len(stored.hashes)
            if blocks <= start or turn.hashes[:start] != stored.hashes:
                continue  # nothing new, or not the announced conversation's blocks
            stored.hashes = turn.hashes[:blocks]
            stored.tokens = turn.tokens[: blocks * self.block_size]
            stored.lora_id, stored.lora_name = turn.lora_id, turn.lora_name
            self._announce(stored, HOST)
        for session, data in report.metas.items():
            if data is None:
                self._remove(session)
            else:
                meta = msgspec.msgpack.decode(data, type=KVMeta)
                self._move(session, set(meta.copies) if meta.tier is not None else set())
        for session in report.gone:
            self._remove(session)

    def _announce(self, stored: _Stored, tier: str) -> None:
        """``BlockStored`` for the blocks not yet announced in ``tier``."""
        from vllm.distributed.kv_events import BlockStored

        start, end, bs = stored.tiers.get(tier, 0), len(stored.hashes), self.block_size
        if end <= start:
            return
        self._events.append(
            BlockStored(
                block_hashes=stored.hashes[start:end],
                parent_block_hash=stored.hashes[start - 1] if start else None,
                token_ids=stored.tokens[start * bs : end * bs],
                block_size=bs,
                lora_id=stored.lora_id,
                medium=MEDIA.get(tier, "STORAGE"),
                lora_name=stored.lora_name,
                ownership=tier,
            )
        )
        stored.tiers[tier] = end

    def _move(self, session: str, tiers: set[str]) -> None:
        stored = self._stored.get(session)
        if stored is None:
            return
        for tier in sorted(set(stored.tiers) - tiers):
            self._events.append(_removed(stored.hashes[: stored.tiers.pop(tier)], tier))
        for tier in sorted(tiers):
            self._announce(stored, tier)
        if not tiers:
            del self._stored[session]

    def _remove(self, session: str) -> None:
        stored = self._stored.pop(session, None)
        if stored is None:
            return
        for tier, blocks in sorted(stored.tiers.items()):
            self._events.append(_removed(stored.hashes[:blocks], tier))

    def busy(self) -> dict[str, int]:
        """What the events hold for requests now (0 once every save was reported): the
        turns whose saves are planned and not yet reported stored or failed."""
        return {"event_turns": len(self._turns)}

    def take(self) -> list[Any]:
        """The events since the last call."""
        out, self._events = self._events, []
        return out


def _removed(hashes: Sequence[Any], tier: str) -> Any:
    from vllm.distributed.kv_events import BlockRemoved

    medium = MEDIA.get(tier, "STORAGE")
    return BlockRemoved(block_hashes=list(hashes), medium=medium, ownership=tier)
