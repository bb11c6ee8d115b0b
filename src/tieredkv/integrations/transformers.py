"""Hugging Face ``transformers`` adapter: a model's ``DynamicCache`` <-> :class:`TieredKVCache`.

Install with ``pip install tieredkv[transformers]`` (tested with transformers 5.24). The
adapter supports decoder-only OPT, Llama (multi-head and grouped-query attention) and Qwen2
models with full attention, batch size 1 (one conversation per session).

One turn of a conversation, with the token bookkeeping (``P`` = history tokens, ``Q`` =
query tokens, ``N`` = answer tokens)::

    restore    cache.load_into(session) -> decode (codec) -> DynamicCache of P tokens,
               positions 0 .. P-1 (refused unless codec, model fingerprint and token count
               match; see HistoryMismatchError)
    prefill    the query, positions P .. P+Q-1; its last logits give answer token a1
    decode     feed a1 .. a(N-1) one at a time (positions P+Q .. P+Q+N-2); each step's
               logits give the next token; greedy (argmax)
    complete   feed aN once more (position P+Q+N-1), logits discarded: after a decode
               loop (or ``generate()``) the last generated token has been *sampled* but
               never *fed*, so its K/V is not in the model's cache. Without this step the
               next turn would have to prefill aN in front of its query, and the stored
               history would end one token short of the conversation.
    store      the Q+N new tokens (positions P .. P+Q+N-1) become one segment:
               cache.append(session, ..., answer_tokens=N)

After the turn the stored history holds exactly the tokens of every query and answer so
far, so the next turn's restored cache equals what recomputing the conversation from its
tokens would give (up to float rounding; K/V are bit-identical with the K/V codec).

The codec is chosen per model: the activation codec (the input of each layer's K/V
projections) where it takes fewer bytes per token than K and V (multi-head attention:
``hidden_size < 2 * kv_heads * head_dim``), K/V otherwise (grouped-query attention). The
choice is in :attr:`TransformersAdapter.codec` and logged once.

Real models load as usual (weights are not part of tieredkv)::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("facebook/opt-1.3b", dtype=torch.float16)
    adapter = TransformersAdapter(model.eval(), tag="facebook/opt-1.3b")
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import anyio
import msgspec
import torch

from ..codecs import ActivationCodec, Codec, KVCodec, ModelSpec, TurnTensors
from ..errors import SessionNotFoundError, TieredKVError
from ..meta import KVMeta

if TYPE_CHECKING:
    from transformers import DynamicCache

    from ..cache import TieredKVCache

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ActivationCapture",
    "ChatTurn",
    "HistoryMismatchError",
    "TransformersAdapter",
    "TransformersMissingError",
    "UnsupportedModelError",
    "cache_argument",
    "model_spec",
]

_log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "opt", "qwen2")
"""``config.model_type`` values the adapter knows how to read."""

_ROTARY = {"llama": True, "opt": False, "qwen2": True}
_GATED_FFN = {"llama": True, "opt": False, "qwen2": True}


class TransformersMissingError(TieredKVError, ImportError):
    """The optional ``transformers`` dependency is not installed."""

    def __init__(self) -> None:
        super().__init__(
            "tieredkv.integrations.transformers needs the 'transformers' package: "
            "pip install tieredkv[transformers]"
        )


class UnsupportedModelError(TieredKVError, ValueError):
    """The model's architecture (or one of its features) is not supported by the adapter."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"{detail}; the transformers adapter supports decoder-only models with full "
            f"attention of these architectures (config.model_type): "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


class HistoryMismatchError(TieredKVError, ValueError):
    """A stored history does not fit the model (codec, fingerprint or token count): refused.

    Nothing was loaded into the model. Recompute the conversation from its tokens instead
    (drop the session and pass ``history=`` to :meth:`TransformersAdapter.chat_turn`).
    """

    def __init__(self, session: str, detail: str) -> None:
        self.session = session
        shown = session if len(session) <= 80 else session[:77] + "..."
        super().__init__(
            f"stored history of session {shown!r} cannot be used with this model: {detail}; "
            f"drop the session and recompute it from its tokens"
        )


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise TransformersMissingError() from exc
    return transformers


