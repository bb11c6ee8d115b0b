"""Hugging Face ``transformers`` adapter: a model's ``DynamicCache`` <-> :class:`TieredKVCache`.

Install with ``pip install tieredkv[transformers]`` (tested with transformers 5.24). The
adapter supports any decoder-only model whose cache holds per-layer keys and values,
full-attention and sliding-window layers alike (Llama, Mistral, Qwen, Gemma, GPT-2, ...;
see ``docs/reference/supported-models.md``), batch size 1 (one conversation per session).
Models whose cache holds recurrent, state-space or linear-attention states are refused.

One turn of a conversation, with the token bookkeeping (``P`` = history tokens, ``Q`` =
query tokens, ``N`` = answer tokens)::

    restore    cache.load_into(session) -> decode (codec) -> DynamicCache of P tokens,
               positions 0 .. P-1 (refused unless codec, model fingerprint and token count
               match; see HistoryMismatchError)
    prefill    the query, positions P .. P+Q-1; its last logits give answer token a1
    decode     feed a1 .. a(N-1) one at a time (positions P+Q .. P+Q+N-2); each step's
               logits give the next token (greedy, or sampled if asked)
    complete   feed aN once more (position P+Q+N-1), logits discarded: after a decode
               loop (or ``generate()``) the last generated token has been *sampled* but
               never *fed*, so its K/V is not in the model's cache. Without this step the
               next turn would have to prefill aN in front of its query, and the stored
               history would end one token short of the conversation.
    store      the Q+N new tokens (positions P .. P+Q+N-1) become one segment:
               cache.append(session, ..., answer_tokens=N)

After the turn the stored history holds exactly the tokens of every query and answer so
far, so the next turn's restored cache equals what the uninterrupted session's cache would
hold (K/V bit-identical with the K/V codec; up to one matrix multiplication's rounding
with the activation codec). Sliding-window layers are stored whole and restored to the
window the model's own cache would keep.

The codec is chosen per model: the K/V codec works for every supported model; the
activation codec (the input of each layer's K/V projections) only for families in the
architecture registry (:mod:`tieredkv.integrations.architectures`) and only where the
re-projection is exact (not for RoPE whose frequencies depend on the sequence length:
``dynamic``, ``longrope``). ``codec="auto"`` takes the one that stores fewer bytes per
token; the choice and the reason are in :attr:`TransformersAdapter.codec_reason` and logged.

Real models load as usual (weights are not part of tieredkv)::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("facebook/opt-1.3b", dtype=torch.float16)
    adapter = TransformersAdapter(model.eval(), tag="facebook/opt-1.3b")
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import anyio
import msgspec
import torch
import torch.nn.functional as F

from ..backends.base import AddressableTier
from ..codecs import ActivationCodec, Codec, KVCodec, ModelSpec, TurnTensors
from ..errors import SessionNotFoundError, TieredKVError
from ..meta import KVMeta
from .architectures import Architecture, get_architecture

if TYPE_CHECKING:
    from transformers import DynamicCache

    from ..cache import LayerwiseLoad, TieredKVCache
    from .inplace import InPlaceLayer

__all__ = [
    "ActivationCapture",
    "ArchitectureMismatchError",
    "ChatTurn",
    "HistoryMismatchError",
    "TransformersAdapter",
    "TransformersMissingError",
    "UnsupportedModelError",
    "cache_argument",
    "model_spec",
]

_log = logging.getLogger(__name__)

_PROBE_TOKENS = 4
"""Tokens of the forward pass the adapter runs at construction to read the cache's shape."""

_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the sequence length (and on the rotary module's
state): the activation codec cannot know which frequencies each stored token was rotated
with, so they get the K/V codec."""


class TransformersMissingError(TieredKVError, ImportError):
    """The optional ``transformers`` dependency is not installed."""

    def __init__(self) -> None:
        super().__init__(
            "tieredkv.integrations.transformers needs the 'transformers' package: "
            "pip install tieredkv[transformers]"
        )


class UnsupportedModelError(TieredKVError, ValueError):
    """The model (or one of its features, or the codec asked for) is not supported."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"{detail}; the transformers adapter supports decoder-only models whose cache "
            f"holds per-layer keys and values (full or sliding-window attention), batch 1"
        )


