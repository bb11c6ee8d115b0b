"""Model probing: what a transformers model's cache holds, and the model's shape.

:func:`cache_layout` reads from the config which layers are full attention and which
slide (and refuses caches that hold anything but per-layer keys and values); :func:`run_probe`
runs :data:`PROBE_TOKENS` tokens through the model into a fresh cache and reads the K/V
each layer cached, leaving the model as found; :func:`spec_of` turns that into the
:class:`~tieredkv.codecs.ModelSpec` the codecs work with.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import msgspec
import torch

from ...codecs import ModelSpec
from ..architectures import Architecture, get_architecture
from ..forward import cache_argument
from .capture import ActivationCapture
from .errors import UnsupportedModelError, require_transformers

__all__ = [
    "PROBE_TOKENS",
    "Probe",
    "architecture_of",
    "cache_layout",
    "model_spec",
    "model_type_of",
    "run_probe",
    "rope_types",
    "spec_of",
]

PROBE_TOKENS = 4
"""Tokens of the forward pass the adapter runs at construction to read the cache's shape."""


def model_type_of(model: Any) -> str:
    config = getattr(model, "config", None)
    arch = getattr(config, "model_type", None)
    if config is None or not isinstance(arch, str):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers model (it has no config.model_type)"
        )
    return arch


def rope_types(config: Any) -> set[str]:
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


def rotary_modules(model: Any) -> list[torch.nn.Module]:
    return [
        m for m in model.modules() if "rotary" in type(m).__name__.lower() or hasattr(m, "inv_freq")
    ]


@contextmanager
def rotary_state_kept(model: Any) -> Iterator[None]:
    """Put back every rotary module's buffers and plain attributes on exit: a forward pass
    of a dynamic or longrope model rewrites its frequencies, and the adapter's probe must
    leave the model as it found it."""
    saved = []
    for module in rotary_modules(model):
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


def cache_layout(model: Any, model_type: str) -> list[int | None]:
    """Per layer, ``None`` (full attention) or its sliding window; refuses other caches."""
    from ..inplace import layer_windows

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


class Probe(msgspec.Struct, frozen=True, kw_only=True):
    """What one short forward pass showed of a model's cache."""

    kv_heads: int
    head_dim: int
    dtype: str
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    activations: list[torch.Tensor] | None


def run_probe(
    model: Any, model_type: str, windows: list[int | None], capture: ActivationCapture | None
) -> Probe:
    """Run :data:`PROBE_TOKENS` tokens through ``model`` into a fresh ``DynamicCache`` and
    read every layer's K/V shape; the model (its rotary state included) is left as found."""
    transformers = require_transformers()
    params = inspect.signature(model.forward).parameters
    if "cache" not in params and "past_key_values" not in params:
        raise UnsupportedModelError(
            f"{model_type!r} ({type(model).__name__}): its forward pass takes no transformers "
            f"Cache (neither cache= nor past_key_values=), so its keys and values cannot be read"
        )
    cache = transformers.DynamicCache(config=model.config)
    vocab = int(getattr(model.config, "vocab_size", 0) or 2)
    ids = (torch.arange(PROBE_TOKENS) % vocab).view(1, -1).to(next(model.parameters()).device)
    kw = {cache_argument(model): cache}
    with rotary_state_kept(model), torch.no_grad():
        if capture is not None:
            with capture:
                model(input_ids=ids, use_cache=True, **kw)
        else:
            model(input_ids=ids, use_cache=True, **kw)
    layers = list(cache.layers)
    shapes: set[tuple[int, ...]] = set()
    for i, (layer, window) in enumerate(zip(layers, windows, strict=True)):
        want = PROBE_TOKENS if window is None else min(PROBE_TOKENS, window - 1)
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
                f"{PROBE_TOKENS} probe tokens in layer {i} of the cache it was given (a "
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
    return Probe(
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=str(layers[0].keys.dtype).removeprefix("torch."),
        keys=[layer.keys[0] for layer in layers],
        values=[layer.values[0] for layer in layers],
        activations=capture.activations() if capture is not None else None,
    )


def ffn_size(config: Any) -> int:
    """The feed-forward width the config names (four times the hidden size if none)."""
    for name in ("ffn_dim", "intermediate_size", "n_inner"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4 * int(config.hidden_size)


def spec_of(model: Any, model_type: str, probe: Probe, entry: Architecture | None) -> ModelSpec:
    """The model's :class:`~tieredkv.codecs.ModelSpec`, from its config, the probe and
    its registered architecture (``None``: rotary if it has a rotary module, FFN ungated)."""
    config = model.config
    if entry is not None:
        rotary, gated = entry.rotary != "none", entry.gated_ffn
    else:
        rotary, gated = bool(rotary_modules(model)), False
    return ModelSpec(
        architecture=model_type,
        layers=len(probe.keys),
        hidden_size=int(config.hidden_size),
        heads=int(config.num_attention_heads),
        kv_heads=probe.kv_heads,
        head_dim=probe.head_dim,
        dtype=probe.dtype,
        ffn_size=ffn_size(config),
        ffn_gated=gated,
        rotary=rotary,
    )


def model_spec(model: Any) -> ModelSpec:
    """The :class:`~tieredkv.codecs.ModelSpec` of a transformers causal-LM model, read from
    its config and from the cache of a short forward pass (which leaves the model as found).

    :raises UnsupportedModelError: for a model whose cache does not hold per-layer keys
        and values (the message names the model type and the reason)
    """
    require_transformers()
    model_type = model_type_of(model)
    windows = cache_layout(model, model_type)
    entry = architecture_of(model_type)
    return spec_of(model, model_type, run_probe(model, model_type, windows, None), entry)


def architecture_of(model_type: str) -> Architecture | None:
    """The registered architecture of ``model_type``, or ``None``."""
    try:
        return get_architecture(model_type)
    except KeyError:
        return None