def _decoder_layers(model: Any) -> Sequence[Any]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"cannot find the decoder layers of {type(model).__name__}")
    return list(layers)


def cache_argument(model: Any) -> str:
    """The name of the keyword argument that passes a cache to ``model``'s forward pass
    and to ``model.generate``: ``"cache"`` in recent transformers releases (5.24 has it,
    and deprecates the old name), ``"past_key_values"`` before (5.17 has only that, and
    silently ignores ``cache=``). Pass the cache as ``**{cache_argument(model): cache}``
    to support both."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_spec(model: Any) -> ModelSpec:
    """The :class:`~tieredkv.codecs.ModelSpec` of a transformers causal-LM model.

    :raises UnsupportedModelError: for an architecture outside
        :data:`SUPPORTED_ARCHITECTURES`, or sliding-window attention layers
    """
    config = getattr(model, "config", None)
    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {arch!r} ({type(model).__name__})")
    assert config is not None
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types) or (
        getattr(config, "use_sliding_window", False)
    ):
        raise UnsupportedModelError(
            f"{arch} model with sliding-window attention layers ({sorted(set(layer_types))})"
        )
    layers = _decoder_layers(model)
    attn = layers[0].self_attn
    head_dim = int(attn.head_dim)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    ffn = int(getattr(config, "ffn_dim", None) or getattr(config, "intermediate_size", 0) or 0)
    dtype = str(attn.k_proj.weight.dtype).removeprefix("torch.")
    return ModelSpec(
        architecture=arch,
        layers=len(layers),
        hidden_size=int(config.hidden_size),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        ffn_size=ffn,
        ffn_gated=_GATED_FFN[arch],
        rotary=_ROTARY[arch],
    )


class _ModelAccess:
    """:class:`~tieredkv.codecs.ModelAccess` for a transformers model."""

    def __init__(self, model: Any, spec: ModelSpec) -> None:
        self._spec = spec
        self._layers = _decoder_layers(model)
        self._rotary: Any = None
        self._apply: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        if spec.rotary:
            self._rotary = model.get_decoder().rotary_emb
            attn = self._layers[0].self_attn
            # the modeling module's own function: the exact formula attention applies
            self._apply = sys.modules[type(attn).__module__].apply_rotary_pos_emb

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def kv_weights(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        attn = self._layers[layer].self_attn
        return attn.k_proj.weight, attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias

    def rotate_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._apply is None:
            return keys
        k = keys.unsqueeze(0)  # [1, kv_heads, tokens, head_dim]
        cos, sin = self._rotary(k, positions.unsqueeze(0))
        _, rotated = self._apply(k, k, cos, sin)
        return rotated[0]


class ActivationCapture:
    """Records the input of every layer's K projection while active (forward pre-hooks).

    One conversation at a time (batch size 1). Use as a context manager; the hooks are
    removed on exit. Every forward pass of the model while it is active is recorded, so
    run no other work on the model meanwhile.
    """

    def __init__(self, layers: Sequence[Any]) -> None:
        self._layers = layers
        self._chunks: list[list[torch.Tensor]] = [[] for _ in layers]
        self._handles: list[Any] = []

    def __enter__(self) -> ActivationCapture:
        for i, layer in enumerate(self._layers):
            self._handles.append(layer.self_attn.k_proj.register_forward_pre_hook(self._hook(i)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, i: int) -> Callable[[torch.nn.Module, tuple[Any, ...]], None]:
        def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if x.dim() != 3 or x.shape[0] != 1:
                raise ValueError(
                    f"activation capture supports batch size 1 (one conversation), got an "
                    f"input of shape {tuple(x.shape)}"
                )
            self._chunks[i].append(x[0].detach())

        return record

    @property
    def tokens(self) -> int:
        """Tokens recorded so far."""
        return sum(int(c.shape[0]) for c in self._chunks[0]) if self._chunks else 0

    def activations(self) -> list[torch.Tensor]:
        """Each layer's recorded activation, ``[tokens, hidden_size]``, in forward order."""
        return [torch.cat(chunks, dim=0) for chunks in self._chunks]