class ArchitectureMismatchError(TieredKVError, ValueError):
    """The registered :class:`~tieredkv.integrations.architectures.Architecture` of a model
    type does not describe this model's modules: the activation codec would be wrong."""

    def __init__(self, model_type: str, detail: str) -> None:
        self.model_type = model_type
        super().__init__(
            f"the architecture registered for {model_type!r} does not match this model: "
            f"{detail}; fix the entry (register_architecture) or use codec='kv', which "
            f"needs no architecture"
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


def cache_argument(model: Any) -> str:
    """The name of the keyword argument that passes a cache to ``model``'s forward pass
    and to ``model.generate``: ``"cache"`` in recent transformers releases (5.24 has it,
    and deprecates the old name), ``"past_key_values"`` before (5.17 has only that, and
    silently ignores ``cache=``). Pass the cache as ``**{cache_argument(model): cache}``
    to support both."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _model_type(model: Any) -> str:
    config = getattr(model, "config", None)
    arch = getattr(config, "model_type", None)
    if config is None or not isinstance(arch, str):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers model (it has no config.model_type)"
        )
    return arch


def _rope_types(config: Any) -> set[str]:
    """Every ``rope_type`` named in the config (per layer type too)."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            kind = value.get("rope_type", value.get("type"))
            if isinstance(kind, str):
                found.add(kind)
            for item in value.values():
                walk(item)

    for attr in ("rope_parameters", "rope_scaling"):
        walk(getattr(config, attr, None))
    return found


def _rotary_modules(model: Any) -> list[torch.nn.Module]:
    return [
        m for m in model.modules() if "rotary" in type(m).__name__.lower() or hasattr(m, "inv_freq")
    ]


@contextmanager
def _rotary_state_kept(model: Any) -> Iterator[None]:
    """Put back every rotary module's buffers and plain attributes on exit: a forward pass
    of a dynamic or longrope model rewrites its frequencies, and the adapter's probe must
    leave the model as it found it."""
    saved = []
    for module in _rotary_modules(model):
        plain = {k: v for k, v in vars(module).items() if isinstance(v, (int, float, str))}
        buffers = {k: b.clone() for k, b in module.named_buffers(recurse=False) if b is not None}
        saved.append((module, plain, buffers))
    try:
        yield
    finally:
        for module, plain, buffers in saved:
            for k, v in plain.items():
                setattr(module, k, v)
            for k, b in buffers.items():
                setattr(module, k, b)


_CACHE_LAYER_CONTENTS = {
    "LinearAttentionLayer": "a recurrent state (a state-space or linear-attention layer)",
    "LinearAttentionAndFullAttentionLayer": "a recurrent state besides keys and values",
    "LinearAttentionAndSlidingWindowAttentionLayer": "a recurrent state besides keys and values",
    "DummyLayer": "nothing (the layer reuses another layer's keys and values, or has no attention)",
    "DynamicIndexedLayer": "keys and values plus a sparse-attention index",
}


def _cache_layout(model: Any, model_type: str) -> list[int | None]:
    """Per layer, ``None`` (full attention) or its sliding window; refuses other caches."""
    from .inplace import layer_windows

    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{model_type!r} is an encoder-decoder model")
    try:
        return layer_windows(config)
    except TypeError as exc:
        index, kind = exc.args
        holds = _CACHE_LAYER_CONTENTS.get(
            kind, "something other than the keys and values of full or sliding-window attention"
        )
        raise UnsupportedModelError(
            f"{model_type!r} ({type(model).__name__}): its cache layer {index} is a {kind}, "
            f"which holds {holds}; the adapter stores and restores a conversation per turn "
            f"as per-token keys and values, which this model does not cache"
        ) from None


class _Probe(msgspec.Struct, frozen=True, kw_only=True):
    """What one short forward pass showed of a model's cache."""

    kv_heads: int
    head_dim: int
    dtype: str
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    activations: list[torch.Tensor] | None


def _probe(
    model: Any, model_type: str, windows: list[int | None], capture: ActivationCapture | None
) -> _Probe:
    """Run :data:`_PROBE_TOKENS` tokens through ``model`` into a fresh ``DynamicCache`` and
    read every layer's K/V shape; the model (its rotary state included) is left as found."""
    transformers = _require_transformers()
    params = inspect.signature(model.forward).parameters
    if "cache" not in params and "past_key_values" not in params:
        raise UnsupportedModelError(
            f"{model_type!r} ({type(model).__name__}): its forward pass takes no transformers "
            f"Cache (neither cache= nor past_key_values=), so its keys and values cannot be read"
        )
    cache = transformers.DynamicCache(config=model.config)
    vocab = int(getattr(model.config, "vocab_size", 0) or 2)
    ids = (torch.arange(_PROBE_TOKENS) % vocab).view(1, -1).to(next(model.parameters()).device)
    kw = {cache_argument(model): cache}
    with _rotary_state_kept(model), torch.no_grad():
        if capture is not None:
            with capture:
                model(input_ids=ids, use_cache=True, **kw)
        else:
            model(input_ids=ids, use_cache=True, **kw)
    layers = list(cache.layers)
    shapes: set[tuple[int, ...]] = set()
    for i, (layer, window) in enumerate(zip(layers, windows, strict=True)):
        want = _PROBE_TOKENS if window is None else min(_PROBE_TOKENS, window - 1)
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if (
            not isinstance(keys, torch.Tensor)
            or not isinstance(values, torch.Tensor)
            or keys.dim() != 4
            or keys.shape[-2] != want
            or values.shape[-2] != want
        ):
            raise UnsupportedModelError(
                f"{model_type!r} ({type(model).__name__}) did not put keys and values of its "
                f"{_PROBE_TOKENS} probe tokens in layer {i} of the cache it was given (a "
                f"state-space or recurrent model keeps another kind of state)"
            )
        shapes.add((int(keys.shape[1]), int(keys.shape[3])))
        shapes.add((int(values.shape[1]), int(values.shape[3])))
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"{model_type!r}: the (heads, head_dim) of K and V differ between layers or between "
            f"K and V ({sorted(shapes)}); stored tensors need one shape per model"
        )
    ((kv_heads, head_dim),) = shapes
    return _Probe(
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=str(layers[0].keys.dtype).removeprefix("torch."),
        keys=[layer.keys[0] for layer in layers],
        values=[layer.values[0] for layer in layers],
        activations=capture.activations() if capture is not None else None,
    )


