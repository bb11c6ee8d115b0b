"""Which model families the activation codec can re-project, and how: the architecture registry.

Storing K and V (:class:`~tieredkv.codecs.KVCodec`) needs nothing from a model but its
cache, so the transformers adapter offers it for every decoder whose cache holds per-layer
keys and values. Storing the activation that feeds the K/V projections
(:class:`~tieredkv.codecs.ActivationCodec`) means redoing, on load, what the model's
attention does between that activation and its cache: the projections (and their biases),
a key normalization, the rotary embedding. That differs per family, so the activation codec
is offered only for the families registered here, each described by an
:class:`Architecture`:

>>> from tieredkv.integrations.architectures import get_architecture
>>> arch = get_architecture("qwen3")
>>> (arch.k_proj, arch.k_norm, arch.rotary)
('k_proj', 'head', 'full')

Names are ``config.model_type`` values. A family joins with :func:`register_architecture`;
the adapter checks an entry against the model's modules (and re-projects a probe's
activations against the probe's own K/V) when it is constructed, so a wrong entry is an
error there, never a wrong answer later.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..errors import TieredKVError

__all__ = [
    "KV_ONLY_FAMILIES",
    "Architecture",
    "UnknownArchitectureError",
    "architecture_names",
    "get_architecture",
    "register_architecture",
    "supported_models_table",
]


class UnknownArchitectureError(TieredKVError, KeyError):
    """No :class:`Architecture` is registered for a ``model_type``."""

    def __init__(self, model_type: str, known: list[str]) -> None:
        self.model_type = model_type
        super().__init__(
            f"no architecture registered for model_type {model_type!r}: the activation codec "
            f"cannot re-project its K/V (registered: {', '.join(known)}); use codec='kv', or "
            f"describe the family with register_architecture()"
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class Architecture(msgspec.Struct, frozen=True, kw_only=True):
    """How one family's attention turns its input activation into the K and V it caches.

    Module names are attributes: ``layers`` of the decoder (``model.get_decoder()``),
    ``attention`` of each decoder layer, the rest of the attention module; each K/V
    projection must be an ``nn.Linear`` (bias or not).

    :param model_type: the ``config.model_type`` this describes
    :param layers: the attribute of the decoder (``model.get_decoder()``) that lists its
        layers
    :param attention: the attention module's attribute on a decoder layer
    :param k_proj: the K projection's attribute on the attention module
    :param v_proj: the V projection's attribute on the attention module
    :param k_norm: a normalization of K before the rotary embedding: ``"none"``, ``"head"``
        (the attention's ``k_norm`` module applied per head, ``[tokens, kv_heads,
        head_dim]``: Qwen3, Gemma 3) or ``"full"`` (applied to the whole projection,
        ``[tokens, kv_heads * head_dim]``: OLMo 2)
    :param rotary: ``"none"`` (learned or no positions: OPT), ``"full"`` (the modeling
        module's ``apply_rotary_pos_emb`` over the whole head) or ``"partial"`` (that
        function over the first ``cos.shape[-1]`` dims of each head, the rest passed
        through: StableLM); cos and sin come from the decoder's ``rotary_emb`` module
    :param clip_qkv: the projections are clamped to ``+-config.clip_qkv`` when it is set
        (OLMo)
    :param gated_ffn: the feed-forward layer has three matrices (gate, up, down), for
        the cost model
    :param notes: one line for the supported-models table
    """

    model_type: str
    layers: str = "layers"
    attention: str = "self_attn"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    k_norm: Literal["none", "head", "full"] = "none"
    rotary: Literal["none", "full", "partial"] = "full"
    clip_qkv: bool = False
    gated_ffn: bool = True
    notes: str = ""


def _llama_like(model_type: str, notes: str, **kw: object) -> Architecture:
    return msgspec.convert({"model_type": model_type, "notes": notes, **kw}, Architecture)


_ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        _llama_like("llama", "separate Q/K/V, RoPE"),
        _llama_like("mistral", "separate Q/K/V, RoPE; sliding window"),
        _llama_like("mixtral", "separate Q/K/V, RoPE; sliding window; MoE"),
        _llama_like("qwen2", "separate Q/K/V with biases, RoPE"),
        _llama_like("qwen3", "per-head K norm, RoPE", k_norm="head"),
        _llama_like("qwen3_moe", "per-head K norm, RoPE; MoE", k_norm="head"),
        _llama_like("gemma", "separate Q/K/V, RoPE"),
        _llama_like("gemma2", "RoPE; sliding/full layers"),
        _llama_like(
            "gemma3_text", "per-head K norm, RoPE per layer type; sliding/full", k_norm="head"
        ),
        _llama_like("granite", "separate Q/K/V, RoPE"),
        _llama_like("starcoder2", "Q/K/V biases, RoPE; sliding window", gated_ffn=False),
        _llama_like("olmo", "RoPE; optional Q/K/V clipping", clip_qkv=True),
        _llama_like("olmo2", "K norm over the whole projection, RoPE", k_norm="full"),
        _llama_like("stablelm", "partial rotary (without qk_layernorm)", rotary="partial"),
        _llama_like("cohere", "interleaved RoPE (without q/k norm)"),
        _llama_like("opt", "Q/K/V biases, learned positions", rotary="none", gated_ffn=False),
    )
}

KV_ONLY_FAMILIES: dict[str, str] = {
    "phi3": "fused QKV projection (qkv_proj), partial rotary",
    "gpt2": "fused QKV projection (Conv1D c_attn), learned positions",
    "gpt_neox": "fused, per-head interleaved QKV projection, partial rotary",
    "gptj": "rotary embedding computed inside the attention module",
    "falcon": "fused QKV projection, grouped layouts that vary with the config",
}
"""Families the test suite runs with the K/V codec alone, and why the activation codec
is not registered for them (any decoder with a per-layer K/V cache works with K/V)."""


def get_architecture(model_type: str) -> Architecture:
    """The registered :class:`Architecture` of ``model_type``.

    :raises UnknownArchitectureError: (a ``KeyError``) if none is registered
    """
    try:
        return _ARCHITECTURES[model_type]
    except KeyError:
        raise UnknownArchitectureError(model_type, list(_ARCHITECTURES)) from None


def architecture_names() -> list[str]:
    """Registered ``model_type`` values, in registration order."""
    return list(_ARCHITECTURES)


def register_architecture(architecture: Architecture) -> None:
    """Register (or replace) how ``architecture.model_type`` re-projects K and V.

    The entry is checked against each model when a
    :class:`~tieredkv.integrations.transformers.TransformersAdapter` is built for it.

    :raises TypeError: for anything but an :class:`Architecture`
    :raises ValueError: for an empty ``model_type`` or a field outside its choices
    """
    if not isinstance(architecture, Architecture):
        raise TypeError(f"register an Architecture, not {type(architecture).__name__}")
    if not architecture.model_type:
        raise ValueError("an Architecture needs a non-empty model_type")
    try:  # a Struct's __init__ does not check its Literal fields: convert() does
        msgspec.convert(msgspec.structs.asdict(architecture), Architecture)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid Architecture for {architecture.model_type!r}: {exc}") from None
    _ARCHITECTURES[architecture.model_type] = architecture


def supported_models_table() -> str:
    """The supported-models table (Markdown), from the registry and :data:`KV_ONLY_FAMILIES`."""
    rows = ["| `model_type` | codecs | re-projection |", "| --- | --- | --- |"]
    for name, arch in _ARCHITECTURES.items():
        rows.append(f"| `{name}` | K/V, activation | {arch.notes} |")
    for name, why in KV_ONLY_FAMILIES.items():
        if name not in _ARCHITECTURES:
            rows.append(f"| `{name}` | K/V | not registered: {why} |")
    return "\n".join(rows) + "\n"