class ChatTurn(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`TransformersAdapter.chat_turn` did.

    :param answer: the generated token ids (greedy), ``answer_tokens`` of them
    :param restored_tokens: history tokens restored from the cache (0 if it had none)
    :param recomputed_tokens: history tokens prefilled from ``history=`` because the cache
        had no usable copy
    :param stored_tokens: tokens of the segment appended: recomputed + query + answer
    :param history_tokens: tokens of the whole stored history after the turn
    :param codec: the codec string stored with the segment
    :param meta: the session's metadata after the append
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


class TransformersAdapter:
    """Moves one model's per-conversation KV between transformers and :class:`TieredKVCache`.

    :param model: a causal-LM model of a supported architecture
        (:data:`SUPPORTED_ARCHITECTURES`), in eval mode
    :param codec: ``"auto"`` (activation where smaller than K/V, else K/V), ``"kv"``,
        ``"act"``, or a :class:`~tieredkv.codecs.Codec`
    :param tag: appended to the model fingerprint (``"...@tag"``), e.g. the checkpoint name
        and revision, so that a history stored with other weights of the same shape is
        refused too
    :param recycle_bytes: host buffers (K/V of finished turns on a CPU model) kept for the
        next turns' restores, at most; 0 to allocate afresh every turn (see
        :class:`~tieredkv.integrations.inplace.BufferPool`)
    :raises UnsupportedModelError: for an unsupported architecture
    :raises TransformersMissingError: (an ``ImportError``) without transformers installed
    """

    def __init__(
        self,
        model: Any,
        *,
        codec: Literal["auto", "kv", "act"] | Codec = "auto",
        tag: str | None = None,
        recycle_bytes: int = 512 << 20,
    ) -> None:
        _require_transformers()
        self.model = model
        self.spec = model_spec(model)
        self._layers = _decoder_layers(model)
        self._access = _ModelAccess(model, self.spec)
        kv, act = KVCodec(), ActivationCodec()
        kv_bytes, act_bytes = kv.bytes_per_token(self.spec), act.bytes_per_token(self.spec)
        chosen: Codec
        if codec == "auto":
            chosen = act if act_bytes < kv_bytes else kv
        elif codec == "kv":
            chosen = kv
        elif codec == "act":
            chosen = act
        elif isinstance(codec, Codec):
            chosen = codec
        else:
            raise ValueError(f"codec must be 'auto', 'kv', 'act' or a Codec, not {codec!r}")
        _log.info(
            "model %s: storing codec %r (%s), %d bytes/token (K/V %d, activation %d)",
            self.spec.fingerprint,
            chosen.name,
            "the smaller" if codec == "auto" else "as asked",
            chosen.bytes_per_token(self.spec),
            kv_bytes,
            act_bytes,
        )
        if tag is not None and not tag:
            raise ValueError("tag must be non-empty text (or None)")
        self.codec: Codec = chosen
        """The codec in use."""
        self.codec_id = f"{chosen.name}/{self.spec.fingerprint}" + (f"@{tag}" if tag else "")
        """The codec string stored with every segment: ``codec/fingerprint[@tag]``."""
        forward = inspect.signature(model.forward).parameters
        self._cache_kw = cache_argument(model)
        self._keep_logits = "logits_to_keep" in forward
        self._turn_lock = threading.Lock()
        if recycle_bytes < 0:
            raise ValueError(f"recycle_bytes must be >= 0, not {recycle_bytes}")
        from .inplace import BufferPool

        self._pool: BufferPool | None = BufferPool(recycle_bytes) if recycle_bytes else None

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
        return torch.device(self._layers[0].self_attn.k_proj.weight.device)

    # -- after a turn ----------------------------------------------------------------------
    def capture(self) -> ActivationCapture:
        """Hooks that record what the activation codec stores, for one turn.

        Run the turn's forward passes inside ``with adapter.capture() as cap:``, then pass
        ``capture=cap`` to :meth:`extract` or :meth:`store`.
        """
        return ActivationCapture(self._layers)

    def extract(
        self, model_cache: Any, *, start: int, capture: ActivationCapture | None = None
    ) -> dict[str, torch.Tensor]:
        """The named tensors to append for the tokens ``start ..`` of ``model_cache``.

        :param model_cache: the model's ``DynamicCache`` after the turn (batch size 1)
        :param start: tokens it held before the turn (the restored history)
        :param capture: the turn's :meth:`capture` (required by the activation codec, which
            checks that it recorded exactly the new tokens)
        :raises ValueError: if the cache has no new tokens or does not fit the model
        """
        layers = list(getattr(model_cache, "layers", ()))
        if len(layers) != self.spec.layers:
            raise ValueError(
                f"the model cache has {len(layers)} layers, the model {self.spec.layers}"
            )
        total = int(model_cache.get_seq_length())
        new = total - start
        if new <= 0:
            raise ValueError(f"the model cache holds {total} tokens: none after {start}")
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for layer in layers:
            if layer.keys.shape[0] != 1:
                raise ValueError("the adapter stores one conversation per session (batch 1)")
            keys.append(layer.keys[0, :, start:, :])
            values.append(layer.values[0, :, start:, :])
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
    ) -> KVMeta:
        """:meth:`extract` the turn's new tokens and append them to ``cache``."""
        tensors = self.extract(model_cache, start=start, capture=capture)
        return await cache.append(
            session,
            tensors,
            answer_tokens=answer_tokens,
            token_dim=self.token_dim,
            codec=self.codec_id,
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
        self._check_positions(session, meta.tokens)
        return meta

    def _check_positions(self, session: str, tokens: int) -> None:
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if not self.spec.rotary and limit is not None and tokens > limit:
            raise HistoryMismatchError(
                session, f"{tokens} tokens exceed the model's {limit} learned positions"
            )

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
        with torch.no_grad():
            kv = self.codec.decode(stored, self._access, start=start)
        return self._model_cache(kv, room, adopt=False)

    def _model_cache(
        self, kv: list[tuple[torch.Tensor, torch.Tensor]], room: int, *, adopt: bool
    ) -> DynamicCache:
        """``kv`` (per layer ``[kv_heads, tokens, head_dim]``) as a cache with at least
        ``room`` free positions after the history. With ``adopt``, K/V that are the leading
        positions of ``[kv_heads, capacity, head_dim]`` buffers with that room become the
        cache's buffers (no copy; the caller gives them up); otherwise they are copied."""
        transformers = _require_transformers()
        from .inplace import InPlaceLayer, in_place_cache

        layers: list[InPlaceLayer] = []
        for k, v in kv:
            tokens = k.shape[1]
            kb, vb = (_buffer_of(k), _buffer_of(v)) if adopt else (None, None)
            if kb is None or vb is None or min(kb.shape[1], vb.shape[1]) < tokens + room:
                kb = self._empty((k.shape[0], tokens + room, k.shape[2]), 1, k.dtype, k.device)
                vb = self._empty((v.shape[0], tokens + room, v.shape[2]), 1, v.dtype, v.device)
                kb[:, :tokens].copy_(k)
                vb[:, :tokens].copy_(v)
            layers.append(InPlaceLayer(keys=kb[None], values=vb[None], length=tokens))
        cache = in_place_cache(self.model.config, layers)
        if cache is None:  # a layer kind the in-place buffers do not model: the usual way
            cache = transformers.DynamicCache(
                ddp_cache_data=[(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv],
                config=self.model.config,
            )
        return cache

    def _empty(
        self, shape: tuple[int, ...], dim: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialized tensor with ``shape`` or more positions along ``dim`` (from the
        pool on a CPU model)."""
        if self._pool is not None and device.type == "cpu":
            return self._pool.take(shape, dim, dtype, device)
        return torch.empty(shape, dtype=dtype, device=device)

    def new_model_cache(self, room: int = 0) -> DynamicCache:
        """An empty model cache whose layers append in place, sized for ``room`` tokens."""
        from .inplace import InPlaceLayer, in_place_cache

        cache = in_place_cache(
            self.model.config, [InPlaceLayer(room) for _ in range(self.spec.layers)]
        )
        if cache is None:
            cache = _require_transformers().DynamicCache(config=self.model.config)
        return cache

    async def restore(
        self,
        cache: TieredKVCache,
        session: str,
        *,
        expected_tokens: int | None = None,
        room: int = 0,
    ) -> DynamicCache:
        """The session's history as a ``DynamicCache`` on the model's device.

        Checks first (:meth:`check_history`), then loads straight into tensors on the
        model's device (``cache.load_into``) and decodes them in a worker thread. With the
        K/V codec the loaded tensors *are* the model cache's buffers (one copy, from the
        tier); ``room`` free positions after the history let the coming turn's tokens
        (query + answer) be appended without reallocating.

        :raises SessionNotFoundError: if the cache holds no history for the session
        :raises HistoryMismatchError: if it does not fit the model (nothing is loaded)
        """
        if room < 0:
            raise ValueError(f"room must be a number of token positions >= 0, not {room}")
        meta = self.check_history(cache, session, expected_tokens=expected_tokens)
        in_place = isinstance(self.codec, KVCodec)
        out = self._allocate(meta.tokens + (room if in_place else 0))
        tokens = await cache.load_into(session, out)
        if tokens != meta.tokens:
            raise HistoryMismatchError(
                session, f"it holds {tokens} tokens where its metadata said {meta.tokens}"
            )
        if in_place:
            kv = [
                (out[f"layers.{i}.k"][:, :tokens], out[f"layers.{i}.v"][:, :tokens])
                for i in range(self.spec.layers)
            ]
            return await anyio.to_thread.run_sync(lambda: self._model_cache(kv, room, adopt=True))
        dims = {name: shape.index(-1) for name, shape in self.codec.layout(self.spec).items()}
        stored = {name: t.narrow(dims[name], 0, tokens) for name, t in out.items()}
        model_cache = await anyio.to_thread.run_sync(lambda: self.rebuild(stored, room=room))
        if self._pool is not None:
            self._pool.give(out.values())  # decoded into new K/V: the loaded tensors are spare
        return model_cache

    def _allocate(self, tokens: int) -> dict[str, torch.Tensor]:
        """Tensors for ``tokens`` positions (or more) of every stored name, from the pool."""
        dtype = getattr(torch, self.spec.dtype)
        return {
            name: self._empty(
                tuple(tokens if d == -1 else d for d in shape), shape.index(-1), dtype, self.device
            )
            for name, shape in self.codec.layout(self.spec).items()
        }

    def _recycle(self, model_cache: Any) -> None:
        """Hand a finished turn's buffers to the pool (the turn owned them)."""
        if self._pool is None:
            return
        from .inplace import InPlaceLayer

        buffers: list[torch.Tensor] = []
        for layer in getattr(model_cache, "layers", ()):
            if isinstance(layer, InPlaceLayer):
                buffers.extend(layer.release())
        self._pool.give(buffers)

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
    ) -> ChatTurn:
        """Run one turn end to end: restore, prefill the query, decode greedily, store.

        :param query: the new query's token ids (1-D, or ``[1, tokens]``)
        :param max_new_tokens: answer tokens to generate (fewer if ``eos_token_id`` comes)
        :param history: the conversation's token ids so far (every query and answer), if the
            caller keeps them: the stored history must then hold exactly that many tokens,
            and if the cache has none (never stored, dropped, lost to eviction or damage)
            they are recomputed (prefilled with the query) and stored with this turn
        :param eos_token_id: stop after generating this token (it is part of the answer)
        :raises HistoryMismatchError: if the stored history does not fit the model or the
            given history (nothing is generated or stored)
        :raises SessionNotFoundError: if the cache lost the session's history (its metadata
            remains, with no tier) and ``history`` was not given to recompute it
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        if self.model.training:
            raise ValueError("the model is in training mode (dropout): call model.eval() first")
        query_ids = _ids(query, "query")
        if query_ids.numel() == 0:
            raise ValueError("the query is empty")
        history_ids = _ids(history, "history") if history is not None else None
        expected = int(history_ids.numel()) if history_ids is not None else None
        model_cache: Any = None
        began = time.perf_counter()
        if session in cache:
            try:
                model_cache = await self.restore(
                    cache,
                    session,
                    expected_tokens=expected,
                    room=int(query_ids.numel()) + max_new_tokens,
                )
            except SessionNotFoundError:  # lost or found damaged meanwhile
                if history_ids is None:
                    raise
        elif session in cache.channel and history_ids is None:
            # the cache knew this conversation but lost its KV: starting afresh would drop
            # the context without a word
            raise SessionNotFoundError(session)
        if model_cache is not None:
            restored = int(model_cache.get_seq_length())
            prefill = query_ids
        else:
            restored = 0
            prefill = query_ids if history_ids is None else torch.cat([history_ids, query_ids])
            model_cache = self.new_model_cache(int(prefill.numel()) + max_new_tokens)
        recomputed = prefill.numel() - query_ids.numel()
        self._check_positions(session, restored + prefill.numel() + max_new_tokens)
        restored_at = time.perf_counter()
        answer, tensors = await anyio.to_thread.run_sync(
            self._compute_turn, model_cache, prefill, restored, max_new_tokens, eos_token_id
        )
        computed_at = time.perf_counter()
        meta = await cache.append(
            session,
            tensors,
            answer_tokens=len(answer),
            token_dim=self.token_dim,
            codec=self.codec_id,
        )
        # the segment is stored (copied): this turn's buffers are free for the next one
        self._recycle(model_cache)
        return ChatTurn(
            answer=tuple(answer),
            restored_tokens=restored,
            recomputed_tokens=recomputed,
            stored_tokens=int(prefill.numel()) + len(answer),
            history_tokens=meta.tokens,
            codec=self.codec_id,
            meta=meta,
            restore_seconds=restored_at - began,
            compute_seconds=computed_at - restored_at,
            store_seconds=time.perf_counter() - computed_at,
        )

    def _compute_turn(
        self,
        model_cache: Any,
        prefill: torch.Tensor,
        start: int,
        max_new_tokens: int,
        eos_token_id: int | None,
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Prefill, greedy decode, feed the last token; return the answer and the segment."""
        with self._turn_lock, torch.no_grad(), self._maybe_capture() as capture:
            token = self._step(model_cache, prefill)
            answer = [token]
            while len(answer) < max_new_tokens and token != eos_token_id:
                token = self._step(model_cache, torch.tensor([token]))
                answer.append(token)
            # the last answer token was sampled, never fed: feed it so its K/V is stored
            self._step(model_cache, torch.tensor([token]))
            tensors = self.extract(model_cache, start=start, capture=capture)
        return answer, tensors

    @contextmanager
    def _maybe_capture(self) -> Iterator[ActivationCapture | None]:
        if not self.codec.needs_activations:
            yield None
            return
        with self.capture() as capture:
            yield capture

    def _step(self, model_cache: Any, ids: torch.Tensor) -> int:
        kwargs: dict[str, Any] = {self._cache_kw: model_cache, "use_cache": True}
        if self._keep_logits:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids.view(1, -1).to(self.device), **kwargs)
        return int(out.logits[0, -1].argmax())


def _buffer_of(t: torch.Tensor) -> torch.Tensor | None:
    """The ``[heads, capacity, dim]`` tensor of which ``t`` is the leading positions, if it
    is such a view (``t`` itself when it is whole)."""
    base = t._base if t._base is not None else t
    if (
        base.dim() == 3
        and base.is_contiguous()
        and base.shape[0] == t.shape[0]
        and base.shape[2] == t.shape[2]
        and t.data_ptr() == base.data_ptr()
        and t.stride() == base.stride()
    ):
        return base
    return None


def _ids(ids: Sequence[int] | torch.Tensor, what: str) -> torch.Tensor:
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ValueError(f"{what} must be a 1-D sequence of token ids (or [1, tokens])")
    return t.to(torch.long).cpu()