def _ffn_size(config: Any) -> int:
    for name in ("ffn_dim", "intermediate_size", "n_inner"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4 * int(config.hidden_size)


def _spec(model: Any, model_type: str, probe: _Probe, entry: Architecture | None) -> ModelSpec:
    config = model.config
    if entry is not None:
        rotary, gated = entry.rotary != "none", entry.gated_ffn
    else:
        rotary, gated = bool(_rotary_modules(model)), False
    return ModelSpec(
        architecture=model_type,
        layers=len(probe.keys),
        hidden_size=int(config.hidden_size),
        heads=int(config.num_attention_heads),
        kv_heads=probe.kv_heads,
        head_dim=probe.head_dim,
        dtype=probe.dtype,
        ffn_size=_ffn_size(config),
        ffn_gated=gated,
        rotary=rotary,
    )


def model_spec(model: Any) -> ModelSpec:
    """The :class:`~tieredkv.codecs.ModelSpec` of a transformers causal-LM model, read from
    its config and from the cache of a short forward pass (which leaves the model as found).

    :raises UnsupportedModelError: for a model whose cache does not hold per-layer keys
        and values (the message names the model type and the reason)
    """
    _require_transformers()
    model_type = _model_type(model)
    windows = _cache_layout(model, model_type)
    entry = _entry(model_type)
    return _spec(model, model_type, _probe(model, model_type, windows, None), entry)


def _entry(model_type: str) -> Architecture | None:
    try:
        return get_architecture(model_type)
    except KeyError:
        return None


def _k_modules(model: Any, entry: Architecture) -> list[torch.nn.Module]:
    """Each decoder layer's K projection module, as ``entry`` locates it."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, entry.layers, None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ArchitectureMismatchError(
            entry.model_type, f"its decoder has no {entry.layers!r} list of layers"
        )
    found: list[torch.nn.Module] = []
    for i, layer in enumerate(layers):
        proj = getattr(getattr(layer, entry.attention, None), entry.k_proj, None)
        if not isinstance(proj, torch.nn.Linear):
            raise ArchitectureMismatchError(
                entry.model_type,
                f"layer {i} has no nn.Linear {entry.attention}.{entry.k_proj}",
            )
        found.append(proj)
    return found


class _KVOnlyAccess:
    """The :class:`~tieredkv.codecs.ModelAccess` of a model the activation codec is not
    offered for: its shape, and nothing to re-project with."""

    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def project_kv(
        self, layer: int, activation: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise UnsupportedModelError(
            f"the activation codec is not offered for this {self._spec.architecture!r} model"
        )


class _ModelAccess(_KVOnlyAccess):
    """:class:`~tieredkv.codecs.ModelAccess` for a model of a registered architecture.

    Checks the entry against the model's modules at construction; re-projection reads the
    model's weights and calls its norm and rotary modules (whose state is left as is: the
    adapter never offers this for RoPE types that rewrite it)."""

    def __init__(self, model: Any, spec: ModelSpec, entry: Architecture) -> None:
        super().__init__(spec)
        self._entry = entry
        arch = spec.architecture

        def mismatch(detail: str) -> ArchitectureMismatchError:
            return ArchitectureMismatchError(arch, detail)

        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        layers = getattr(decoder, entry.layers, None)
        if not isinstance(layers, torch.nn.ModuleList) or len(layers) != spec.layers:
            raise mismatch(f"its decoder has no {entry.layers!r} list of {spec.layers} layers")
        self._attn: list[Any] = []
        self._k: list[torch.nn.Linear] = []
        self._v: list[torch.nn.Linear] = []
        for i, layer in enumerate(layers):
            attn = getattr(layer, entry.attention, None)
            if not isinstance(attn, torch.nn.Module):
                raise mismatch(f"layer {i} has no attention module {entry.attention!r}")
            for name, into in ((entry.k_proj, self._k), (entry.v_proj, self._v)):
                proj = getattr(attn, name, None)
                if not isinstance(proj, torch.nn.Linear):
                    raise mismatch(f"layer {i}'s attention has no nn.Linear {name!r}")
                if tuple(proj.weight.shape) != (spec.kv_size, spec.hidden_size):
                    raise mismatch(
                        f"layer {i}'s {name} weight is {tuple(proj.weight.shape)}, not "
                        f"[kv_heads * head_dim, hidden_size] = "
                        f"{(spec.kv_size, spec.hidden_size)}"
                    )
                into.append(proj)
            norms = sorted(n for n, _ in attn.named_children() if "norm" in n.lower())
            if entry.k_norm == "none" and norms:
                raise mismatch(f"layer {i}'s attention has {norms}, the entry no K norm")
            if entry.k_norm != "none":
                norm = getattr(attn, "k_norm", None)
                weight = getattr(norm, "weight", None)
                want = spec.head_dim if entry.k_norm == "head" else spec.kv_size
                if not isinstance(norm, torch.nn.Module) or (
                    isinstance(weight, torch.Tensor) and weight.shape[-1] != want
                ):
                    raise mismatch(
                        f"layer {i}'s attention has no k_norm over {want} features "
                        f"(k_norm={entry.k_norm!r})"
                    )
            self._attn.append(attn)
        self._clip: float | None = None
        if entry.clip_qkv:
            clip = getattr(model.config, "clip_qkv", None)
            self._clip = float(clip) if clip is not None else None
        self._rotary: Any = getattr(decoder, "rotary_emb", None)
        self._apply: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._layer_types: list[str] | None = None
        if entry.rotary == "none":
            if self._rotary is not None:
                raise mismatch("the decoder has a rotary_emb module, the entry no rotary")
            return
        if not isinstance(self._rotary, torch.nn.Module):
            raise mismatch("its decoder has no rotary_emb module")
        apply = getattr(sys.modules[type(self._attn[0]).__module__], "apply_rotary_pos_emb", None)
        if not callable(apply):
            raise mismatch("its modeling module has no apply_rotary_pos_emb function")
        self._apply = apply
        layer_types = getattr(model.config, "layer_types", None)
        if layer_types and "layer_type" in inspect.signature(self._rotary.forward).parameters:
            self._layer_types = list(layer_types)

    def project_kv(
        self, layer: int, activation: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec, entry = self._spec, self._entry
        kp, vp = self._k[layer], self._v[layer]
        x = activation.to(kp.weight.dtype)
        tokens = x.shape[0]
        k = F.linear(x, kp.weight, kp.bias)
        v = F.linear(x, vp.weight, vp.bias)
        if self._clip is not None:
            k, v = k.clamp(-self._clip, self._clip), v.clamp(-self._clip, self._clip)
        attn = self._attn[layer]
        if entry.k_norm == "full":
            k = attn.k_norm(k)
        k = k.view(tokens, spec.kv_heads, spec.head_dim)
        if entry.k_norm == "head":
            k = attn.k_norm(k)
        k = k.transpose(0, 1)
        v = v.view(tokens, spec.kv_heads, spec.head_dim).transpose(0, 1)
        if self._apply is None:
            return k, v
        args: tuple[Any, ...] = (x[None], positions[None])
        if self._layer_types is not None:
            args += (self._layer_types[layer],)
        cos, sin = self._rotary(*args)
        k4 = k[None]
        if entry.rotary == "partial":
            rot = cos.shape[-1]
            _, turned = self._apply(k4[..., :rot], k4[..., :rot], cos, sin)
            k4 = torch.cat([turned, k4[..., rot:]], dim=-1)
        else:
            _, k4 = self._apply(k4, k4, cos, sin)
        return k4[0], v

    def check(self, probe: _Probe) -> None:
        """Re-project the probe's activations and compare them with its cached K/V."""
        assert probe.activations is not None
        tol = 1e-3 if probe.dtype == "float32" else 5e-2
        positions = torch.arange(_PROBE_TOKENS, device=probe.keys[0].device)
        with torch.no_grad():
            for i, act in enumerate(probe.activations):
                k, v = self.project_kv(i, act, positions)
                for name, got, want in (("K", k, probe.keys[i]), ("V", v, probe.values[i])):
                    got = got[:, got.shape[1] - want.shape[1] :]
                    scale = max(1.0, float(want.abs().max()))
                    err = float((got.float() - want.float()).abs().max())
                    if err > tol * scale:
                        raise ArchitectureMismatchError(
                            self._spec.architecture,
                            f"re-projecting layer {i}'s activation does not give the {name} "
                            f"the model cached (largest difference {err:.3g})",
                        )


