"""What the scheduler side asks of the workers each step, and what they answer.

Plain dataclasses of ints, strings and bytes: vLLM carries them between its scheduler and
worker processes (pickled by its executor) inside its own connector metadata objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...meta import RetentionHint
from .keys import PLAIN, RequestKeys

__all__ = ["LoadOp", "SaveOp", "StepPlan", "WorkerReport"]


@dataclass(frozen=True)
class LoadOp:
    """Copy ``blocks`` leading blocks of a stored conversation into a request's blocks.

    :param req_id: vLLM's request id
    :param session: the conversation's key
    :param block_ids: the request's block ids (its block table, from block 0)
    :param first: the first block to fill (the blocks before it vLLM already holds)
    :param blocks: the matched blocks; blocks ``first .. blocks-1`` are filled
    :param tokens: the request's token ids of the matched blocks (compared with the stored
        ones before anything is copied)
    :param sync: load within this step (the history is in host memory, or small enough
        to read from below it while the forward pass runs) or in the background
    :param host: the history was in host memory when the load was planned
    """

    req_id: str
    session: str
    block_ids: tuple[int, ...]
    first: int
    blocks: int
    tokens: tuple[int, ...]
    sync: bool
    host: bool = True


@dataclass(frozen=True)
class SaveOp:
    """Store a finished request's blocks ``start .. end-1`` as its conversation's next turn.

    :param req_id: vLLM's request id (its blocks stay allocated until the copy is done)
    :param session: the conversation's key (a new one when ``start`` is 0)
    :param block_ids: the request's block ids, from block 0
    :param start: blocks the conversation already stores (the append must find exactly
        these, or it is skipped)
    :param end: blocks of KV the request computed (full blocks only)
    :param tokens: the request's token ids of blocks ``0 .. end-1``
    :param answer_tokens: tokens the model generated (Bidaw's eviction signal)
    :param keys: the request's keys besides its tokens (its sidecar records them)
    :param hint: the request's retention hint, applied to the conversation once the turn
        is stored
    :param parent: the stored conversation whose first ``start`` blocks this one
        continues: the turn is the first of a new conversation (``session``), a fork of
        ``parent`` that stores blocks ``start .. end-1`` only (``None``: ``session``
        itself stores the first ``start`` blocks)
    :param tenant: the request's tenant (:func:`~tieredkv.integrations.vllm.hints.tenant_of`
        its ``cache_salt``): a pin the hint asks for counts against that tenant's bound
    """

    req_id: str
    session: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    tokens: tuple[int, ...]
    answer_tokens: int
    keys: RequestKeys = PLAIN
    hint: RetentionHint | None = None
    parent: str | None = None
    tenant: str = ""


@dataclass
class StepPlan:
    """One step's loads and saves.

    :param cancelled: requests that finished (or were aborted) while their asynchronous
        load still waited in the scheduler side's queue: no worker ever loads them, and
        each worker reports them finished receiving once, so that vLLM frees their blocks
    :param idle: vLLM scheduled no tokens this step (it only waits, for loads or saves):
        the worker may then wait a little for one of them rather than return at once
    :param hints: ``(req_id, session, hint, tenant)``: retention hints of finished
        requests that stored nothing new, for the stored conversation each one's prompt
        continues whole, with the request's tenant (as :attr:`SaveOp.tenant`)
    """

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    hints: list[tuple[str, str, RetentionHint, str]] = field(default_factory=list)
    idle: bool = False


@dataclass
class WorkerReport:
    """What a worker tells the scheduler side after a step.

    :param stored: ``(req_id, session, blocks stored, ok)`` per save that finished
    :param loaded: ``(req_id, session, ok)`` per load that finished
    :param metas: msgpack-encoded :class:`~tieredkv.meta.KVMeta` of every conversation
        whose placement changed, or ``None`` for one the cache no longer holds
    :param gone: conversations that cannot serve again (lost, damaged, not what the index
        said): the index forgets them
    :param rank: the worker's rank (each tensor-parallel rank stores and loads its own
        shard: a save or a load is complete once every rank reported it)
    """

    stored: list[tuple[str, str, int, bool]] = field(default_factory=list)
    loaded: list[tuple[str, str, bool]] = field(default_factory=list)
    metas: dict[str, bytes | None] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)
    rank: int = 0

    def empty(self) -> bool:
        """Nothing to report."""
        return not (self.stored or self.loaded or self.metas or self.gone)
