"""A chat turn: what it reports (:class:`ChatTurn`) and how it runs (:class:`TurnRun`).

A turn restores the session's history (whole, or layer by layer while the prefill runs, or
from the caller's token ids where the cache has none), prefills the query, decodes the
answer, feeds its last token, and appends the query and answer as one segment.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import torch

from ...backends.shared import SharedTier
from ...codecs import ModelAccess
from ...errors import SessionNotFoundError
from ...meta import KVMeta, RetentionHint
from ..hints import apply_turn_hint
from .errors import check_loaded
from .modelcache import ModelCaches
from .runner import ModelRunner

if TYPE_CHECKING:
    from ...cache import TieredKVCache
    from .adapter import TransformersAdapter

__all__ = ["ChatTurn", "TurnRun", "check_fork", "sampler", "token_ids"]


class ChatTurn(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`TransformersAdapter.chat_turn` did.

    :param answer: the generated token ids (greedy or sampled)
    :param restored_tokens: history tokens restored from the cache (0 if it had none)
    :param recomputed_tokens: history tokens prefilled from ``history=`` because the cache
        had no usable copy
    :param stored_tokens: tokens of the segment appended: recomputed + query + answer
    :param history_tokens: tokens of the whole stored history after the turn
    :param codec: the codec string stored with the segment
    :param meta: the session's metadata after the append (and the turn's retention hint)
    :param restore_seconds: wall time from the call to the model's first step: checking
        the stored history and restoring it into the model cache (about 0 with none)
    :param compute_seconds: wall time of the model's prefill and decoding
    :param store_seconds: wall time of appending the turn's segment to the cache
    """

    answer: tuple[int, ...]
    restored_tokens: int
    recomputed_tokens: int
    stored_tokens: int
    history_tokens: int
    codec: str
    meta: KVMeta
    restore_seconds: float = 0.0
    compute_seconds: float = 0.0
    store_seconds: float = 0.0


