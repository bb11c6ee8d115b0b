"""The adapter: one transformers model's conversations against a :class:`TieredKVCache`.

:class:`TransformersAdapter` runs a turn end to end (:meth:`~TransformersAdapter.chat_turn`)
or in parts (:meth:`~TransformersAdapter.restore`, :meth:`~TransformersAdapter.extract`,
:meth:`~TransformersAdapter.store`). It asks the codec what it needs to know of it
(:class:`~tieredkv.codecs.Codec`), the model's probing and codec choice
(:mod:`.choice`), the model caches (:mod:`.modelcache`) and the cache's public API; it
names no codec class, model family or tier.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ...codecs import Codec, TurnTensors, layer_groups
from ...errors import SessionNotFoundError
from ...meta import KVMeta, RetentionHint
from .capture import ActivationCapture
from .chat import ChatTurn, TurnRun, check_fork, sampler, token_ids
from .choice import CodecAsked, check_asked, inspect_model
from .errors import HistoryMismatchError, check_loaded, require_transformers
from .modelcache import ModelCaches, layer_kv
from .runner import ModelRunner

if TYPE_CHECKING:
    from transformers import DynamicCache

    from ...cache import TieredKVCache

__all__ = ["TransformersAdapter"]

_GREEDY = sampler(0.0, None, None, None)


class TransformersAdapter:
    """Moves one model's per-conversation KV between transformers and :class:`TieredKVCache`.

    Construction runs one short forward pass (four tokens, into a fresh cache; the model is
    left as found) to read the shape of the model's K/V, and, where the activation codec is
    offered, checks that re-projecting that pass's activations gives back its K/V. The
    adapter knows a codec only through the :class:`~tieredkv.codecs.Codec` protocol, so a
    codec object of your own serves as the shipped ones do.

    :param model: a decoder-only causal-LM model whose cache holds per-layer keys and
        values, in eval mode
    :param codec: ``"auto"`` (the codec storing fewer bytes among those exact for the
        model), ``"kv"``, ``"act"``, or a :class:`~tieredkv.codecs.Codec`
    :param tag: appended to the model fingerprint (``"...@tag"``), e.g. the checkpoint name
        and revision, so that a history stored with other weights of the same shape is
        refused too
    :param recycle_bytes: host buffers (K/V of finished turns on a CPU model) kept for the
        next turns' restores, at most; 0 to allocate afresh every turn (see
        :class:`~tieredkv.integrations.inplace.BufferPool`)
    :param layerwise: in :meth:`chat_turn`, restore a history that is not in the cache's
        performance tier layer by layer (:meth:`TieredKVCache.load_layerwise
        <tieredkv.TieredKVCache.load_layerwise>`): the prefill starts once layer 0's
        history is in, and each later layer waits only for its own (with the activation
        codec, each layer's stored activation is re-projected as it arrives). Answers are
        the same; nothing is returned or stored before every byte is verified
    :raises UnsupportedModelError: for a model whose cache is not per-layer K/V (the message
        names the model type and why), or ``codec="act"`` (or a codec that needs
        activations) where it is not exact
    :raises ValueError: for a ``codec`` that is none of those (naming what a codec object
        lacks of the protocol)
    :raises ArchitectureMismatchError: if the registered architecture of the model's type
        does not match its modules (not raised with ``codec="kv"``, which needs none)
    :raises TransformersMissingError: (an ``ImportError``) without transformers installed
    """

    def __init__(
        self,
        model: Any,
        *,
        codec: CodecAsked = "auto",
        tag: str | None = None,
        recycle_bytes: int = 512 << 20,
        layerwise: bool = False,
    ) -> None:
        require_transformers()
        check_asked(codec)
        if tag is not None and not tag:
            raise ValueError("tag must be non-empty text (or None)")
        if recycle_bytes < 0:
            raise ValueError(f"recycle_bytes must be >= 0, not {recycle_bytes}")
        self.model = model
        facts = inspect_model(model, codec)
        self.spec = facts.spec
        """The model's shape (:class:`~tieredkv.codecs.ModelSpec`)."""
        self._windows = facts.windows
        self._access = facts.access
        self.codec: Codec = facts.codec
        """The codec in use."""
        self.codec_reason = facts.reason
        """Why :attr:`codec` was chosen, e.g. ``"act: the smaller of the two exact codecs"``."""
        self.codec_id = f"{self.codec.name}/{self.spec.fingerprint}" + (f"@{tag}" if tag else "")
        """The codec string stored with every segment: ``codec/fingerprint[@tag]``."""
        self._groups = layer_groups(self.codec, self.spec) if layerwise else []
        captured = facts.k_modules if self.codec.needs_activations else []
        self._runner = ModelRunner(model, self.spec, captured)
        self._caches = ModelCaches(model.config, self.spec, self._windows, recycle_bytes)
        self._pool = self._caches.pool
        self.layerwise = layerwise
        """Whether :meth:`chat_turn` streams histories from lower tiers layer by layer."""

    # -- facts -----------------------------------------------------------------------------
    @property
    def token_dim(self) -> int:
        """Token dimension of the stored tensors (1 for K/V ``[kv_heads, tokens, head_dim]``,
        0 for activations ``[tokens, hidden_size]``); pass it to ``cache.append``."""
        return self.codec.token_dim(self.spec)

    @property
    def bytes_per_token(self) -> int:
        """Bytes stored per token with the chosen codec (all layers)."""
        return self.codec.bytes_per_token(self.spec)

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        return self._runner.device

    @property
    def sliding_windows(self) -> list[int | None]:
        """Per layer, ``None`` for full attention or the layer's sliding window."""
        return list(self._windows)

    # -- after a turn ----------------------------------------------------------------------
    def capture(self) -> ActivationCapture:
        """Hooks that record what the activation codec stores, for one turn.

        Run the turn's forward passes inside ``with adapter.capture() as cap:``, then pass
        ``capture=cap`` to :meth:`extract` or :meth:`store`. With a codec that needs no
        activations (K/V) it records nothing, so the same code serves both codecs.
        """
        return self._runner.capture()

    def extract(
        self, model_cache: Any, *, start: int, capture: ActivationCapture | None = None
    ) -> dict[str, torch.Tensor]:
        """The named tensors to append for the tokens ``start ..`` of ``model_cache``.

        :param model_cache: the model's cache after the turn (batch size 1): one from
            :meth:`restore` or :meth:`new_model_cache`, or a ``DynamicCache`` (whose
            sliding-window layers must still hold every token after ``start``)
        :param start: tokens it held before the turn (the restored history)
        :param capture: the turn's :meth:`capture` (required by the activation codec, which
            checks that it recorded exactly the new tokens)
        :raises ValueError: if the cache has no new tokens or does not fit the model
        """
        keys, values, new = layer_kv(model_cache, self.spec.layers, start)
        acts = None
        if self.codec.needs_activations:
            if capture is None:
                raise ValueError(
                    f"codec {self.codec.name!r} needs the turn's activations: run the turn "
                    f"inside 'with adapter.capture() as cap' and pass capture=cap"
                )
            if capture.tokens != new:
                raise ValueError(
                    f"the capture recorded {capture.tokens} tokens but the cache grew by {new}; "
                    f"capture every forward pass of the turn, and nothing else"
                )
            acts = capture.activations()
        return self.codec.encode(TurnTensors(keys, values, acts), self.spec)

    async def store(
        self,
        cache: TieredKVCache,
        session: str,
        model_cache: Any,
        *,
        start: int,
        answer_tokens: int,
        capture: ActivationCapture | None = None,
        hint: RetentionHint | None = None,
    ) -> KVMeta:
        """:meth:`extract` the turn's new tokens and append them to ``cache`` (with
        ``hint``, as :meth:`TieredKVCache.append` takes it: a pin past the bound raises
        :class:`~tieredkv.errors.PinLimitError` after the turn is stored). The turn
        extends the first ``start`` tokens of ``model_cache``: it is stored only if the
        cache holds that many tokens of ``session`` (``expected_tokens``).

        :raises ~tieredkv.errors.HistoryLengthError: the cache holds another number of
            tokens of ``session`` (none, if it was lost or dropped: store the whole history
            from 0)
        """
        tensors = self.extract(model_cache, start=start, capture=capture)
        return await cache.append(
            session,
            tensors,
            answer_tokens=answer_tokens,
            token_dim=self.token_dim,
            codec=self.codec_id,
            hint=hint,
            expected_tokens=start,
        )

    # -- before the next turn --------------------------------------------------------------
    def check_history(
        self, cache: TieredKVCache, session: str, *, expected_tokens: int | None = None
    ) -> KVMeta:
        """The session's metadata, if its stored history fits this model.

        :param expected_tokens: the conversation's length as the caller counts it (queries
            and answers so far); ``None`` to skip that check
        :raises SessionNotFoundError: if the cache holds no history for the session
        :raises HistoryMismatchError: if the codec, model fingerprint or token count differ
        """
        meta = cache.channel.get(session)
        if meta is None or meta.tier is None:
            raise SessionNotFoundError(session)
        if meta.codec != self.codec_id:
            raise HistoryMismatchError(
                session,
                f"it was stored as {meta.codec!r}, this model and codec store {self.codec_id!r}",
            )
        if expected_tokens is not None and meta.tokens != expected_tokens:
            raise HistoryMismatchError(
                session,
                f"it holds {meta.tokens} tokens, the conversation has {expected_tokens}",
            )
        self._runner.check_positions(session, meta.tokens)
        return meta

    def rebuild(
        self, stored: Mapping[str, torch.Tensor], *, start: int = 0, room: int = 0
    ) -> DynamicCache:
        """A ``DynamicCache`` from stored tensors (decoding them with the codec).

        Its layers keep K/V in buffers with ``room`` free positions after the history, so
        the next turn's forward passes append in place (see :class:`InPlaceLayer
        <tieredkv.integrations.inplace.InPlaceLayer>`; beyond ``room`` a buffer doubles).
        Runs the activation codec's re-projection, so call it from a worker thread in async
        code (as :meth:`restore` does).
        """
        if room < 0:
            raise ValueError(f"room must be a number of token positions >= 0, not {room}")
        return self._decoded(stored, start, room, adopt=False)

    def _decoded(
        self, stored: Mapping[str, torch.Tensor], start: int, room: int, *, adopt: bool
    ) -> DynamicCache:
        """Decode ``stored`` into a model cache with ``room`` free positions (adopting the
        stored buffers as its own with ``adopt``: see :meth:`ModelCaches.holding`)."""
        with torch.no_grad():
            kv = self.codec.decode(stored, self._access, start=start)
        return self._caches.holding(kv, room, adopt=adopt)

    def new_model_cache(self, room: int = 0) -> DynamicCache:
        """An empty model cache whose layers append in place, sized for ``room`` tokens."""
        return self._caches.new(room)

    async def restore(
        self,
        cache: TieredKVCache,
        session: str,
        *,
        expected_tokens: int | None = None,
        room: int = 0,
        tokens: int | None = None,
    ) -> DynamicCache:
        """The session's history as a ``DynamicCache`` on the model's device.

        Checks first (:meth:`check_history`), then loads straight into tensors on the
        model's device (``cache.load_into``) and decodes them in a worker thread. With a
        codec that decodes in place (K/V) the loaded tensors *are* the model cache's buffers
        (one copy, from the tier); ``room`` free positions after the history let the coming
        turn's tokens (query + answer) be appended without reallocating.

        :param expected_tokens: the history's length as the caller counts it (with
            ``tokens``, the length of the part restored)
        :param tokens: restore only the history's first ``tokens`` tokens (a fork point:
            see :meth:`chat_turn`'s ``parent``); ``None`` for all of them
        :raises SessionNotFoundError: if the cache holds no history for the session
        :raises HistoryMismatchError: if it does not fit the model, or holds fewer than
            ``tokens`` tokens (nothing is loaded)
        """
        if room < 0:
            raise ValueError(f"room must be a number of token positions >= 0, not {room}")
        if tokens is not None and tokens < 1:
            raise ValueError(f"tokens must be at least 1 (or None for all), not {tokens}")
        if tokens is None:
            meta = self.check_history(cache, session, expected_tokens=expected_tokens)
            want = meta.tokens
        else:
            meta = self.check_history(cache, session)
            if tokens > meta.tokens:
                raise HistoryMismatchError(
                    session, f"it holds {meta.tokens} tokens, fewer than the {tokens} asked for"
                )
            if expected_tokens is not None and expected_tokens != tokens:
                raise HistoryMismatchError(
                    session,
                    f"{tokens} of its tokens were asked for, the conversation has "
                    f"{expected_tokens}",
                )
            want = tokens
        in_place = self.codec.decodes_in_place
        out = self._allocate(meta.tokens + (room if in_place else 0))
        loaded = await cache.load_into(session, out)
        check_loaded(session, loaded, meta.tokens)
        stored = self._caches.leading(self.codec, out, want)
        model_cache = await anyio.to_thread.run_sync(
            lambda: self._decoded(stored, 0, room, adopt=in_place)
        )
        if not in_place:
            self._caches.give(out.values())  # decoded into new K/V: the loaded tensors are spare
        return model_cache

    def _allocate(self, tokens: int) -> dict[str, torch.Tensor]:
        """Tensors for ``tokens`` positions (or more) of every stored name, from the pool."""
        return self._caches.allocate(self.codec, tokens, self.device)

    async def recompute(
        self, tokens: Sequence[int] | torch.Tensor, *, max_new_tokens: int
    ) -> tuple[int, ...]:
        """Answer greedily after prefilling ``tokens`` (the whole conversation so far and
        the new query) into an empty model cache: the no-cache baseline
        (``ServingEngine(..., recompute=True)``). Reads and stores nothing; the model runs
        in a worker thread.

        :returns: the ``max_new_tokens`` answer tokens
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        prefill = token_ids(tokens, "tokens")
        if prefill.numel() == 0:
            raise ValueError("there are no tokens to prefill")
        # the in-place model cache and forward-pass code of a cached turn: only the prefill
        # differs, so the baseline's answers and costs compare with the cached turns'
        model_cache = self.new_model_cache(int(prefill.numel()) + max_new_tokens)

        def run() -> list[int]:
            with self._runner.turn():
                return self._runner.decode(
                    model_cache, prefill, max_new_tokens, None, _GREEDY, feed_last=False
                )

        return tuple(await anyio.to_thread.run_sync(run))

    # -- one chat turn ---------------------------------------------------------------------
    async def chat_turn(
        self,
        cache: TieredKVCache,
        session: str,
        query: Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int,
        history: Sequence[int] | torch.Tensor | None = None,
        eos_token_id: int | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        before_compute: Callable[[], Awaitable[None]] | None = None,
        on_loaded: Callable[[], None] | None = None,
        hint: RetentionHint | None = None,
        parent: str | None = None,
        parent_tokens: int | None = None,
    ) -> ChatTurn:
        """Run one turn end to end: restore, prefill the query, decode, store.

        With ``parent``, the turn is the first of a new conversation that continues
        ``parent``'s first ``parent_tokens`` tokens (all of them if ``None``): regenerate an
        answer (fork at the end of the question, ask the same query again... or a new
        one), edit a message (fork before it, send the edited one), or start a chat from a
        stored system prompt. The session becomes a *fork* of ``parent``
        (:doc:`/explanation/forest`): only this turn's tokens are stored, the inherited
        history stays the parent's, stored once for both.

        Decoding is greedy (argmax) by default; with ``temperature > 0`` each token is
        sampled from the softmax of the logits divided by it, restricted to the ``top_k``
        likeliest tokens and to the smallest set whose probability reaches ``top_p``.
        Sampling draws from ``generator`` (seed it for reproducible answers; it must live
        on the CPU, where the adapter samples).

        :param query: the new query's token ids (1-D, or ``[1, tokens]``)
        :param max_new_tokens: answer tokens to generate (fewer if ``eos_token_id`` comes)
        :param history: the conversation's token ids so far (every query and answer), if the
            caller keeps them: the stored history must then hold exactly that many tokens,
            and if the cache has none (never stored, dropped, lost to eviction or damage)
            they are recomputed (prefilled with the query) and stored with this turn
        :param eos_token_id: stop after generating this token (it is part of the answer)
        :param temperature: 0 for greedy decoding, else the softmax temperature
        :param top_k: sample among this many likeliest tokens at most (needs temperature)
        :param top_p: sample among the likeliest tokens whose probabilities sum to this
            (``0 < top_p <= 1``; needs temperature)
        :param generator: the random source for sampling (a CPU ``torch.Generator``)
        :param before_compute: awaited after the restore has started and before the model
            runs: a serving loop's go-ahead, so that a turn can restore its history while
            another turn computes (with ``layerwise``, the prefill may then start before
            the whole history is in); the turn's ``restore_seconds`` count from its return
        :param on_loaded: called once (on the event loop) when the history has been read
            and verified, found missing or damaged, or was not needed: with ``layerwise``
            that may be after the prefill began
        :param hint: what the caller knows of the conversation's future
            (:class:`~tieredkv.meta.RetentionHint`), applied once the turn is stored (the
            returned ``meta`` carries it); a pin that would pass the cache's
            ``max_pinned_bytes``, or its group's ``max_pinned_bytes_per_group``, is refused
            with a warning logged, and the turn and the rest of the hint are kept
        :param parent: the stored conversation this session's first turn continues (the
            session must not be stored yet); ``history``, if given, is then the fork's
            history (``parent``'s first ``parent_tokens`` tokens), recomputed and stored
            whole, as a conversation of its own, if the cache lost ``parent``
        :param parent_tokens: how many of ``parent``'s tokens the fork starts with (1 to
            all of them; ``None``: all)
        :raises HistoryMismatchError: if the stored history does not fit the model or the
            given history (nothing is generated or stored)
        :raises SessionNotFoundError: if the cache lost the session's history (its metadata
            remains, with no tier), or ``parent``'s, and ``history`` was not given to
            recompute it
        :raises ValueError: with ``parent``, if the session is stored already, or the cache
            has a tier shared between replicas that takes no forks (a Redis Cluster: pass
            the whole ``history`` without ``parent`` instead); nothing is computed
        :raises CapacityError: with ``parent``, if the turn does not fit in the tier that
            serves ``parent`` (nothing is stored)
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        pick = sampler(temperature, top_k, top_p, generator)
        if self.model.training:
            raise ValueError("the model is in training mode (dropout): call model.eval() first")
        query_ids = token_ids(query, "query")
        if query_ids.numel() == 0:
            raise ValueError("the query is empty")
        fork = None
        if parent is not None:
            fork = (parent, parent_tokens)
            check_fork(cache, session, parent, parent_tokens)
        elif parent_tokens is not None:
            raise ValueError("parent_tokens needs parent (the conversation to fork)")
        run = TurnRun(
            self,
            self._caches,
            self._runner,
            self._access,
            self._groups,
            cache=cache,
            session=session,
            query=query_ids,
            history=token_ids(history, "history") if history is not None else None,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pick=pick,
            before_compute=before_compute,
            on_loaded=on_loaded,
            hint=hint,
            fork=fork,
        )
        return await run.run()
