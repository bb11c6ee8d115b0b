"""The codec protocol: what is stored per token of a conversation, and what it costs.

A codec sits between a model and :class:`~tieredkv.TieredKVCache`. After a turn it
**encodes** the turn's new tokens into named tensors for
:meth:`~tieredkv.TieredKVCache.append`; before the next turn it **decodes** the stored
history back into each layer's K and V. Two codecs ship (Bidaw, FAST'26, section 3):

* :class:`~tieredkv.codecs.KVCodec` stores K and V as they are (nothing to decode);
* :class:`~tieredkv.codecs.ActivationCodec` stores the normalized activation that feeds a
  layer's K and V projections and re-projects it on load: half the bytes of K/V for a
  multi-head-attention (MHA) model, for ``4 d^2`` FLOPs per token per layer.

Codecs are model-agnostic: they see a model through :class:`ModelSpec` (its shape) and
:class:`ModelAccess` (its re-projection of K/V from an activation), which an integration such
as :mod:`tieredkv.integrations.transformers` provides. Layouts (per layer ``i``, batch
dimension dropped: one conversation per session)::

    KVCodec         layers.{i}.k, layers.{i}.v   [kv_heads, tokens, head_dim]
    ActivationCodec layers.{i}.act              [tokens, hidden_size]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import msgspec
import torch

from ..errors import TieredKVError

__all__ = [
    "Codec",
    "CodecInputError",
    "ModelAccess",
    "ModelSpec",
    "TurnTensors",
    "cost_efficiency",
    "layer_flops_per_token",
    "layer_groups",
    "missing_members",
]


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of a decoder-only model, as far as its cached tensors are concerned.

    :param architecture: model family (``config.model_type``: ``"opt"``, ``"llama"``, ...)
    :param layers: decoder layers
    :param hidden_size: ``d``, the width of the residual stream
    :param heads: attention (query) heads
    :param kv_heads: key/value heads (``== heads`` for MHA, fewer for GQA)
    :param head_dim: width of one head
    :param dtype: the model's floating dtype name (``"float32"``, ``"bfloat16"``, ...)
    :param ffn_size: width of the feed-forward layer (0 if unknown; only for FLOP counts)
    :param ffn_gated: whether the feed-forward layer has three matrices (gate, up, down, as in
        Llama and Qwen2) rather than two (OPT)
    :param rotary: whether K carries a rotary position embedding (Llama, Qwen2)
    """

    architecture: str
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    ffn_size: int = 0
    ffn_gated: bool = False
    rotary: bool = False

    @property
    def kv_size(self) -> int:
        """Width of K (and of V) per token per layer: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def q_size(self) -> int:
        """Width of Q per token per layer: ``heads * head_dim``."""
        return self.heads * self.head_dim

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def fingerprint(self) -> str:
        """Everything stored tensors depend on, as text: ``opt-L2-d64-h4-kv4-hd16-float32``."""
        return (
            f"{self.architecture}-L{self.layers}-d{self.hidden_size}-h{self.heads}"
            f"-kv{self.kv_heads}-hd{self.head_dim}-{self.dtype}"
        )


@dataclass(frozen=True, slots=True)
class TurnTensors:
    """What a turn produced for its new tokens, per layer, one conversation (no batch).

    :param keys: each layer's new K, ``[kv_heads, tokens, head_dim]`` (rotary applied, as the
        model's cache holds it)
    :param values: each layer's new V, same shape
    :param activations: each layer's input of its K/V projections, ``[tokens, hidden_size]``,
        or ``None`` if they were not captured
    """

    keys: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]
    activations: Sequence[torch.Tensor] | None = None


@runtime_checkable
class ModelAccess(Protocol):
    """What a codec needs of a live model to turn stored tensors back into K and V."""

    @property
    def spec(self) -> ModelSpec:
        """The model's shape."""
        ...

    def project_kv(
        self, layer: int, activation: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V, ``[kv_heads, tokens, head_dim]``, from the input of its
        K/V projections ``activation`` ``[tokens, hidden_size]`` at absolute ``positions``
        ``[tokens]``: what the model's attention computes and caches (projections with
        their biases, any K normalization, the rotary embedding on K). It must not change
        the model's state."""
        ...