class ActivationCapture:
    """Records the input of every layer's K projection while active (forward pre-hooks).

    One conversation at a time (batch size 1). Use as a context manager; the hooks are
    removed on exit. Every forward pass of the model while it is active is recorded, so
    run no other work on the model meanwhile.

    :param modules: each layer's K projection module, in layer order
    """

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self._modules = modules
        self._chunks: list[list[torch.Tensor]] = [[] for _ in modules]
        self._handles: list[Any] = []

    def __enter__(self) -> ActivationCapture:
        for i, module in enumerate(self._modules):
            self._handles.append(module.register_forward_pre_hook(self._hook(i)))
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

    :param answer: the generated token ids (greedy or sampled)
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

    Construction runs one short forward pass (:data:`_PROBE_TOKENS` tokens, into a fresh
    cache; the model is left as found) to read the shape of the model's K/V, and, where the
    activation codec is offered, checks that re-projecting that pass's activations gives
    back its K/V.

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
        names the model type and why), or ``codec="act"`` where it is not exact
    :raises ArchitectureMismatchError: if the registered architecture of the model's type
        does not match its modules (not raised with ``codec="kv"``, which needs none)
    :raises TransformersMissingError: (an ``ImportError``) without transformers installed
    """

    def __init__(
        self,
        model: Any,
        *,
        codec: Literal["auto", "kv", "act"] | Codec = "auto",
        tag: str | None = None,
        recycle_bytes: int = 512 << 20,
        layerwise: bool = False,
    ) -> None:
        _require_transformers()
        if not (codec in ("auto", "kv", "act") or isinstance(codec, Codec)):
            raise ValueError(f"codec must be 'auto', 'kv', 'act' or a Codec, not {codec!r}")
        if tag is not None and not tag:
            raise ValueError("tag must be non-empty text (or None)")
        if recycle_bytes < 0:
            raise ValueError(f"recycle_bytes must be >= 0, not {recycle_bytes}")
        self.model = model
        model_type = _model_type(model)
        self._windows = _cache_layout(model, model_type)
        kv = KVCodec()
        wants_act = codec != "kv" and not isinstance(codec, KVCodec)
        entry = _entry(model_type) if wants_act else None
        rope = sorted(_rope_types(model.config) & set(_LENGTH_DEPENDENT_ROPE))
        act_refused: str | None = None
        if not wants_act:
            act_refused = "not asked for"
        elif entry is None:
            act_refused = f"no architecture registered for {model_type!r}"
        elif rope:
            act_refused = (
                f"its RoPE type {rope[0]!r} rotates with frequencies that depend on the "
                f"sequence length, which a re-projection cannot know"
            )
        self._k_modules: list[torch.nn.Module] = []
        if entry is not None and act_refused is None:
            self._k_modules = _k_modules(model, entry)
        capture = ActivationCapture(self._k_modules) if self._k_modules else None
        probe = _probe(model, model_type, self._windows, capture)
        self.spec = _spec(model, model_type, probe, entry)
        self._access: _ModelAccess | None = None
        if entry is not None and act_refused is None:
            self._access = _ModelAccess(model, self.spec, entry)
            self._access.check(probe)
        act = ActivationCodec()
        kv_bytes, act_bytes = kv.bytes_per_token(self.spec), act.bytes_per_token(self.spec)
        chosen: Codec
        if isinstance(codec, str) and codec in ("auto", "act") and act_refused is not None:
            if codec == "act":
                raise UnsupportedModelError(
                    f"the activation codec is not exact for this {model_type!r} model: "
                    f"{act_refused}; use codec='kv' or 'auto'"
                )
            chosen, why = kv, f"K/V: the activation codec is not offered ({act_refused})"
        elif codec == "auto":
            chosen = act if act_bytes < kv_bytes else kv
            why = f"{chosen.name}: the smaller of the two exact codecs"
        elif codec == "act":
            chosen, why = act, "act: as asked"
        elif codec == "kv":
            chosen, why = kv, "kv: as asked"
        else:
            assert isinstance(codec, Codec)
            if codec.needs_activations and act_refused is not None:
                raise UnsupportedModelError(
                    f"codec {codec.name!r} needs activations, which this {model_type!r} model "
                    f"cannot re-project: {act_refused}"
                )
            chosen, why = codec, f"{codec.name}: as given"
        self.codec: Codec = chosen
        """The codec in use."""
        self.codec_reason = why
        """Why :attr:`codec` was chosen, e.g. ``"act: the smaller of the two exact codecs"``."""
        _log.info(
            "model %s: storing codec %r (%s), %d bytes/token (K/V %d, activation %d)",
            self.spec.fingerprint,
            chosen.name,
            why,
            chosen.bytes_per_token(self.spec),
            kv_bytes,
            act_bytes,
        )
        self.codec_id = f"{chosen.name}/{self.spec.fingerprint}" + (f"@{tag}" if tag else "")
        """The codec string stored with every segment: ``codec/fingerprint[@tag]``."""
        forward = inspect.signature(model.forward).parameters
        self._cache_kw = cache_argument(model)
        self._keep_logits = "logits_to_keep" in forward
        self._turn_lock = threading.Lock()
        from .inplace import BufferPool

        self._pool: BufferPool | None = BufferPool(recycle_bytes) if recycle_bytes else None
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
        return torch.device(next(self.model.parameters()).device)

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
        return ActivationCapture(self._k_modules if self.codec.needs_activations else [])

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
        for i, layer in enumerate(layers):
            k, v = _layer_tokens(layer, i, start, total)
            if k.shape[0] != 1:
                raise ValueError("the adapter stores one conversation per session (batch 1)")
            keys.append(k[0])
            values.append(v[0])
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
            access = self._access if self._access is not None else _KVOnlyAccess(self.spec)
            kv = self.codec.decode(stored, access, start=start)
        return self._model_cache(kv, room, adopt=False)

    def _model_cache(
        self, kv: list[tuple[torch.Tensor, torch.Tensor]], room: int, *, adopt: bool
    ) -> DynamicCache:
        """``kv`` (per layer ``[kv_heads, tokens, head_dim]``) as a cache with at least
        ``room`` free positions after the history. With ``adopt``, K/V that are the leading
        positions of ``[kv_heads, capacity, head_dim]`` buffers with that room become the
        cache's buffers (no copy; the caller gives them up); otherwise they are copied."""
        from .inplace import in_place_cache

        layers: list[InPlaceLayer] = []
        for (k, v), window in zip(kv, self._windows, strict=True):
            tokens = k.shape[1]
            kb, vb = (_buffer_of(k), _buffer_of(v)) if adopt else (None, None)
            if kb is None or vb is None or min(kb.shape[1], vb.shape[1]) < tokens + room:
                kb = self._empty((k.shape[0], tokens + room, k.shape[2]), 1, k.dtype, k.device)
                vb = self._empty((v.shape[0], tokens + room, v.shape[2]), 1, v.dtype, v.device)
                kb[:, :tokens].copy_(k)
                vb[:, :tokens].copy_(v)
            layers.append(_in_place_layer(window, keys=kb[None], values=vb[None], length=tokens))
        return in_place_cache(self.model.config, layers)

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
        from .inplace import in_place_cache

        return in_place_cache(self.model.config, [_in_place_layer(w, room) for w in self._windows])

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
        _check_loaded(session, tokens, meta.tokens)
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
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        before_compute: Callable[[], Awaitable[None]] | None = None,
        on_loaded: Callable[[], None] | None = None,
    ) -> ChatTurn:
        """Run one turn end to end: restore, prefill the query, decode, store.

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
        :raises HistoryMismatchError: if the stored history does not fit the model or the
            given history (nothing is generated or stored)
        :raises SessionNotFoundError: if the cache lost the session's history (its metadata
            remains, with no tier) and ``history`` was not given to recompute it
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        pick = _sampler(temperature, top_k, top_p, generator)
        if self.model.training:
            raise ValueError("the model is in training mode (dropout): call model.eval() first")
        query_ids = _ids(query, "query")
        if query_ids.numel() == 0:
            raise ValueError("the query is empty")
        history_ids = _ids(history, "history") if history is not None else None
        expected = int(history_ids.numel()) if history_ids is not None else None
        model_cache: Any = None
        turn = _Turn(before_compute, on_loaded)
        try:
            if session in cache:
                try:
                    if self._streams(cache, session):
                        return await self._streamed_turn(
                            cache, session, query_ids, expected, max_new_tokens, eos_token_id,
                            pick, turn,
                        )  # fmt: skip
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
                # the cache knew this conversation but lost its KV: starting afresh would
                # drop the context without a word
                raise SessionNotFoundError(session)
        finally:
            turn.loaded()
        began = await turn.go(time.perf_counter())
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
            self._compute_turn, model_cache, prefill, restored, max_new_tokens, eos_token_id, pick
        )
        return await self._store_turn(
            cache,
            session,
            model_cache,
            answer,
            tensors,
            restored=restored,
            recomputed=recomputed,
            stored=int(prefill.numel()) + len(answer),
            times=(began, restored_at, time.perf_counter()),
        )

    async def _store_turn(
        self,
        cache: TieredKVCache,
        session: str,
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
        began, restored_at, computed_at = times
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
            stored_tokens=stored,
            history_tokens=meta.tokens,
            codec=self.codec_id,
            meta=meta,
            restore_seconds=restored_at - began,
            compute_seconds=computed_at - restored_at,
            store_seconds=time.perf_counter() - computed_at,
        )

    # -- layer-wise restore ----------------------------------------------------------------
    def _streams(self, cache: TieredKVCache, session: str) -> bool:
        """Whether :meth:`chat_turn` streams this session's history in layer by layer: asked
        for, a codec that decodes per layer, and a history in a tier that must be read
        (not in memory the model can copy from at once)."""
        if not self.layerwise or not isinstance(self.codec, KVCodec | ActivationCodec):
            return False
        if isinstance(self.codec, ActivationCodec) and self._access is None:
            return False
        where = cache.where(session)
        tier = next((t for t in cache.tiers if t.name == where), None)
        return tier is not None and not isinstance(tier, AddressableTier)

    def _layer_groups(self) -> list[list[str]]:
        """The stored names, one group per layer, in the order the codec stores them."""
        names = list(self.codec.layout(self.spec))
        per = len(names) // self.spec.layers
        return [names[i * per : (i + 1) * per] for i in range(self.spec.layers)]

    async def _streamed_turn(
        self,
        cache: TieredKVCache,
        session: str,
        query: torch.Tensor,
        expected: int | None,
        max_new_tokens: int,
        eos_token_id: int | None,
        pick: Callable[[torch.Tensor], int],
        turn: _Turn,
    ) -> ChatTurn:
        """A turn whose history streams in layer by layer while its prefill runs.

        :raises SessionNotFoundError: the history is gone or was found damaged (nothing
            computed from it is returned or stored)
        """
        meta = self.check_history(cache, session, expected_tokens=expected)
        room = int(query.numel()) + max_new_tokens
        self._check_positions(session, meta.tokens + room)
        in_place = isinstance(self.codec, KVCodec)
        out = self._allocate(meta.tokens + (room if in_place else 0))
        async with cache.load_layerwise(session, out, self._layer_groups()) as load:
            _check_loaded(session, load.tokens, meta.tokens)
            model_cache = self._gated_cache(out, load, room)
            load.when_done(turn.loaded)
            began = await turn.go(time.perf_counter())
            restored_at = time.perf_counter()
            answer, tensors = await anyio.to_thread.run_sync(
                self._compute_turn,
                model_cache,
                query,
                load.tokens,
                max_new_tokens,
                eos_token_id,
                pick,
            )
            await load.finished()  # every byte verified: the answer stands
        computed_at = time.perf_counter()
        if not in_place and self._pool is not None:
            self._pool.give(out.values())  # re-projected into the layers' own buffers
        return await self._store_turn(
            cache,
            session,
            model_cache,
            answer,
            tensors,
            restored=load.tokens,
            recomputed=0,
            stored=int(query.numel()) + len(answer),
            times=(began, restored_at, computed_at),
        )

    def _gated_cache(
        self, out: dict[str, torch.Tensor], load: LayerwiseLoad, room: int
    ) -> DynamicCache:
        """A model cache over ``out`` whose layer ``i`` waits for group ``i`` of ``load``
        (and, with the activation codec, re-projects it into its own buffers first)."""
        from .inplace import in_place_cache

        tokens = load.tokens
        layers: list[InPlaceLayer] = []
        if isinstance(self.codec, KVCodec):
            for i, window in enumerate(self._windows):
                k, v = out[f"layers.{i}.k"], out[f"layers.{i}.v"]
                layer = _in_place_layer(window, keys=k[None], values=v[None], length=tokens)
                layer.hold_until(functools.partial(_wait, load, i))
                layers.append(layer)
            return in_place_cache(self.model.config, layers)
        access = self._access
        assert access is not None
        spec = self.spec
        dtype = getattr(torch, spec.dtype)
        positions = torch.arange(tokens, device=self.device)
        for i, window in enumerate(self._windows):
            shape = (spec.kv_heads, tokens + room, spec.head_dim)
            kb = self._empty(shape, 1, dtype, self.device)
            vb = self._empty(shape, 1, dtype, self.device)
            act = out[f"layers.{i}.act"].narrow(0, 0, tokens)

            def project(
                i: int = i, kb: torch.Tensor = kb, vb: torch.Tensor = vb, act: torch.Tensor = act
            ) -> None:
                _wait(load, i)
                with torch.no_grad():
                    k, v = access.project_kv(i, act, positions)
                kb[:, :tokens].copy_(k)
                vb[:, :tokens].copy_(v)

            layer = _in_place_layer(window, keys=kb[None], values=vb[None], length=tokens)
            layer.hold_until(project)
            layers.append(layer)
        return in_place_cache(self.model.config, layers)

    def _compute_turn(
        self,
        model_cache: Any,
        prefill: torch.Tensor,
        start: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        pick: Callable[[torch.Tensor], int],
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """Prefill, decode, feed the last token; return the answer and the segment."""
        with self._turn_lock, torch.no_grad(), self._maybe_capture() as capture:
            token = pick(self._step(model_cache, prefill))
            answer = [token]
            while len(answer) < max_new_tokens and token != eos_token_id:
                token = pick(self._step(model_cache, torch.tensor([token])))
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

    def _step(self, model_cache: Any, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids``; the logits of the last position, ``[vocab]``."""
        kwargs: dict[str, Any] = {self._cache_kw: model_cache, "use_cache": True}
        if self._keep_logits:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids.view(1, -1).to(self.device), **kwargs)
        logits: torch.Tensor = out.logits[0, -1]
        return logits