class TurnRun:
    """One :meth:`TransformersAdapter.chat_turn
    <tieredkv.integrations.transformers.TransformersAdapter.chat_turn>`, its arguments
    checked: the turn's state, and its hooks to a serving loop (the go-ahead to compute,
    and the report that the history is in).

    :param adapter: the adapter whose public methods restore, check and extract
    :param caches: its model caches
    :param runner: its model runner
    :param access: its model's re-projection
    :param groups: the stored names, per layer (for a layer-wise restore)
    """

    def __init__(
        self,
        adapter: TransformersAdapter,
        caches: ModelCaches,
        runner: ModelRunner,
        access: ModelAccess,
        groups: list[list[str]],
        *,
        cache: TieredKVCache,
        session: str,
        query: torch.Tensor,
        history: torch.Tensor | None,
        max_new_tokens: int,
        eos_token_id: int | None,
        pick: Callable[[torch.Tensor], int],
        before_compute: Callable[[], Awaitable[None]] | None,
        on_loaded: Callable[[], None] | None,
        hint: RetentionHint | None = None,
        fork: tuple[str, int | None] | None = None,
    ) -> None:
        self._adapter = adapter
        self._caches = caches
        self._runner = runner
        self._access = access
        self._groups = groups
        self._cache = cache
        self._session = session
        self._query = query
        self._history = history
        self._max_new = max_new_tokens
        self._eos = eos_token_id
        self._pick = pick
        self._go = before_compute
        self._on_loaded = on_loaded
        self._hint = hint
        self._fork = fork
        self._parent: str | None = None  # the fork's parent, once its history is restored

    def _loaded(self) -> None:
        """Report the history read (once)."""
        loaded, self._on_loaded = self._on_loaded, None
        if loaded is not None:
            loaded()

    async def _go_ahead(self, now: float) -> float:
        """Wait for the go-ahead (once); when the turn's restore is counted from."""
        go, self._go = self._go, None
        if go is None:
            return now
        await go()
        return time.perf_counter()

    async def run(self) -> ChatTurn:
        """Restore, compute, store; see :meth:`TransformersAdapter.chat_turn`."""
        adapter, cache, session = self._adapter, self._cache, self._session
        query, history = self._query, self._history
        expected = int(history.numel()) if history is not None else None
        room = int(query.numel()) + self._max_new
        model_cache: Any = None
        missed = False
        try:
            if self._fork is not None:
                model_cache = await self._forked(expected, room)
            elif session in cache:
                try:
                    if adapter.layerwise and not cache.addressable(session):
                        return await self._streamed(expected)
                    model_cache = await adapter.restore(
                        cache, session, expected_tokens=expected, room=room
                    )
                except SessionNotFoundError:  # lost or found damaged meanwhile
                    if history is None:
                        raise
                    missed = True
            elif session in cache.channel:
                # the cache knew this conversation but lost its KV: starting afresh would
                # drop the context without a word
                if history is None:
                    raise SessionNotFoundError(session)
                missed = True  # (the history recomputed from the caller's is stored anew)
        finally:
            self._loaded()
        began = await self._go_ahead(time.perf_counter())
        if model_cache is not None:
            restored = int(model_cache.get_seq_length())
            prefill = query
        else:
            restored = 0
            prefill = query if history is None else torch.cat([history, query])
            model_cache = self._caches.new(int(prefill.numel()) + self._max_new)
        recomputed = prefill.numel() - query.numel()
        self._runner.check_positions(session, restored + prefill.numel() + self._max_new)
        restored_at = time.perf_counter()
        answer, tensors = await anyio.to_thread.run_sync(
            self._compute, model_cache, prefill, restored
        )
        if missed and (session in cache or session in cache.channel):
            # the miss left the copies it could not serve (a shared tier could not prove
            # them current), or the record of a history lost: the history recomputed from
            # the caller's replaces them, and is not appended after them
            with contextlib.suppress(SessionNotFoundError):  # (dropped meanwhile)
                await cache.drop(session)
        return await self._store(
            model_cache,
            answer,
            tensors,
            restored=restored,
            recomputed=recomputed,
            stored=int(prefill.numel()) + len(answer),
            times=(began, restored_at, time.perf_counter()),
        )

    async def _forked(self, expected: int | None, room: int) -> Any:
        """The fork's history: its parent's first tokens restored (``None`` if the cache
        lost the parent and the caller's ``history`` is to be recomputed and stored whole).

        :raises SessionNotFoundError: the parent is lost and there is no ``history``
        """
        assert self._fork is not None
        parent, tokens = self._fork
        cache = self._cache
        try:  # (with a shared tier, another replica's parent too)
            if await cache.discover(parent):
                model_cache = await self._adapter.restore(
                    cache, parent, expected_tokens=expected, room=room, tokens=tokens
                )
                self._parent = parent
                return model_cache
        except SessionNotFoundError:  # lost or found damaged meanwhile
            pass
        if self._history is None:
            raise SessionNotFoundError(parent)
        return None

    async def _streamed(self, expected: int | None) -> ChatTurn:
        """The turn, its history streaming in layer by layer while its prefill runs.

        :raises SessionNotFoundError: the history is gone or was found damaged (nothing
            computed from it is returned or stored)
        """
        adapter, cache, session = self._adapter, self._cache, self._session
        meta = adapter.check_history(cache, session, expected_tokens=expected)
        room = int(self._query.numel()) + self._max_new
        self._runner.check_positions(session, meta.tokens + room)
        codec = adapter.codec
        in_place = codec.decodes_in_place
        out = self._caches.allocate(
            codec, meta.tokens + (room if in_place else 0), self._runner.device
        )
        async with cache.load_layerwise(session, out, self._groups) as load:
            check_loaded(session, load.tokens, meta.tokens)
            model_cache = self._caches.gated(codec, self._access, out, load, room)
            load.when_done(self._loaded)
            began = await self._go_ahead(time.perf_counter())
            restored_at = time.perf_counter()
            answer, tensors = await anyio.to_thread.run_sync(
                self._compute, model_cache, self._query, load.tokens
            )
            await load.finished()  # every byte verified: the answer stands
        computed_at = time.perf_counter()
        if not in_place:
            self._caches.give(out.values())  # decoded into the layers' own buffers
        return await self._store(
            model_cache,
            answer,
            tensors,
            restored=load.tokens,
            recomputed=0,
            stored=int(self._query.numel()) + len(answer),
            times=(began, restored_at, computed_at),
        )

    def _compute(
        self, model_cache: Any, prefill: torch.Tensor, start: int
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Prefill, decode, feed the last token; return the answer and the segment."""
        runner = self._runner
        with runner.turn() as capture:
            answer = runner.decode(
                model_cache, prefill, self._max_new, self._eos, self._pick, feed_last=True
            )
            tensors = self._adapter.extract(model_cache, start=start, capture=capture)
        return answer, tensors

    async def _store(
        self,
        model_cache: Any,
        answer: list[int],
        tensors: dict[str, torch.Tensor],
        *,
        restored: int,
        recomputed: int,
        stored: int,
        times: tuple[float, float, float],
    ) -> ChatTurn:
        """Append the turn's segment, recycle its buffers, report it. ``times``: when the
        turn began, its compute began, and its compute ended (``time.perf_counter``)."""
        adapter = self._adapter
        began, restored_at, computed_at = times
        meta = await self._cache.append(
            self._session,
            tensors,
            answer_tokens=len(answer),
            token_dim=adapter.token_dim,
            codec=adapter.codec_id,
            # a fork point as restored: the parent may have grown since
            parent=self._parent,
            parent_tokens=restored if self._parent is not None else None,
            # the history the turn was computed after: a turn that another one extended
            # meanwhile is refused (HistoryLengthError), not stored after it
            expected_tokens=restored,
        )
        if self._hint is not None:  # a pin past the bound is refused (logged), not the turn
            what = f"the hint of session {self._session!r}'s turn"
            meta, _ = apply_turn_hint(self._cache, self._session, self._hint, what=what)
        # the segment is stored (copied): this turn's buffers are free for the next one
        self._caches.recycle(model_cache)
        return ChatTurn(
            answer=tuple(answer),
            restored_tokens=restored,
            recomputed_tokens=recomputed,
            stored_tokens=stored,
            history_tokens=meta.tokens,
            codec=adapter.codec_id,
            meta=meta,
            restore_seconds=restored_at - began,
            compute_seconds=computed_at - restored_at,
            store_seconds=time.perf_counter() - computed_at,
        )


def check_fork(cache: TieredKVCache, session: str, parent: str, parent_tokens: int | None) -> None:
    """Refuse, before anything runs, a fork the cache would refuse once it is computed.

    :raises ValueError: the session is stored already, forks itself, ``parent_tokens`` is
        below 1, or the cache has a tier shared between replicas that takes no forks
    """
    if session in cache.channel:
        raise ValueError(
            f"conversation {session!r} is already stored; a conversation becomes a fork at "
            f"its first turn (fork under a new key)"
        )
    if parent == session:
        raise ValueError(f"conversation {session!r} cannot be forked from itself")
    if parent_tokens is not None and parent_tokens < 1:
        raise ValueError(f"parent_tokens must be at least 1 (or None for all), not {parent_tokens}")
    for t in cache.tiers:
        if isinstance(t, SharedTier) and not getattr(t, "forks", False):
            raise ValueError(
                f"forks are not supported with tier {t.name!r}, shared between replicas (a "
                f"Redis Cluster, or a shared tier that takes no forks); pass the fork's "
                f"whole history= without parent instead"
            )


def sampler(
    temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> Callable[[torch.Tensor], int]:
    """The next-token rule: argmax, or sampling with temperature, top-k and top-p."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), not {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, not {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], not {top_p}")
    if temperature == 0:
        if top_k is not None or top_p is not None or generator is not None:
            raise ValueError("top_k, top_p and generator sample: give a temperature > 0 too")
        return lambda logits: int(logits.argmax())
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"the generator must be a CPU generator, not {generator.device}")

    def sample(logits: torch.Tensor) -> int:
        scaled = logits.float().cpu() / temperature
        if top_k is not None and top_k < scaled.numel():
            kth = torch.topk(scaled, top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if top_p is not None and top_p < 1:
            ordered, order = torch.sort(scaled, descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            # drop a token once the likelier ones alone reach top_p (the first always stays)
            drop = cumulative - ordered.softmax(-1) >= top_p
            scaled = scaled.masked_fill(
                torch.zeros_like(drop).scatter(0, order, drop), float("-inf")
            )
        probs = scaled.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    return sample


def token_ids(ids: Sequence[int] | torch.Tensor, what: str) -> torch.Tensor:
    """``ids`` as a 1-D ``long`` tensor on the CPU.

    :raises ValueError: naming ``what`` if it is not 1-D (or ``[1, tokens]``)
    """
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids (or [1, tokens])")
    return t.to(torch.long).cpu()