@runtime_checkable
class Codec(Protocol):
    """Encodes a turn's new tokens for storage; decodes a stored history into K and V.

    Implementations are stateless apart from configuration, and thread-safe: decoding runs
    in a worker thread.
    """

    @property
    def name(self) -> str:
        """Short name (``"kv"``, ``"act"``); the prefix of the codec string stored with
        each segment."""
        ...

    @property
    def needs_activations(self) -> bool:
        """Whether :meth:`encode` needs :attr:`TurnTensors.activations` (and decoding
        re-projects them with :meth:`ModelAccess.project_kv`): an integration offers such
        a codec only for models it can re-project."""
        ...

    @property
    def decodes_in_place(self) -> bool:
        """Whether :meth:`decode` and :meth:`decode_layer` return the stored tensors
        themselves as K and V (views, nothing computed, so they may be called before the
        bytes land): a history then loads straight into the buffers the model's cache
        goes on appending to."""
        ...

    def token_dim(self, spec: ModelSpec) -> int:
        """The token dimension of the tensors :meth:`encode` returns (non-negative)."""
        ...

    def layout(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        """Name and shape of every stored tensor, ``-1`` for the token dimension; each has
        the model's dtype. Listed layer by layer (layer 0's names first), the same number
        of names per layer (see :func:`layer_groups`)."""
        ...

    def encode(self, turn: TurnTensors, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """Named tensors to store for the turn's new tokens (for ``cache.append``)."""
        ...

    def decode(
        self, stored: Mapping[str, torch.Tensor], model: ModelAccess, *, start: int = 0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``(K, V)``, ``[kv_heads, tokens, head_dim]``, from stored tensors
        whose first token sits at absolute position ``start``."""
        ...

    def decode_layer(
        self, stored: Mapping[str, torch.Tensor], model: ModelAccess, layer: int, *, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(K, V)`` from its own stored tensors alone (its group of
        :func:`layer_groups`), on the caller's current CUDA stream: a layer-wise restore
        decodes each layer as it lands, in the model's forward pass."""
        ...

    def bytes_per_token(self, spec: ModelSpec) -> int:
        """Bytes stored per token, all layers together (before segment padding)."""
        ...

    def decode_flops_per_token(self, spec: ModelSpec) -> int:
        """FLOPs spent per token, all layers together, to decode (0 for K/V)."""
        ...


class CodecInputError(TieredKVError, ValueError):
    """Tensors given to a codec do not fit the model (layers, shapes, missing names)."""

    def __init__(self, codec: str, detail: str) -> None:
        super().__init__(f"codec {codec!r}: {detail}")


def layer_flops_per_token(spec: ModelSpec) -> int:
    """FLOPs of the linear layers of every decoder layer, for one token.

    This is what caching *any* tensor from which K and V can be rebuilt saves over
    recomputing the token (attention scores, norms and activations are left out: they are
    small and depend on the context length). For OPT-like models with ``ffn = 4d`` it is
    ``24 d^2`` per layer: Q, K, V and output projections (``8 d^2``) and the two
    feed-forward matrices (``16 d^2``), counting a multiply-add as two FLOPs.
    """
    d = spec.hidden_size
    attention = 2 * d * (spec.q_size + 2 * spec.kv_size) + 2 * spec.q_size * d
    ffn = 2 * d * spec.ffn_size * (3 if spec.ffn_gated else 2)
    return spec.layers * (attention + ffn)


def cost_efficiency(codec: Codec, spec: ModelSpec) -> float:
    """FLOPs saved per stored byte: ``(layer FLOPs - decode FLOPs) / bytes``, per token.

    The higher, the more computation a byte of host memory spares (Bidaw's *cost
    efficiency*). Divide by 1000 for GFLOP per MB (10^6 bytes).
    """
    saved = layer_flops_per_token(spec) - codec.decode_flops_per_token(spec)
    return saved / codec.bytes_per_token(spec)


def check_layers(codec: str, stored: Mapping[str, torch.Tensor], names: Sequence[str]) -> None:
    """Raise :class:`CodecInputError` unless ``stored`` has exactly ``names``."""
    missing = [n for n in names if n not in stored]
    extra = sorted(set(stored) - set(names))
    if missing or extra:
        detail = []
        if missing:
            detail.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if extra:
            detail.append(f"unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}")
        raise CodecInputError(codec, f"stored tensors do not fit this model ({'; '.join(detail)})")


def missing_members(obj: object) -> list[str]:
    """The members of the :class:`Codec` protocol that ``obj`` lacks (none: it is a
    codec), to say what a codec written for an older protocol must add."""
    return sorted(
        name for name in vars(Codec) if not name.startswith("_") and not hasattr(obj, name)
    )


def layer_groups(codec: Codec, spec: ModelSpec) -> list[list[str]]:
    """The names of ``codec``'s :meth:`~Codec.layout`, one group per layer, in layer order
    (what :meth:`~Codec.decode_layer` takes, and what a layer-wise load lands in turn).

    :raises CodecInputError: if the layout does not split evenly into ``spec.layers`` groups
    """
    names = list(codec.layout(spec))
    per, rest = divmod(len(names), spec.layers)
    if per == 0 or rest:
        raise CodecInputError(
            codec.name,
            f"its layout lists {len(names)} tensors, not the same number for each of the "
            f"{spec.layers} layers",
        )
    return [names[i * per : (i + 1) * per] for i in range(spec.layers)]


def decode_by_layer(
    codec: Codec, stored: Mapping[str, torch.Tensor], model: ModelAccess, start: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:meth:`Codec.decode` as :meth:`Codec.decode_layer` of each layer in turn, after
    checking that ``stored`` holds exactly the layout's names."""
    groups = layer_groups(codec, model.spec)
    check_layers(codec.name, stored, [name for group in groups for name in group])
    return [
        codec.decode_layer({name: stored[name] for name in group}, model, i, start=start)
        for i, group in enumerate(groups)
    ]