class _Turn:
    """A turn's hooks to its caller: the go-ahead to compute, and the history's arrival."""

    def __init__(
        self, go: Callable[[], Awaitable[None]] | None, loaded: Callable[[], None] | None
    ) -> None:
        self._go = go
        self._loaded = loaded

    def loaded(self) -> None:
        """Report the history read (once)."""
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            loaded()

    async def go(self, now: float) -> float:
        """Wait for the go-ahead (once); when the turn's restore is counted from."""
        go, self._go = self._go, None
        if go is None:
            return now
        await go()
        return time.perf_counter()


def _check_loaded(session: str, tokens: int, expected: int) -> None:
    """Raise :class:`HistoryMismatchError` if a load brought ``tokens`` positions where the
    session's metadata said ``expected``."""
    if tokens != expected:
        raise HistoryMismatchError(
            session, f"it holds {tokens} tokens where its metadata said {expected}"
        )


def _wait(load: LayerwiseLoad, group: int) -> None:
    """Block the model's thread until ``group`` of a streamed restore is in place."""
    load.wait(group)


def _sampler(
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


def _in_place_layer(window: int | None, capacity: int = 0, **buffers: Any) -> InPlaceLayer:
    """An in-place cache layer: full attention (``window`` ``None``) or sliding-window."""
    from .inplace import InPlaceLayer, InPlaceSlidingLayer

    if window is None:
        return InPlaceLayer(capacity, **buffers)
    return InPlaceSlidingLayer(window, capacity, **buffers)


def _layer_tokens(
    layer: Any, index: int, start: int, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``index``'s K and V of positions ``start .. total-1`` (``[batch, heads, tokens,
    head_dim]``), from one of the adapter's in-place layers or a transformers layer."""
    from .inplace import InPlaceLayer

    if int(layer.get_seq_length()) != total:
        raise ValueError(
            f"layer {index} of the model cache holds {layer.get_seq_length()} "
            f"tokens, layer 0 {total}"
        )
    if isinstance(layer, InPlaceLayer):
        return layer.tokens(start)
    keys, values = layer.keys, layer.values
    first = total - int(keys.shape[-2])  # a sliding-window layer keeps only the last ones
    if start < first:
        raise ValueError(
            f"layer {index} of the model cache (a {type(layer).__name__}) no longer holds "
            f"positions {start} .. {first - 1}: they left its sliding window; run the turn on "
            f"a cache from adapter.restore() or adapter.new_model_cache(), which keep them"
        )
    return keys[..., start - first :, :], values[..., start - first :, :]


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
