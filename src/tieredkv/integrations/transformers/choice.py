"""Codec choice: which codecs are exact for a model, and which one the adapter stores.

The K/V codec is exact for every model whose cache holds per-layer keys and values. A
codec that needs activations (:attr:`~tieredkv.codecs.Codec.needs_activations`: the
activation codec) is offered only where the model can be re-projected: a family in
the architecture registry whose entry matches the model's modules and re-projects a
probe's activations to the probe's own K/V, and whose RoPE does not depend on the
sequence length. :func:`inspect_model` probes the model once and makes the choice.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, TypeAlias

import msgspec
import torch

from ...codecs import ActivationCodec, Codec, KVCodec, ModelAccess, ModelSpec, missing_members
from ..architectures import Architecture
from .capture import ActivationCapture
from .errors import UnsupportedModelError
from .probe import architecture_of, cache_layout, model_type_of, rope_types, run_probe, spec_of
from .reproject import ArchitectureAccess, KVOnlyAccess, k_modules

__all__ = ["LENGTH_DEPENDENT_ROPE", "CodecAsked", "ModelFacts", "check_asked", "inspect_model"]

_log = logging.getLogger(__name__.rpartition(".")[0])  # the package's: its public name

LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
"""RoPE types whose frequencies depend on the sequence length (and on the rotary module's
state): the activation codec cannot know which frequencies each stored token was rotated
with, so they get the K/V codec."""

CodecAsked: TypeAlias = Literal["auto", "kv", "act"] | Codec
"""What a caller may ask for: a codec by name, ``"auto"``, or a codec object."""

_NAMED: dict[str, type[KVCodec] | type[ActivationCodec]] = {"kv": KVCodec, "act": ActivationCodec}


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the adapter knows of its model once it is built.

    :param windows: per layer, ``None`` (full attention) or its sliding window
    :param spec: the model's shape
    :param access: the model's re-projection (one that refuses, where none is offered)
    :param k_modules: each layer's K projection, hooked to capture activations (empty
        where none are captured)
    :param codec: the codec chosen
    :param reason: why it was chosen
    """

    windows: list[int | None]
    spec: ModelSpec
    access: ModelAccess
    k_modules: list[torch.nn.Module]
    codec: Codec
    reason: str


def check_asked(asked: object) -> None:
    """Raise ``ValueError`` unless ``asked`` is ``"auto"``, ``"kv"``, ``"act"`` or a
    :class:`~tieredkv.codecs.Codec` (naming what a codec object lacks of the protocol)."""
    if asked in ("auto", *_NAMED) or isinstance(asked, Codec):
        return
    lacks = "" if isinstance(asked, str) else f" (it lacks {', '.join(missing_members(asked))})"
    raise ValueError(f"codec must be 'auto', 'kv', 'act' or a Codec, not {asked!r}{lacks}")


def _activation_refusal(model: Any, model_type: str, entry: Architecture | None) -> str | None:
    """Why no codec that needs activations is offered for ``model`` (``None``: it is), where
    ``entry`` is its registered architecture (``None``: none registered)."""
    if entry is None:
        return f"no architecture registered for {model_type!r}"
    rope = sorted(rope_types(model.config) & set(LENGTH_DEPENDENT_ROPE))
    if rope:
        return (
            f"its RoPE type {rope[0]!r} rotates with frequencies that depend on the "
            f"sequence length, which a re-projection cannot know"
        )
    return None


def _choose(
    asked: CodecAsked, spec: ModelSpec, refused: str | None, model_type: str
) -> tuple[Codec, str]:
    """The codec to store with, and why."""
    if not isinstance(asked, str):
        if asked.needs_activations and refused is not None:
            raise UnsupportedModelError(
                f"codec {asked.name!r} needs activations, which this {model_type!r} model "
                f"cannot re-project: {refused}"
            )
        return asked, f"{asked.name}: as given"
    if asked == "auto":
        if refused is not None:
            return KVCodec(), f"K/V: the activation codec is not offered ({refused})"
        exact: tuple[Codec, ...] = (KVCodec(), ActivationCodec())
        chosen = min(exact, key=lambda c: c.bytes_per_token(spec))
        return chosen, f"{chosen.name}: the smaller of the two exact codecs"
    codec = _NAMED[asked]()
    if codec.needs_activations and refused is not None:
        raise UnsupportedModelError(
            f"the activation codec is not exact for this {model_type!r} model: "
            f"{refused}; use codec='kv' or 'auto'"
        )
    return codec, f"{asked}: as asked"


def inspect_model(model: Any, asked: CodecAsked) -> ModelFacts:
    """Probe ``model`` (one short forward pass, the model left as found), check its
    registered architecture where a codec that needs activations may be chosen, and
    choose the codec.

    :raises UnsupportedModelError: for a model whose cache is not per-layer K/V, or a
        codec asked for that is not exact for it
    :raises ArchitectureMismatchError: if the registered architecture does not match
    """
    model_type = model_type_of(model)
    windows = cache_layout(model, model_type)
    wanted = asked != "kv" if isinstance(asked, str) else asked.needs_activations
    entry = architecture_of(model_type) if wanted else None
    refused = _activation_refusal(model, model_type, entry) if wanted else "not asked for"
    offered = entry if refused is None else None
    hooked = k_modules(model, offered) if offered is not None else []
    probe = run_probe(model, model_type, windows, ActivationCapture(hooked) if hooked else None)
    spec = spec_of(model, model_type, probe, entry)
    access: ModelAccess = KVOnlyAccess(spec)
    if offered is not None:
        checked = ArchitectureAccess(model, spec, offered)
        checked.check(probe)
        access = checked
    codec, reason = _choose(asked, spec, refused, model_type)
    _log.info(
        "model %s: storing codec %r (%s), %d bytes/token (K/V %d, activation %d)",
        spec.fingerprint,
        codec.name,
        reason,
        codec.bytes_per_token(spec),
        KVCodec().bytes_per_token(spec),
        ActivationCodec().bytes_per_token(spec),
    )
    return ModelFacts(
        windows=windows,
        spec=spec,
        access=access,
        k_modules=hooked,
        codec=codec,
        reason=reason,
    )
